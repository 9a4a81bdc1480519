// Clipping by global norm, in two launches with a barrier between (no float atomics: the sums
// follow one fixed order, so every run gets the same bits).
// parts > 0 (launched with parts workgroups): Y[w] = the sum of X[i]^2 over the i that workgroup
//   w's invocations stride over (i = w * size + lid, then += parts * size), joined by a
//   shared-memory tree.
// parts == 0 (one workgroup): s = the sum of the partials X[0..n), then Y[0] = sqrt(s) (the norm)
//   and Y[1] = min(1, max_norm / (sqrt(s) + 1e-6)), torch.nn.utils.clip_grad_norm_'s factor, which
//   sgd_clip and adam_clip scale every gradient by, and Y[2] = 0 (skip nothing: see
//   loss_scale_update.comp). A NaN norm gives 1 and an infinite one 0, so a non-finite gradient
//   still reaches the weights and the loss, as without clipping.
// The tree halves the workgroup size, which must be a power of two (the registry's 256).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint n;
    uint parts;
    float max_norm;
} pc;

shared float partial[gl_WorkGroupSize.x];

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint size = gl_WorkGroupSize.x;
    bool squares = pc.parts != 0u;
    uint stride = squares ? gl_NumWorkGroups.x * size : size;
    float acc = 0.0;
    for (uint i = gl_WorkGroupID.x * size + lid; i < pc.n; i += stride) {
        float x = X[i];
        acc += squares ? x * x : x;
    }
    partial[lid] = acc;
    barrier();
    for (uint s = size >> 1; s > 0u; s >>= 1) {
        if (lid < s) {
            partial[lid] += partial[lid + s];
        }
        barrier();
    }
    if (lid == 0u) {
        float total = partial[0];
        if (squares) {
            Y[gl_WorkGroupID.x] = total;
        } else {
            float norm = sqrt(total);
            float factor = pc.max_norm / (norm + 1e-6);
            Y[0] = norm;
            Y[1] = factor < 1.0 ? factor : 1.0;
            Y[2] = 0.0;
        }
    }
}
