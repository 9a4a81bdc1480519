// The operands, gathers and epilogue of conv2d_gemm.comp (see its header), shared with its
// tensor-core variant conv2d_gemm_coopmat.comp; the including shader adds the main loop.

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
#define A_MFAST 1
#define B_NFAST 0

// A row m = (n, oh, ow): the offset of image n and the input position of tap (0, 0).
struct ARow {
    uint base;
    int ih0;
    int iw0;
};

ARow a_row(uint m) {
    uint plane = pc.OH * pc.OW;
    uint n = m / plane;
    uint p = m - n * plane;
    uint oh = p / pc.OW;
    uint ow = p - oh * pc.OW;
    int pad = int(pc.pad);
    return ARow(n * pc.C * pc.H * pc.W, int(oh * pc.stride) - int(pad_h()), int(ow * pc.stride) - pad);
}

// A reduction index kk = (c, r, s).
struct AIdx {
    uint c;
    uint r;
    uint s;
};

AIdx a_idx(uint kk) {
    uint taps = pc.R * pc.S;
    uint c = kk / taps;
    uint rs = kk - c * taps;
    uint r = rs / pc.S;
    return AIdx(c, r, rs - r * pc.S);
}

void a_step(inout AIdx t, AIdx d) {
    t.s += d.s;
    uint carry = uint(t.s >= pc.S);
    t.s -= carry * pc.S;
    t.r += d.r + carry;
    carry = uint(t.r >= pc.R);
    t.r -= carry * pc.R;
    t.c += d.c + carry;
}

float a_get(ARow row, AIdx t) {
    int ih = row.ih0 + int(t.r);
    int iw = row.iw0 + int(t.s);
    if (ih < 0 || iw < 0 || ih >= int(pc.H) || iw >= int(pc.W)) {
        return 0.0;
    }
    return X[row.base + (t.c * pc.H + uint(ih)) * pc.W + uint(iw)];
}

// B[kk, k] = Wt[k, kk]: a column is the filter's offset, the reduction index kk itself.
struct BCol {
    uint base;
};

BCol b_col(uint k) {
    return BCol(k * pc_K());
}

struct BIdx {
    uint kk;
};

BIdx b_idx(uint kk) {
    return BIdx(kk);
}

void b_step(inout BIdx t, BIdx d) {
    t.kk += d.kk;
}

float b_get(BCol col, BIdx t) {
    return Wt[col.base + t.kk];
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
