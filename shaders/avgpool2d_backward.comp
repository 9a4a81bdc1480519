// dX[n,c,h,w] = the sum of dY over every window that covers (h, w), divided by kernel^2 (each
// window's mean takes 1/kernel^2 of each of its pixels, padding included). One thread per input
// element gathers, so overlapping windows need no atomics.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) writeonly buffer DXBuf { float dX[]; };

#include "pool_head.glsl"

void main() {
    const uint total = pc.N * pc.C * pc.H * pc.W;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const int stride = int(pc.stride);
    const int kernel = int(pc.kernel);
    const float area = float(pc.kernel * pc.kernel);
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uvec3 at = plane_coords(i, pc.H, pc.W);
        // In padded coordinates, windows oh with oh*stride <= h < oh*stride + kernel.
        int h = int(at.y + pc.pad);
        int w = int(at.z + pc.pad);
        int oh0 = max(h - kernel + stride, 0) / stride;
        int oh1 = min(h / stride, int(pc.OH) - 1);
        int ow0 = max(w - kernel + stride, 0) / stride;
        int ow1 = min(w / stride, int(pc.OW) - 1);
        uint base = at.x * pc.OH * pc.OW;
        float sum = 0.0;
        for (int oh = oh0; oh <= oh1; ++oh) {
            for (int ow = ow0; ow <= ow1; ++ow) {
                sum += dY[base + uint(oh * int(pc.OW) + ow)];
            }
        }
        dX[i] = sum / area;
    }
}
