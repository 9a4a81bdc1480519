// Y[n,c,oh,ow] = the sum of the kernel x kernel window at (oh*stride - pad, ow*stride - pad)
// divided by kernel^2: padding counts as zeros (PyTorch's count_include_pad=True), so only the
// window's part inside the plane is read, and the divisor is always the whole window.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };

#include "pool_head.glsl"

void main() {
    const uint total = pc.N * pc.C * pc.OH * pc.OW;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const float area = float(pc.kernel * pc.kernel);
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uvec3 at = plane_coords(i, pc.OH, pc.OW);
        uint base = at.x * pc.H * pc.W;
        // Signed: a window at the border starts in the padding, above or left of the plane.
        int top = int(at.y * pc.stride) - int(pc.pad);
        int left = int(at.z * pc.stride) - int(pc.pad);
        uint h0 = uint(max(top, 0));
        uint w0 = uint(max(left, 0));
        uint h1 = uint(clamp(top + int(pc.kernel), 0, int(pc.H)));
        uint w1 = uint(clamp(left + int(pc.kernel), 0, int(pc.W)));
        float sum = 0.0;
        for (uint h = h0; h < h1; ++h) {
            for (uint w = w0; w < w1; ++w) {
                sum += X[base + h * pc.W + w];
            }
        }
        Y[i] = sum / area;
    }
}
