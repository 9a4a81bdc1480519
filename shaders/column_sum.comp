// A dense layer's bias gradient: the column sums of X [rows, cols], times alpha. reduce.comp's
// axis 0 gives each column one workgroup whose threads walk down the rows, so neighbouring
// threads read floats `cols` apart (one memory sector a value): the GPT's 16384 x 1536 gradient
// took ~150 us a bias on an H100. Here a workgroup takes OUTS consecutive columns, four a thread
// (x: 16-byte loads coalesced along a row when cols % 4 == 0, four scalar loads otherwise), and
// LANES threads a column quad, over one of `parts` slices of the rows: lane l adds rows l,
// l + LANES, ... of the slice in order into four running sums (rows 4 LANES apart share one, so
// four loads are in flight: a slice of a few hundred rows is a few memory latencies, not one a
// row), which join in a fixed order; then lane 0 adds the lanes in lane order into
// out[part * cols + column]. parts = 1 writes the sums themselves; otherwise conv_splitk_sum adds
// the slices in order. The order of every addition is fixed by (rows, parts, LANES), so the
// result is deterministic (no atomics).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint OUTS = 64;
layout(constant_id = 4) const uint LANES = 16;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 0) readonly buffer XBuf4 { vec4 X4[]; };
layout(std430, set = 0, binding = 1) writeonly buffer OutBuf { float outs[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint parts;
    float alpha;
} pc;

const uint QUADS = OUTS / 4u;
shared vec4 partial[QUADS * LANES];

// Columns c..c+3 of row r (zeros past cols).
vec4 quad(uint r, uint c, bool vec) {
    if (vec) {
        return X4[(r * pc.cols + c) / 4u];
    }
    vec4 v = vec4(0.0);
    for (uint e = 0u; e < 4u && c + e < pc.cols; ++e) {
        v[e] = X[r * pc.cols + c + e];
    }
    return v;
}

void main() {
    const uint x = gl_LocalInvocationID.x;
    const uint lane = gl_LocalInvocationID.y;
    const uint c = (gl_WorkGroupID.x * QUADS + x) * 4u;
    const uint part = gl_WorkGroupID.y;
    const uint per_part = (pc.rows + pc.parts - 1u) / pc.parts;
    const uint r0 = part * per_part;
    const uint r1 = min(pc.rows, r0 + per_part);
    const bool vec = pc.cols % 4u == 0u;
    vec4 s0 = vec4(0.0);
    vec4 s1 = vec4(0.0);
    vec4 s2 = vec4(0.0);
    vec4 s3 = vec4(0.0);
    if (c < pc.cols) {
        uint r = r0 + lane;
        for (; r + 3u * LANES < r1; r += 4u * LANES) {
            s0 += quad(r, c, vec);
            s1 += quad(r + LANES, c, vec);
            s2 += quad(r + 2u * LANES, c, vec);
            s3 += quad(r + 3u * LANES, c, vec);
        }
        for (; r < r1; r += LANES) {
            s0 += quad(r, c, vec);
        }
    }
    partial[lane * QUADS + x] = (s0 + s1) + (s2 + s3);
    barrier();
    if (lane == 0u && c < pc.cols) {
        vec4 sum = partial[x];
        for (uint l = 1u; l < LANES; ++l) {
            sum += partial[l * QUADS + x];
        }
        for (uint e = 0u; e < 4u && c + e < pc.cols; ++e) {
            outs[part * pc.cols + c + e] = sum[e] * pc.alpha;
        }
    }
}
