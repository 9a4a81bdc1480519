// Batch normalisation's input gradient while training, for [N, C, HW] tensors: with m = n * HW
// values per channel over the first n = stepvals[4] rows, xhat = (X - mean) * invstd and the sums
// dbeta and dgamma (stats rows 0 to 3, from batchnorm_stats and batchnorm_backward_reduce),
//     dX = gamma * invstd * (dY - (dbeta + xhat * dgamma) / m),
// the derivative through the batch's mean and variance included. Padding rows get 0: they took no
// part in the statistics, and a 0 keeps the layers before from learning from them.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 2) readonly buffer StatsBuf { float stats[]; };
layout(std430, set = 0, binding = 3) readonly buffer GammaBuf { float gamma[]; };
layout(std430, set = 0, binding = 4) readonly buffer StepBuf { float stepvals[]; };
layout(std430, set = 0, binding = 5) writeonly buffer DXBuf { float dX[]; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint HW;
} pc;

#include "batch_rows.glsl"

void main() {
    const uint total = pc.N * pc.C * pc.HW;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const uint n = valid_rows(stepvals[4], pc.N);
    const float m = float(n * pc.HW);
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uint c = (i / pc.HW) % pc.C;
        if (i / (pc.C * pc.HW) >= n) {
            dX[i] = 0.0;
            continue;
        }
        float invstd = stats[pc.C + c];
        float xhat = (X[i] - stats[c]) * invstd;
        float correction = (stats[2u * pc.C + c] + xhat * stats[3u * pc.C + c]) / m;
        dX[i] = gamma[c] * invstd * (dY[i] - correction);
    }
}
