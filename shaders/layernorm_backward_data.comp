// Layer normalisation's input gradient, for [N * R, D] rows: with g = dY * gamma and xhat =
// (X - mean) * invstd (stats[row, 0] and stats[row, 1], from layernorm),
//     dX = invstd * (g - mean(g) - xhat * mean(g * xhat)),
// the means over the row's D values. The rows of padding samples (past n = stepvals[4]) get 0,
// so the layers before never learn from them. One workgroup per row, grid-stride over rows.
// accumulate = 1 adds Addend first (dX = Addend + the above; padding rows get Addend): the sum of
// a residual stream's two gradients, which a separate add launch wrote otherwise (session 10).
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 2) readonly buffer StatsBuf { float stats[]; };
layout(std430, set = 0, binding = 3) readonly buffer GammaBuf { float gamma[]; };
layout(std430, set = 0, binding = 4) readonly buffer StepBuf { float stepvals[]; };
layout(std430, set = 0, binding = 5) writeonly buffer DXBuf { float dX[]; };
layout(std430, set = 0, binding = 6) readonly buffer AddendBuf { float addend[]; };

layout(push_constant) uniform Push {
    uint N;
    uint R;
    uint D;
    float eps;
    uint accumulate;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "batch_rows.glsl"
#include "row_reduce.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint rows = pc.N * pc.R;
    const uint real = valid_rows(stepvals[4], pc.N) * pc.R;
    for (uint row = gl_WorkGroupID.x; row < rows; row += gl_NumWorkGroups.x) {
        const uint base = row * pc.D;
        if (row >= real) {  // uniform across the workgroup: no barrier is skipped by some alone
            for (uint j = tid; j < pc.D; j += threads) {
                dX[base + j] = pc.accumulate != 0u ? addend[base + j] : 0.0;
            }
            continue;
        }
        const float mean = stats[2u * row];
        const float invstd = stats[2u * row + 1u];
        float g_sum = 0.0;
        float gx_sum = 0.0;
        for (uint j = tid; j < pc.D; j += threads) {
            float g = dY[base + j] * gamma[j];
            g_sum += g;
            gx_sum += g * ((X[base + j] - mean) * invstd);
        }
        const float g_mean = group_sum(g_sum) / float(pc.D);
        const float gx_mean = group_sum(gx_sum) / float(pc.D);
        for (uint j = tid; j < pc.D; j += threads) {
            float xhat = (X[base + j] - mean) * invstd;
            float grad = invstd * (dY[base + j] * gamma[j] - g_mean - xhat * gx_mean);
            dX[base + j] = pc.accumulate != 0u ? addend[base + j] + grad : grad;
        }
    }
}
