// Fused attention backward, first step: Drow[n, h, t] = dY[n, t, head h] . Y[n, t, head h], the
// row term of the softmax backward that both gradient kernels subtract (flash-attention-2), so
// neither needs a T x T buffer. A workgroup takes ROWS (n, t, h) rows of dh, LANES threads a row:
// lane l adds elements l, l + LANES, ... (neighbouring threads read neighbouring floats; one
// thread a row read floats dh apart, 58 us a layer for the char GPT on an H100), then lane 0 adds
// the lanes in lane order: a fixed order, so the result is deterministic. Grid-stride over rows.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DrowBuf { float Drow[]; };

layout(push_constant) uniform Push {
    uint N;
    uint T;
    uint H;
    uint dh;
    float scale;
    uint causal;
} pc;

shared float partial[gl_WorkGroupSize.x * gl_WorkGroupSize.y];

void main() {
    const uint lane = gl_LocalInvocationID.x;
    const uint lanes = gl_WorkGroupSize.x;
    const uint slot = gl_LocalInvocationID.y;
    const uint rows = pc.N * pc.T * pc.H;
    const uint per_group = gl_WorkGroupSize.y;
    // The loop's bounds are the workgroup's alone, so every thread meets every barrier.
    for (uint first = gl_WorkGroupID.x * per_group; first < rows; first += gl_NumWorkGroups.x * per_group) {
        // x = (n * T + t) * H + h: the rows of one (n, t) lie next to each other in dY and Y.
        const uint x = first + slot;
        float sum = 0.0;
        if (x < rows) {
            const uint start = x * pc.dh;
            for (uint d = lane; d < pc.dh; d += lanes) {
                sum += dY[start + d] * Y[start + d];
            }
        }
        partial[slot * lanes + lane] = sum;
        barrier();
        if (lane == 0u && x < rows) {
            for (uint l = 1u; l < lanes; ++l) {
                sum += partial[slot * lanes + l];
            }
            const uint h = x % pc.H;
            const uint nt = x / pc.H;
            Drow[((nt / pc.T) * pc.H + h) * pc.T + nt % pc.T] = sum;
        }
        barrier();  // partial is reused by the next rows
    }
}
