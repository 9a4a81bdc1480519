// The operands, gathers and epilogue of conv2d_gemm_backward_weight.comp (see its header), shared with its
// tensor-core variant conv2d_gemm_coopmat_backward_weight.comp; the including shader adds the main loop.

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DWBuf { float dW[]; };

#include "conv_gemm_head.glsl"

uint pc_M() { return pc.K; }
uint pc_N() { return pc.C * pc.R * pc.S; }
uint pc_K() { return pc.N * pc.OH * pc.OW; }

// Both operands run contiguously along (n, oh, ow), so threads load along k for each.
#define A_MFAST 0
#define B_NFAST 0

// A[k, (n, p)] = dY[n, k, p]: a row is the output channel, a reduction index (n, oh*OW + ow).
struct ARow {
    uint k;
};

ARow a_row(uint k) {
    return ARow(k);
}

struct AIdx {
    uint n;
    uint p;
};

AIdx a_idx(uint kk) {
    uint plane = pc.OH * pc.OW;
    uint n = kk / plane;
    return AIdx(n, kk - n * plane);
}

void a_step(inout AIdx t, AIdx d) {
    uint plane = pc.OH * pc.OW;
    t.p += d.p;
    uint carry = uint(t.p >= plane);
    t.p -= carry * plane;
    t.n += d.n + carry;
}

float a_get(ARow row, AIdx t) {
    return dY[(t.n * pc.K + row.k) * (pc.OH * pc.OW) + t.p];
}

// B[(n, oh, ow), (c, r, s)] = X[n, c, oh*stride + r - pad, ow*stride + s - pad]: a column is
// (c, r - pad, s - pad), a reduction index (n, oh, ow).
struct BCol {
    uint c;
    int r0;
    int s0;
};

BCol b_col(uint col) {
    uint taps = pc.R * pc.S;
    uint c = col / taps;
    uint rs = col - c * taps;
    uint r = rs / pc.S;
    return BCol(c, int(r) - int(pad_h()), int(rs - r * pc.S) - int(pc.pad));
}

struct BIdx {
    uint n;
    uint oh;
    uint ow;
};

BIdx b_idx(uint kk) {
    uint plane = pc.OH * pc.OW;
    uint n = kk / plane;
    uint p = kk - n * plane;
    uint oh = p / pc.OW;
    return BIdx(n, oh, p - oh * pc.OW);
}

void b_step(inout BIdx t, BIdx d) {
    t.ow += d.ow;
    uint carry = uint(t.ow >= pc.OW);
    t.ow -= carry * pc.OW;
    t.oh += d.oh + carry;
    carry = uint(t.oh >= pc.OH);
    t.oh -= carry * pc.OH;
    t.n += d.n + carry;
}

float b_get(BCol col, BIdx t) {
    int ih = int(t.oh * pc.stride) + col.r0;
    int iw = int(t.ow * pc.stride) + col.s0;
    if (ih < 0 || iw < 0 || ih >= int(pc.H) || iw >= int(pc.W)) {
        return 0.0;
    }
    return X[((t.n * pc.C + col.c) * pc.H + uint(ih)) * pc.W + uint(iw)];
}

void store_c(uint k, uint col, uint z, float v) {
    dW[(z * pc.K + k) * pc_N() + col] = v;
}
