// Layer normalisation's parameter gradients, for dY and X viewed as [N * R, D] rows, over the
// rows of the first n = stepvals[4] samples: dbeta[d] = sum of dY[:, d], dgamma[d] = sum of
// dY[:, d] * xhat[:, d] with xhat = (X - mean) * invstd (stats[row, 0] and stats[row, 1]).
// Padding rows take no part. One workgroup per position d.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 2) readonly buffer StatsBuf { float stats[]; };
layout(std430, set = 0, binding = 3) writeonly buffer DGammaBuf { float dgamma[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DBetaBuf { float dbeta[]; };
layout(std430, set = 0, binding = 5) readonly buffer StepBuf { float stepvals[]; };

layout(push_constant) uniform Push {
    uint N;
    uint R;
    uint D;
    float eps;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "batch_rows.glsl"
#include "row_reduce.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint real = valid_rows(stepvals[4], pc.N) * pc.R;
    for (uint d = gl_WorkGroupID.x; d < pc.D; d += gl_NumWorkGroups.x) {
        float dy_sum = 0.0;
        float dy_xhat = 0.0;
        for (uint row = tid; row < real; row += threads) {
            uint at = row * pc.D + d;
            dy_sum += dY[at];
            dy_xhat += dY[at] * ((X[at] - stats[2u * row]) * stats[2u * row + 1u]);
        }
        dy_sum = group_sum(dy_sum);
        dy_xhat = group_sum(dy_xhat);
        if (tid == 0u) {
            dbeta[d] = dy_sum;
            dgamma[d] = dy_xhat;
        }
    }
}
