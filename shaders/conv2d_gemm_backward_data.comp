// conv2d's input gradient as an implicit GEMM: dX[n,c,h,w] = sum over (k, r, s) of
// dY[n,k,oh,ow] * Wt[k,c,r,s] where oh*stride + r - pad == h (likewise w). GEMM rows m = (n, h, w)
// (M = N*H*W), columns the input channels c, reduction kk = (k, r, s) (K*R*S): A gathers dY at
// ((h + pad - r) / stride, (w + pad - s) / stride), zero where that is not whole or is outside
// the output; B is Wt[k, c, r, s] read as [(k, r, s), c]. See conv_gemm_body.glsl for the tiles.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer WBuf { float Wt[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };

#include "conv_gemm_head.glsl"

uint pc_M() { return pc.N * pc.H * pc.W; }
uint pc_N() { return pc.C; }
uint pc_K() { return pc.K * pc.R * pc.S; }

// Along m, neighbouring threads read neighbouring output columns of dY; along kk, neighbouring
// threads read one (k, c) filter's contiguous taps.
const bool A_MFAST = true;
const bool B_NFAST = false;

float a_at(uint m, uint kk) {
    uint plane = pc.H * pc.W;
    uint n = m / plane;
    uint p = m - n * plane;
    uint h = p / pc.W;
    uint w = p - h * pc.W;
    uint taps = pc.R * pc.S;
    uint k = kk / taps;
    uint rs = kk - k * taps;
    uint r = rs / pc.S;
    uint s = rs - r * pc.S;
    int hs = int(h + pc.pad) - int(r);
    int ws = int(w + pc.pad) - int(s);
    if (hs < 0 || ws < 0) {
        return 0.0;
    }
    uint oh = uint(hs) / pc.stride;
    uint ow = uint(ws) / pc.stride;
    if (oh * pc.stride != uint(hs) || ow * pc.stride != uint(ws) || oh >= pc.OH || ow >= pc.OW) {
        return 0.0;
    }
    return dY[((n * pc.K + k) * pc.OH + oh) * pc.OW + ow];
}

float b_at(uint kk, uint c) {
    uint taps = pc.R * pc.S;
    uint k = kk / taps;
    return Wt[(k * pc.C + c) * taps + (kk - k * taps)];
}

void store_c(uint m, uint c, uint z, float v) {
    uint plane = pc.H * pc.W;
    uint n = m / plane;
    dX[(n * pc.C + c) * plane + (m - n * plane)] = v;
}

#include "conv_gemm_body.glsl"
