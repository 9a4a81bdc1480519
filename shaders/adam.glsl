// In-place Adam / AdamW over n parameters, PyTorch's formulas. Step values come from
// stepvals = [lr, 1-beta1^t, 1-beta2^t, t], so the step count needs no re-recording.
//   decoupled (AdamW): P *= 1 - lr * weight_decay;  else (Adam): g = G + weight_decay * P
//   M = beta1 * M + (1 - beta1) * g;  V = beta2 * V + (1 - beta2) * g^2
//   P -= lr * (M / (1-beta1^t)) / (sqrt(V / (1-beta2^t)) + eps)
// The body of adam.comp and, with CLIP defined, of adam_clip.comp, which first scales every G by
// clip[1] (grad_norm's factor: clipping by global norm; loss_scale_update's, the loss scale
// divided out) and skips the step where clip[2] is set. With HALVES defined (the _half variants),
// it also writes H, each updated weight's float16 copy, as sgd.glsl does.

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) buffer PBuf { float P[]; };
layout(std430, set = 0, binding = 1) readonly buffer GBuf { float G[]; };
layout(std430, set = 0, binding = 2) buffer MBuf { float M[]; };
layout(std430, set = 0, binding = 3) buffer VBuf { float V[]; };
layout(std430, set = 0, binding = 4) readonly buffer StepBuf { float stepvals[]; };
#ifdef CLIP
layout(std430, set = 0, binding = 5) readonly buffer ClipBuf { float clip[]; };
#endif
#ifdef HALVES
#include "half_bits.glsl"
#ifdef CLIP
layout(std430, set = 0, binding = 6) buffer HBuf { uint H[]; };
#else
layout(std430, set = 0, binding = 5) buffer HBuf { uint H[]; };
#endif
#endif

layout(push_constant) uniform Push {
    uint n;
    float beta1;
    float beta2;
    float eps;
    float weight_decay;
    uint decoupled;
    float one_minus_beta1;  // 1 - beta1, computed in double on the host (PyTorch's rounding)
    float one_minus_beta2;
} pc;

// Parameter i after the step (written back, with its moments). precise: no fused multiply-adds,
// which a compiler places as the code around it suggests (NVIDIA's differed between adam.comp and
// adam_half.comp), so every variant rounds each operation alike and the copy's master is the same.
float updated(uint i, float lr, float scale) {
    float bias1 = stepvals[1];
    float bias2 = stepvals[2];
    precise float p = P[i];
#ifdef CLIP
    precise float g = G[i] * scale;
#else
    precise float g = G[i];
#endif
    if (pc.decoupled != 0u) {
        p *= 1.0 - lr * pc.weight_decay;
    } else {
        g += pc.weight_decay * p;
    }
    precise float m = pc.beta1 * M[i] + pc.one_minus_beta1 * g;
    precise float v = pc.beta2 * V[i] + pc.one_minus_beta2 * g * g;
    M[i] = m;
    V[i] = v;
    precise float denom = sqrt(v / bias2) + pc.eps;
    precise float result = p - lr * (m / bias1) / denom;
    P[i] = result;
    return result;
}

#include "update_loop.glsl"
