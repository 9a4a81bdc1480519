// Batch normalisation's parameter gradients, for dY and X viewed as [N, C, HW], over the first
// n = stepvals[4] rows: dbeta[c] = sum of dY, dgamma[c] = sum of dY * xhat with xhat = (X - mean)
// * invstd (stats rows 0 and 1). Both are also written to stats rows 2 and 3, where
// batchnorm_backward_data reads them. One workgroup per channel.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 2) buffer StatsBuf { float stats[]; };
layout(std430, set = 0, binding = 3) writeonly buffer DGammaBuf { float dgamma[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DBetaBuf { float dbeta[]; };
layout(std430, set = 0, binding = 5) readonly buffer StepBuf { float stepvals[]; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint HW;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "batch_rows.glsl"
#include "row_reduce.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint m = valid_rows(stepvals[4], pc.N) * pc.HW;
    for (uint c = gl_WorkGroupID.x; c < pc.C; c += gl_NumWorkGroups.x) {
        float mean = stats[c];
        float dy_sum = 0.0;
        float dy_centred = 0.0;  // sum of dY * (X - mean); times invstd once at the end
        for (uint j = tid; j < m; j += threads) {
            uint row = j / pc.HW;
            uint at = (row * pc.C + c) * pc.HW + (j - row * pc.HW);
            dy_sum += dY[at];
            dy_centred += dY[at] * (X[at] - mean);
        }
        dy_sum = group_sum(dy_sum);
        float dy_xhat = group_sum(dy_centred) * stats[pc.C + c];
        if (tid == 0u) {
            dbeta[c] = dy_sum;
            dgamma[c] = dy_xhat;
            stats[2u * pc.C + c] = dy_sum;
            stats[3u * pc.C + c] = dy_xhat;
        }
    }
}
