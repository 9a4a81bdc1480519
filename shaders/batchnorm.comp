// Batch normalisation's forward, for X viewed as [N, C, HW]: Y = gamma[c] * ((X - mean[c]) *
// invstd[c]) + beta[c], with mean and invstd in rows 0 and 1 of stats (batchnorm_stats: the
// batch's while training, the running ones otherwise). Elementwise, grid-stride.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer StatsBuf { float stats[]; };
layout(std430, set = 0, binding = 2) readonly buffer GammaBuf { float gamma[]; };
layout(std430, set = 0, binding = 3) readonly buffer BetaBuf { float beta[]; };
layout(std430, set = 0, binding = 4) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint HW;
} pc;

void main() {
    const uint total = pc.N * pc.C * pc.HW;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uint c = (i / pc.HW) % pc.C;
        Y[i] = gamma[c] * ((X[i] - stats[c]) * stats[pc.C + c]) + beta[c];
    }
}
