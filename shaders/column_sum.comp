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
#extension GL_GOOGLE_include_directive : require
#include "column_sum_body.glsl"
