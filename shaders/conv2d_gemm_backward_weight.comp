// conv2d's weight gradient as an implicit GEMM: dW[k,c,r,s] = sum over (n, oh, ow) of
// dY[n,k,oh,ow] * X[n,c,ih,iw], ih = oh*stride + r - pad. GEMM rows the output channels k
// (M = K), columns (c, r, s) (N = C*R*S), reduction kk = (n, oh, ow) (N*OH*OW): A is dY viewed as
// [K, (n, oh, ow)], B the im2col matrix of X gathered on the fly. The reduction is long and the
// output small, so it is split over k_splits workgroups along z: each writes raw partial sums
// into slice z of dW viewed as [k_splits, K, C*R*S], and a splitk_epilogue launch adds them;
// with k_splits = 1 the result goes straight into dW. See conv_gemm_body.glsl for the tiles.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DWBuf { float dW[]; };

#include "conv_gemm_head.glsl"

uint pc_M() { return pc.K; }
uint pc_N() { return pc.C * pc.R * pc.S; }
uint pc_K() { return pc.N * pc.OH * pc.OW; }

// Both operands run contiguously along (n, oh, ow), so threads load along k for each.
const bool A_MFAST = false;
const bool B_NFAST = false;

float a_at(uint k, uint kk) {
    uint plane = pc.OH * pc.OW;
    uint n = kk / plane;
    return dY[(n * pc.K + k) * plane + (kk - n * plane)];
}

float b_at(uint kk, uint col) {
    uint plane = pc.OH * pc.OW;
    uint n = kk / plane;
    uint p = kk - n * plane;
    uint oh = p / pc.OW;
    uint ow = p - oh * pc.OW;
    uint taps = pc.R * pc.S;
    uint c = col / taps;
    uint rs = col - c * taps;
    uint r = rs / pc.S;
    uint s = rs - r * pc.S;
    int ih = int(oh * pc.stride + r) - int(pc.pad);
    int iw = int(ow * pc.stride + s) - int(pc.pad);
    if (ih < 0 || iw < 0 || ih >= int(pc.H) || iw >= int(pc.W)) {
        return 0.0;
    }
    return X[((n * pc.C + c) * pc.H + uint(ih)) * pc.W + uint(iw)];
}

void store_c(uint k, uint col, uint z, float v) {
    dW[(z * pc.K + k) * pc_N() + col] = v;
}

#include "conv_gemm_body.glsl"
