// dX[n,c,h,w] = sum of dY over every window that contains (h, w) and whose recorded argmax idx
// is this pixel. One thread per input element gathers, so overlapping windows need no atomics;
// windows are visited in row-major output order, the order cpu_ops.maxpool2d_backward adds in.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer IdxBuf { int idx[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint H;
    uint W;
    uint OH;
    uint OW;
    uint kernel;
    uint stride;
} p;

void main() {
    const uint total = p.N * p.C * p.H * p.W;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const int stride = int(p.stride);
    const int kernel = int(p.kernel);
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uint w = i % p.W;
        uint t = i / p.W;
        uint h = t % p.H;
        uint nc = t / p.H;
        int here = int(h * p.W + w);
        // Windows oh with oh*stride <= h < oh*stride + kernel.
        int oh0 = max(int(h) - kernel + stride, 0) / stride;
        int oh1 = min(int(h) / stride, int(p.OH) - 1);
        int ow0 = max(int(w) - kernel + stride, 0) / stride;
        int ow1 = min(int(w) / stride, int(p.OW) - 1);
        uint base = nc * p.OH * p.OW;
        float sum = 0.0;
        for (int oh = oh0; oh <= oh1; ++oh) {
            for (int ow = ow0; ow <= ow1; ++ow) {
                uint o = base + uint(oh * int(p.OW) + ow);
                if (idx[o] == here) {
                    sum += dY[o];
                }
            }
        }
        dX[i] = sum;
    }
}
