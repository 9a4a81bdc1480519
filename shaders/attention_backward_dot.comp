// Fused attention backward, first step: Drow[n, h, t] = dY[n, t, head h] . Y[n, t, head h], the
// row term of the softmax backward that both gradient kernels subtract (flash-attention-2), so
// neither needs a T x T buffer. One thread per (n, t, h), grid-stride.
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

void main() {
    const uint rows = pc.N * pc.T * pc.H;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint x = gl_GlobalInvocationID.x; x < rows; x += stride) {
        // x = (n * T + t) * H + h: neighbouring threads read neighbouring heads of one row.
        const uint h = x % pc.H;
        const uint nt = x / pc.H;
        const uint start = x * pc.dh;
        float sum = 0.0;
        for (uint d = 0u; d < pc.dh; d++) {
            sum += dY[start + d] * Y[start + d];
        }
        Drow[((nt / pc.T) * pc.H + h) * pc.T + nt % pc.T] = sum;
    }
}
