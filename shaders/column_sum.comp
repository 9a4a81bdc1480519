// A dense layer's bias gradient: the column sums of X [rows, cols], times alpha. reduce.comp's
// axis 0 gives each column one workgroup whose threads walk down the rows, so neighbouring
// threads read floats `cols` apart (one memory sector a value): the GPT's 16384 x 1536 gradient
// took ~150 us a bias on an H100. Here a workgroup takes OUTS consecutive columns (x: loads
// coalesced along a row) and LANES threads a column, over one of `parts` slices of the rows:
// lane l adds rows l, l + LANES, ... of the slice in order, then lane 0 adds the lanes in lane
// order into out[part * cols + column]. parts = 1 writes the sums themselves; otherwise
// conv_splitk_sum adds the slices in order. The order of every addition is fixed by (rows, parts,
// LANES), so the result is deterministic (no atomics).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint OUTS = 64;
layout(constant_id = 4) const uint LANES = 4;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer OutBuf { float outs[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint parts;
    float alpha;
} pc;

shared float partial[OUTS * LANES];

void main() {
    const uint x = gl_LocalInvocationID.x;
    const uint lane = gl_LocalInvocationID.y;
    const uint column = gl_WorkGroupID.x * OUTS + x;
    const uint part = gl_WorkGroupID.y;
    const uint per_part = (pc.rows + pc.parts - 1u) / pc.parts;
    const uint r0 = part * per_part;
    const uint r1 = min(pc.rows, r0 + per_part);
    // Two running sums a thread keep two loads in flight; they join in a fixed order.
    float even = 0.0;
    float odd = 0.0;
    if (column < pc.cols) {
        uint r = r0 + lane;
        for (; r + LANES < r1; r += 2u * LANES) {
            even += X[r * pc.cols + column];
            odd += X[(r + LANES) * pc.cols + column];
        }
        if (r < r1) {
            even += X[r * pc.cols + column];
        }
    }
    partial[lane * OUTS + x] = even + odd;
    barrier();
    if (lane == 0u && column < pc.cols) {
        float sum = partial[x];
        for (uint l = 1u; l < LANES; ++l) {
            sum += partial[l * OUTS + x];
        }
        outs[part * pc.cols + column] = sum * pc.alpha;
    }
}
