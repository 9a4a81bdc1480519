// dX[n,c,h,w] = sum of dY over every window that contains (h, w) and whose recorded argmax idx
// is this pixel. One thread per input element gathers, so overlapping windows need no atomics;
// windows are visited in row-major output order, the order cpu_ops.maxpool2d_backward adds in.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer IdxBuf { int idx[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };

#include "pool_head.glsl"

void main() {
    const uint total = pc.N * pc.C * pc.H * pc.W;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const int stride = int(pc.stride);
    const int kernel = int(pc.kernel);
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uvec3 at = plane_coords(i, pc.H, pc.W);
        uint nc = at.x;
        uint h = at.y;
        uint w = at.z;
        int here = int(h * pc.W + w);
        // Windows oh with oh*stride <= h < oh*stride + kernel.
        int oh0 = max(int(h) - kernel + stride, 0) / stride;
        int oh1 = min(int(h) / stride, int(pc.OH) - 1);
        int ow0 = max(int(w) - kernel + stride, 0) / stride;
        int ow1 = min(int(w) / stride, int(pc.OW) - 1);
        uint base = nc * pc.OH * pc.OW;
        float sum = 0.0;
        for (int oh = oh0; oh <= oh1; ++oh) {
            for (int ow = ow0; ow <= ow1; ++ow) {
                uint o = base + uint(oh * int(pc.OW) + ow);
                if (idx[o] == here) {
                    sum += dY[o];
                }
            }
        }
        dX[i] = sum;
    }
}
