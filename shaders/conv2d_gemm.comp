// conv2d as an implicit GEMM: Y[n,k,oh,ow] = act(sum_{c,r,s} X[n,c,ih,iw] * Wt[k,c,r,s] + bias[k]),
// ih = oh*stride + r - pad (likewise iw), zero outside the input. GEMM rows m = (n, oh, ow)
// (M = N*OH*OW), columns the output channels k, reduction kk = (c, r, s) (C*R*S): A is the
// im2col matrix of X, gathered on the fly, and B is Wt viewed as [K, C*R*S]. See
// conv_gemm_body.glsl for the tiles.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer WBuf { float Wt[]; };
layout(std430, set = 0, binding = 2) readonly buffer BiasBuf { float bias[]; };
layout(std430, set = 0, binding = 3) writeonly buffer YBuf { float Y[]; };

#include "conv_gemm_head.glsl"
#include "common_gemm_act.glsl"

uint pc_M() { return pc.N * pc.OH * pc.OW; }
uint pc_N() { return pc.K; }
uint pc_K() { return pc.C * pc.R * pc.S; }

// Along m, neighbouring threads read neighbouring ow, so neighbouring X words at stride 1;
// along kk, neighbouring threads read one filter's contiguous weights.
const bool A_MFAST = true;
const bool B_NFAST = false;

float a_at(uint m, uint kk) {
    uint plane = pc.OH * pc.OW;
    uint n = m / plane;
    uint p = m - n * plane;
    uint oh = p / pc.OW;
    uint ow = p - oh * pc.OW;
    uint taps = pc.R * pc.S;
    uint c = kk / taps;
    uint rs = kk - c * taps;
    uint r = rs / pc.S;
    uint s = rs - r * pc.S;
    int ih = int(oh * pc.stride + r) - int(pc.pad);
    int iw = int(ow * pc.stride + s) - int(pc.pad);
    if (ih < 0 || iw < 0 || ih >= int(pc.H) || iw >= int(pc.W)) {
        return 0.0;
    }
    return X[((n * pc.C + c) * pc.H + uint(ih)) * pc.W + uint(iw)];
}

float b_at(uint kk, uint k) {
    return Wt[k * pc_K() + kk];
}

void store_c(uint m, uint k, uint z, float v) {
    uint plane = pc.OH * pc.OW;
    uint n = m / plane;
    uint p = m - n * plane;
    if (pc.has_bias != 0u) {
        v += bias[k];
    }
    Y[(n * pc.K + k) * plane + p] = vk_activate(v, ACT, pc.slope);
}

#include "conv_gemm_body.glsl"
