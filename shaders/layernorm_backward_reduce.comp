// Layer normalisation's parameter gradients, for dY and X viewed as [N * R, D] rows, over the
// rows of the first n = stepvals[4] samples: dbeta[d] = sum of dY[:, d], dgamma[d] = sum of
// dY[:, d] * xhat[:, d] with xhat = (X - mean) * invstd (stats[row, 0] and stats[row, 1]).
// Padding rows take no part. As column_sum.comp (which says why): a workgroup takes OUTS
// consecutive positions d (loads coalesced along a row) and LANES threads a position, over one of
// `parts` slices of the N * R rows; slice p's sums go to dgamma[p * D + d] and dbeta[p * D + d]
// (conv_splitk_sum adds the slices in order when parts > 1). Deterministic: no atomics.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint OUTS = 64;
layout(constant_id = 4) const uint LANES = 4;

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
    uint parts;
} pc;

shared float partial_sum[OUTS * LANES];
shared float partial_xhat[OUTS * LANES];

#include "batch_rows.glsl"

void main() {
    const uint x = gl_LocalInvocationID.x;
    const uint lane = gl_LocalInvocationID.y;
    const uint d = gl_WorkGroupID.x * OUTS + x;
    const uint part = gl_WorkGroupID.y;
    const uint parts = max(pc.parts, 1u);
    // Slices of the capacity's rows (fixed when the program is recorded); rows past the real
    // ones are skipped, so a partial batch leaves the later slices' sums at 0.
    const uint per_part = (pc.N * pc.R + parts - 1u) / parts;
    const uint real = valid_rows(stepvals[4], pc.N) * pc.R;
    const uint r0 = part * per_part;
    const uint r1 = min(real, r0 + per_part);
    float dy_sum = 0.0;
    float dy_xhat = 0.0;
    if (d < pc.D) {
        for (uint row = r0 + lane; row < r1; row += LANES) {
            uint at = row * pc.D + d;
            float dy = dY[at];
            dy_sum += dy;
            dy_xhat += dy * ((X[at] - stats[2u * row]) * stats[2u * row + 1u]);
        }
    }
    partial_sum[lane * OUTS + x] = dy_sum;
    partial_xhat[lane * OUTS + x] = dy_xhat;
    barrier();
    if (lane == 0u && d < pc.D) {
        for (uint l = 1u; l < LANES; ++l) {
            dy_sum += partial_sum[l * OUTS + x];
            dy_xhat += partial_xhat[l * OUTS + x];
        }
        dbeta[part * pc.D + d] = dy_sum;
        dgamma[part * pc.D + d] = dy_xhat;
    }
}
