// Y[n,c,oh,ow] = max of the kernel x kernel window at (oh*stride, ow*stride), no padding;
// idx = flat h*W + w of that maximum within its channel plane. The window is scanned row-major
// with a strict '>', so the first maximum wins (as in cpu_ops.maxpool2d). NaN counts above every
// number, the first NaN winning (numpy's argmax), so a NaN input gives a NaN output: a plain '>'
// is false for NaN and would skip it.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 2) writeonly buffer IdxBuf { int idx[]; };

#include "pool_head.glsl"

void main() {
    const uint total = pc.N * pc.C * pc.OH * pc.OW;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uvec3 at = plane_coords(i, pc.OH, pc.OW);
        uint nc = at.x;
        uint oh = at.y;
        uint ow = at.z;
        uint base = nc * pc.H * pc.W;
        float best = uintBitsToFloat(0xff800000u);  // -inf
        uint best_idx = 0u;
        // A valid OH/OW keeps every window inside the plane; the clip only guards bad launches.
        uint h1 = min(oh * pc.stride + pc.kernel, pc.H);
        uint w1 = min(ow * pc.stride + pc.kernel, pc.W);
        for (uint h = oh * pc.stride; h < h1; ++h) {
            for (uint w = ow * pc.stride; w < w1; ++w) {
                float v = X[base + h * pc.W + w];
                if (v > best || (isnan(v) && !isnan(best))) {
                    best = v;
                    best_idx = h * pc.W + w;
                }
            }
        }
        Y[i] = best;
        idx[i] = int(best_idx);
    }
}
