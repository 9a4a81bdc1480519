// In-place SGD over n parameters, PyTorch's formula (dampening 0):
//   g = G + weight_decay * P
//   if momentum != 0: M = momentum * M + g; g = nesterov ? g + momentum * M : M
//   P -= lr * g
// lr comes from stepvals[0] ([lr, 1-beta1^t, 1-beta2^t, t]), so a schedule needs no re-recording.
// M is not touched when momentum == 0, so any buffer may be bound there.
// The body of sgd.comp and, with CLIP defined, of sgd_clip.comp, which first scales every G by
// clip[1] (grad_norm's factor: clipping by global norm; loss_scale_update's, the loss scale
// divided out) and skips the step where clip[2] is set. With HALVES defined (the _half variants),
// it also writes H, each updated weight's float16 copy (mixed precision's operand copies, rounded
// by half_bits.glsl as cast.comp rounds them, from the value just written): one invocation per word
// of two halves, so no two share one; for odd n the high half of the last word keeps its contents.

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) buffer PBuf { float P[]; };
layout(std430, set = 0, binding = 1) readonly buffer GBuf { float G[]; };
layout(std430, set = 0, binding = 2) buffer MBuf { float M[]; };
layout(std430, set = 0, binding = 3) readonly buffer StepBuf { float stepvals[]; };
#ifdef CLIP
layout(std430, set = 0, binding = 4) readonly buffer ClipBuf { float clip[]; };
#endif
#ifdef HALVES
#include "half_bits.glsl"
#ifdef CLIP
layout(std430, set = 0, binding = 5) buffer HBuf { uint H[]; };
#else
layout(std430, set = 0, binding = 4) buffer HBuf { uint H[]; };
#endif
#endif

layout(push_constant) uniform Push {
    uint n;
    float momentum;
    uint nesterov;
    float weight_decay;
} pc;

// Parameter i after the step (written back, with its momentum).
float updated(uint i, float lr, float scale) {
    float p = P[i];
    // precise: no fused multiply-add, so the gradient is rounded once before the decay is
    // added with or without a clip factor (a loss scale divided out then gives sgd.comp's bits).
#ifdef CLIP
    precise float g = G[i] * scale;
#else
    precise float g = G[i];
#endif
    g = g + pc.weight_decay * p;
    if (pc.momentum != 0.0) {
        precise float m = pc.momentum * M[i] + g;
        M[i] = m;
        g = pc.nesterov != 0u ? g + pc.momentum * m : m;
    }
    // precise: every variant (sgd.comp, sgd_half.comp) rounds the step alike (see adam.glsl).
    precise float result = p - lr * g;
    P[i] = result;
    return result;
}

#include "update_loop.glsl"
