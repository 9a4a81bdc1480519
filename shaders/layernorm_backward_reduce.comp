// Layer normalisation's parameter gradients, for dY and X viewed as [N * R, D] rows, over the
// rows of the first n = stepvals[4] samples: dbeta[d] = sum of dY[:, d], dgamma[d] = sum of
// dY[:, d] * xhat[:, d] with xhat = (X - mean) * invstd (stats[row, 0] and stats[row, 1]).
// Padding rows take no part. As column_sum.comp (which says why): a workgroup takes OUTS
// consecutive positions d, four a thread (16-byte loads coalesced along a row when D % 4 == 0),
// and LANES threads a quad of positions, over one of `parts` slices of the N * R rows, each
// thread with two running sums of each kind (rows 2 LANES apart share one); slice p's sums go to
// dgamma[p * D + d] and dbeta[p * D + d] (conv_splitk_sum adds the slices in order when
// parts > 1). Deterministic: no atomics.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint OUTS = 64;
layout(constant_id = 4) const uint LANES = 16;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 0) readonly buffer DYBuf4 { vec4 dY4[]; };
layout(std430, set = 0, binding = 1) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer XBuf4 { vec4 X4[]; };
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

const uint QUADS = OUTS / 4u;
shared vec4 partial_sum[QUADS * LANES];
shared vec4 partial_xhat[QUADS * LANES];

#include "batch_rows.glsl"

// Positions d..d+3 of row `row` of dY and of X (zeros past D).
void quads(uint row, uint d, bool vec, out vec4 dy, out vec4 x) {
    const uint at = row * pc.D + d;
    if (vec) {
        dy = dY4[at / 4u];
        x = X4[at / 4u];
        return;
    }
    dy = vec4(0.0);
    x = vec4(0.0);
    for (uint e = 0u; e < 4u && d + e < pc.D; ++e) {
        dy[e] = dY[at + e];
        x[e] = X[at + e];
    }
}

void main() {
    const uint x = gl_LocalInvocationID.x;
    const uint lane = gl_LocalInvocationID.y;
    const uint d = (gl_WorkGroupID.x * QUADS + x) * 4u;
    const uint part = gl_WorkGroupID.y;
    const uint parts = max(pc.parts, 1u);
    // Slices of the capacity's rows (fixed when the program is recorded); rows past the real
    // ones are skipped, so a partial batch leaves the later slices' sums at 0.
    const uint per_part = (pc.N * pc.R + parts - 1u) / parts;
    const uint real = valid_rows(stepvals[4], pc.N) * pc.R;
    const uint r0 = part * per_part;
    const uint r1 = min(real, r0 + per_part);
    const bool vec = pc.D % 4u == 0u;
    vec4 sum[2] = vec4[2](vec4(0.0), vec4(0.0));
    vec4 prod[2] = vec4[2](vec4(0.0), vec4(0.0));
    if (d < pc.D) {
        uint row = r0 + lane;
        for (; row + LANES < r1; row += 2u * LANES) {
            [[unroll]] for (uint j = 0u; j < 2u; ++j) {
                const uint at = row + j * LANES;
                vec4 dy, xv;
                quads(at, d, vec, dy, xv);
                sum[j] += dy;
                prod[j] += dy * ((xv - stats[2u * at]) * stats[2u * at + 1u]);
            }
        }
        if (row < r1) {
            vec4 dy, xv;
            quads(row, d, vec, dy, xv);
            sum[0] += dy;
            prod[0] += dy * ((xv - stats[2u * row]) * stats[2u * row + 1u]);
        }
    }
    partial_sum[lane * QUADS + x] = sum[0] + sum[1];
    partial_xhat[lane * QUADS + x] = prod[0] + prod[1];
    barrier();
    if (lane == 0u && d < pc.D) {
        vec4 dy_sum = partial_sum[x];
        vec4 dy_xhat = partial_xhat[x];
        for (uint l = 1u; l < LANES; ++l) {
            dy_sum += partial_sum[l * QUADS + x];
            dy_xhat += partial_xhat[l * QUADS + x];
        }
        for (uint e = 0u; e < 4u && d + e < pc.D; ++e) {
            dbeta[part * pc.D + d + e] = dy_sum[e];
            dgamma[part * pc.D + d + e] = dy_xhat[e];
        }
    }
}
