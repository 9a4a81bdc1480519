// The body of column_sum.comp and column_sum_copy.comp (see column_sum.comp for the design). With
// COLUMN_SUM_COPY defined, an invocation takes two adjacent columns (cols even: 8-byte loads) and
// also writes X's float16 copy H, two halves a word as cast.comp rounds them (half_bits.glsl): the
// bias gradient's launch reads all of X anyway, so the copy costs only its writes (the char GPT's
// dqkv, which the qkv GEMMs read as halves). Each column's sum adds the same values in the same
// order either way, so the sums are the same bits.
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint OUTS = 64;
layout(constant_id = 4) const uint LANES = 4;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer OutBuf { float outs[]; };
#ifdef COLUMN_SUM_COPY
#include "half_bits.glsl"
layout(std430, set = 0, binding = 0) readonly buffer XBuf2 { vec2 X2[]; };
layout(std430, set = 0, binding = 2) writeonly buffer HBuf { uint H[]; };
#define COLUMNS 2u
#define VALUES vec2
#else
#define COLUMNS 1u
#define VALUES float
#endif

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint parts;
    float alpha;
} pc;

shared VALUES partial[OUTS / COLUMNS * LANES];

// Row r's values at the invocation's column(s), and (COLUMN_SUM_COPY) their float16 copy.
VALUES row_values(uint r, uint column) {
#ifdef COLUMN_SUM_COPY
    const vec2 v = X2[(r * pc.cols + column) / 2u];
    H[(r * pc.cols + column) / 2u] = half_pair(v.x, v.y);
    return v;
#else
    return X[r * pc.cols + column];
#endif
}

void main() {
    const uint x = gl_LocalInvocationID.x;
    const uint lane = gl_LocalInvocationID.y;
    const uint column = gl_WorkGroupID.x * OUTS + COLUMNS * x;
    const uint part = gl_WorkGroupID.y;
    const uint per_part = (pc.rows + pc.parts - 1u) / pc.parts;
    const uint r0 = part * per_part;
    const uint r1 = min(pc.rows, r0 + per_part);
    // Two running sums a thread keep two loads in flight; they join in a fixed order.
    VALUES even = VALUES(0.0);
    VALUES odd = VALUES(0.0);
    if (column < pc.cols) {
        uint r = r0 + lane;
        for (; r + LANES < r1; r += 2u * LANES) {
            even += row_values(r, column);
            odd += row_values(r + LANES, column);
        }
        if (r < r1) {
            even += row_values(r, column);
        }
    }
    partial[lane * (OUTS / COLUMNS) + x] = even + odd;
    barrier();
    if (lane == 0u && column < pc.cols) {
        VALUES sum = partial[x];
        for (uint l = 1u; l < LANES; ++l) {
            sum += partial[l * (OUTS / COLUMNS) + x];
        }
#ifdef COLUMN_SUM_COPY
        outs[part * pc.cols + column] = sum.x * pc.alpha;
        outs[part * pc.cols + column + 1u] = sum.y * pc.alpha;
#else
        outs[part * pc.cols + column] = sum * pc.alpha;
#endif
    }
}
