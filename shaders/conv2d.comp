// Direct NCHW convolution, Y[n,k,oh,ow] = act(sum_{c,r,s} X[n,c,ih,iw] * Wt[k,c,r,s] + bias[k]),
// ih = oh*stride + r - pad (likewise iw), zero outside the input. One thread per output element,
// grid-stride, because the workgroup count is capped.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer WBuf { float Wt[]; };
layout(std430, set = 0, binding = 2) readonly buffer BiasBuf { float bias[]; };
layout(std430, set = 0, binding = 3) writeonly buffer YBuf { float Y[]; };

#include "conv_head.glsl"
#include "common_gemm_act.glsl"

void main() {
    const uint total = pc.N * pc.K * pc.OH * pc.OW;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uvec4 at = nchw_coords(i, pc.K, pc.OH, pc.OW);
        uint n = at.x;
        uint k = at.y;
        uint oh = at.z;
        uint ow = at.w;
        int ih0 = int(oh * pc.stride) - int(pad_h());
        int iw0 = int(ow * pc.stride) - int(pc.pad);
        // Clip the window to the input once instead of testing every tap.
        uint r0 = uint(max(-ih0, 0));
        uint r1 = uint(clamp(int(pc.H) - ih0, 0, int(pc.R)));
        uint s0 = uint(max(-iw0, 0));
        uint s1 = uint(clamp(int(pc.W) - iw0, 0, int(pc.S)));
        float sum = 0.0;
        for (uint c = 0u; c < pc.C; ++c) {
            uint xbase = (n * pc.C + c) * pc.H;
            uint wbase = (k * pc.C + c) * pc.R;
            for (uint r = r0; r < r1; ++r) {
                uint xrow = (xbase + uint(ih0 + int(r))) * pc.W;
                uint wrow = (wbase + r) * pc.S;
                for (uint s = s0; s < s1; ++s) {
                    sum = fma(X[xrow + uint(iw0 + int(s))], Wt[wrow + s], sum);
                }
            }
        }
        if (pc.has_bias != 0u) {
            sum += bias[k];
        }
        Y[i] = vk_activate(sum, pc.act, pc.slope);
    }
}
