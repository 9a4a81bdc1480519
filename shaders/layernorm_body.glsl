// The body of layernorm.comp and layernorm_copy.comp.
// Layer normalisation's forward, for X viewed as [N * R, D] rows (R rows of D per sample): each
// row's own mean and 1/sqrt(biased var + eps) into stats[row, 0] and stats[row, 1] (which the
// backward reads), and Y = gamma[d] * (X - mean) * invstd + beta[d]. Every row, padding included
// (a row's result never depends on another's). One workgroup per row, grid-stride over rows.
// With LAYERNORM_COPY defined, also H = Y rounded to float16 as cast.comp rounds (D even); with
// LAYERNORM_HALF_ONLY too, H alone (layernorm_half: a mixed plan whose GEMMs read only the copy
// leaves Y unwritten).
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer GammaBuf { float gamma[]; };
layout(std430, set = 0, binding = 2) readonly buffer BetaBuf { float beta[]; };
layout(std430, set = 0, binding = 3) writeonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 4) writeonly buffer StatsBuf { float stats[]; };
#ifdef LAYERNORM_COPY
#include "half_bits.glsl"
layout(std430, set = 0, binding = 5) writeonly buffer HBuf { uint H[]; };
#endif

layout(push_constant) uniform Push {
    uint N;
    uint R;
    uint D;
    float eps;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "row_reduce.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint rows = pc.N * pc.R;
    for (uint row = gl_WorkGroupID.x; row < rows; row += gl_NumWorkGroups.x) {
        const uint base = row * pc.D;
        float sum = 0.0;
        for (uint j = tid; j < pc.D; j += threads) {
            sum += X[base + j];
        }
        const float mean = group_sum(sum) / float(pc.D);
        // Two passes, as batchnorm_stats: the deviations from the mean, not E[x^2] - mean^2.
        float squares = 0.0;
        for (uint j = tid; j < pc.D; j += threads) {
            float centred = X[base + j] - mean;
            squares += centred * centred;
        }
        const float invstd = 1.0 / sqrt(group_sum(squares) / float(pc.D) + pc.eps);
#ifdef LAYERNORM_COPY
        // Pairs of values: each word of H holds two halves (D is even).
        for (uint w = tid; w < pc.D / 2u; w += threads) {
            const uint j = 2u * w;
            const float y0 = gamma[j] * ((X[base + j] - mean) * invstd) + beta[j];
            const float y1 = gamma[j + 1u] * ((X[base + j + 1u] - mean) * invstd) + beta[j + 1u];
#ifndef LAYERNORM_HALF_ONLY
            Y[base + j] = y0;
            Y[base + j + 1u] = y1;
#endif
            H[base / 2u + w] = half_pair(y0, y1);
        }
#else
        for (uint j = tid; j < pc.D; j += threads) {
            Y[base + j] = gamma[j] * ((X[base + j] - mean) * invstd) + beta[j];
        }
#endif
        if (tid == 0u) {
            stats[2u * row] = mean;
            stats[2u * row + 1u] = invstd;
        }
    }
}
