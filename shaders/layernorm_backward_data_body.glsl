// The body of layernorm_backward_data.comp and layernorm_backward_data_copy.comp.
// Layer normalisation's input gradient, for [N * R, D] rows: with g = dY * gamma and xhat =
// (X - mean) * invstd (stats[row, 0] and stats[row, 1], from layernorm),
//     dX = invstd * (g - mean(g) - xhat * mean(g * xhat)),
// the means over the row's D values. The rows of padding samples (past n = stepvals[4]) get 0,
// so the layers before never learn from them. One workgroup per row, grid-stride over rows.
// accumulate = 1 adds Addend first (dX = Addend + the above; padding rows get Addend): the sum of
// a residual stream's two gradients, which a separate add launch wrote otherwise (session 10).
// With LAYERNORM_COPY defined, also H = dX rounded to float16 as cast.comp rounds (D even).
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 2) readonly buffer StatsBuf { float stats[]; };
layout(std430, set = 0, binding = 3) readonly buffer GammaBuf { float gamma[]; };
layout(std430, set = 0, binding = 4) readonly buffer StepBuf { float stepvals[]; };
layout(std430, set = 0, binding = 5) writeonly buffer DXBuf { float dX[]; };
layout(std430, set = 0, binding = 6) readonly buffer AddendBuf { float addend[]; };
#ifdef LAYERNORM_COPY
#include "half_bits.glsl"
layout(std430, set = 0, binding = 7) writeonly buffer HBuf { uint H[]; };
#endif

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

// Element j of the row at base: the gradient, plus the addend where accumulate is set.
float input_grad(uint base, uint j, float mean, float invstd, float g_mean, float gx_mean) {
    float xhat = (X[base + j] - mean) * invstd;
    float grad = invstd * (dY[base + j] * gamma[j] - g_mean - xhat * gx_mean);
    return pc.accumulate != 0u ? addend[base + j] + grad : grad;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint rows = pc.N * pc.R;
    const uint real = valid_rows(stepvals[4], pc.N) * pc.R;
    for (uint row = gl_WorkGroupID.x; row < rows; row += gl_NumWorkGroups.x) {
        const uint base = row * pc.D;
        if (row >= real) {  // uniform across the workgroup: no barrier is skipped by some alone
#ifdef LAYERNORM_COPY
            for (uint w = tid; w < pc.D / 2u; w += threads) {
                const uint j = 2u * w;
                const float g0 = pc.accumulate != 0u ? addend[base + j] : 0.0;
                const float g1 = pc.accumulate != 0u ? addend[base + j + 1u] : 0.0;
                dX[base + j] = g0;
                dX[base + j + 1u] = g1;
                H[base / 2u + w] = half_pair(g0, g1);
            }
#else
            for (uint j = tid; j < pc.D; j += threads) {
                dX[base + j] = pc.accumulate != 0u ? addend[base + j] : 0.0;
            }
#endif
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
#ifdef LAYERNORM_COPY
        for (uint w = tid; w < pc.D / 2u; w += threads) {
            const uint j = 2u * w;
            const float g0 = input_grad(base, j, mean, invstd, g_mean, gx_mean);
            const float g1 = input_grad(base, j + 1u, mean, invstd, g_mean, gx_mean);
            dX[base + j] = g0;
            dX[base + j + 1u] = g1;
            H[base / 2u + w] = half_pair(g0, g1);
        }
#else
        for (uint j = tid; j < pc.D; j += threads) {
            dX[base + j] = input_grad(base, j, mean, invstd, g_mean, gx_mean);
        }
#endif
    }
}
