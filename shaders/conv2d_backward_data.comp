// dX[n,c,h,w] = sum over (k, r, s) of dY[n,k,oh,ow] * Wt[k,c,r,s] for every output position with
// oh*stride + r - pad == h (likewise w). One thread per input element gathers, so no atomics.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer WBuf { float Wt[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };

#include "conv_head.glsl"

void main() {
    const uint total = pc.N * pc.C * pc.H * pc.W;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const int stride = int(pc.stride);
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uvec4 at = nchw_coords(i, pc.C, pc.H, pc.W);
        uint n = at.x;
        uint c = at.y;
        uint h = at.z;
        uint w = at.w;
        int hp = int(h + pad_h());
        int wp = int(w + pc.pad);
        float sum = 0.0;
        for (uint k = 0u; k < pc.K; ++k) {
            uint ybase = (n * pc.K + k) * pc.OH;
            uint wbase = (k * pc.C + c) * pc.R;
            for (int r = 0; r < int(pc.R); ++r) {
                int ohs = hp - r;
                if (ohs < 0 || ohs % stride != 0 || ohs / stride >= int(pc.OH)) {
                    continue;
                }
                uint yrow = (ybase + uint(ohs / stride)) * pc.OW;
                uint wrow = (wbase + uint(r)) * pc.S;
                for (int s = 0; s < int(pc.S); ++s) {
                    int ows = wp - s;
                    if (ows < 0 || ows % stride != 0 || ows / stride >= int(pc.OW)) {
                        continue;
                    }
                    sum = fma(dY[yrow + uint(ows / stride)], Wt[wrow + uint(s)], sum);
                }
            }
        }
        dX[i] = sum;
    }
}
