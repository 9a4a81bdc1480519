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

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint H;
    uint W;
    uint K;
    uint R;
    uint S;
    uint stride;
    uint pad;
    uint OH;
    uint OW;
    uint has_bias;
    uint act;
    float slope;
} p;

#include "common_gemm_act.glsl"

void main() {
    const uint total = p.N * p.K * p.OH * p.OW;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uint ow = i % p.OW;
        uint t = i / p.OW;
        uint oh = t % p.OH;
        t /= p.OH;
        uint k = t % p.K;
        uint n = t / p.K;
        int ih0 = int(oh * p.stride) - int(p.pad);
        int iw0 = int(ow * p.stride) - int(p.pad);
        // Clip the window to the input once instead of testing every tap.
        uint r0 = uint(max(-ih0, 0));
        uint r1 = uint(clamp(int(p.H) - ih0, 0, int(p.R)));
        uint s0 = uint(max(-iw0, 0));
        uint s1 = uint(clamp(int(p.W) - iw0, 0, int(p.S)));
        float sum = 0.0;
        for (uint c = 0u; c < p.C; ++c) {
            uint xbase = (n * p.C + c) * p.H;
            uint wbase = (k * p.C + c) * p.R;
            for (uint r = r0; r < r1; ++r) {
                uint xrow = (xbase + uint(ih0 + int(r))) * p.W;
                uint wrow = (wbase + r) * p.S;
                for (uint s = s0; s < s1; ++s) {
                    sum = fma(X[xrow + uint(iw0 + int(s))], Wt[wrow + s], sum);
                }
            }
        }
        if (p.has_bias != 0u) {
            sum += bias[k];
        }
        Y[i] = vk_activate(sum, p.act, p.slope);
    }
}
