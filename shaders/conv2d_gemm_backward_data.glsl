// The operands, gathers and epilogue of conv2d_gemm_backward_data.comp (see its header), shared with its
// tensor-core variant conv2d_gemm_coopmat_backward_data.comp; the including shader adds the main loop.

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer WBuf { float Wt[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };

#include "conv_gemm_head.glsl"

uint pc_M() { return pc.N * pc.H * pc.W; }
uint pc_N() { return pc.C; }
uint pc_K() { return pc.K * pc.R * pc.S; }

// Along m, neighbouring threads read neighbouring output columns of dY; along kk, neighbouring
// threads read one (k, c) filter's contiguous taps.
#define A_MFAST 1
#define B_NFAST 0

// A row m = (n, h, w): the offset of image n in dY and (h + pad, w + pad).
struct ARow {
    uint base;
    uint hp;
    uint wp;
};

ARow a_row(uint m) {
    uint plane = pc.H * pc.W;
    uint n = m / plane;
    uint p = m - n * plane;
    uint h = p / pc.W;
    uint w = p - h * pc.W;
    return ARow(n * pc.K * pc.OH * pc.OW, h + pad_h(), w + pc.pad);
}

// A reduction index kk = (k, r, s).
struct AIdx {
    uint k;
    uint r;
    uint s;
};

AIdx a_idx(uint kk) {
    uint taps = pc.R * pc.S;
    uint k = kk / taps;
    uint rs = kk - k * taps;
    uint r = rs / pc.S;
    return AIdx(k, r, rs - r * pc.S);
}

void a_step(inout AIdx t, AIdx d) {
    t.s += d.s;
    uint carry = uint(t.s >= pc.S);
    t.s -= carry * pc.S;
    t.r += d.r + carry;
    carry = uint(t.r >= pc.R);
    t.r -= carry * pc.R;
    t.k += d.k + carry;
}

float a_get(ARow row, AIdx t) {
    int hs = int(row.hp) - int(t.r);
    int ws = int(row.wp) - int(t.s);
    if (hs < 0 || ws < 0) {
        return 0.0;
    }
    uint oh = uint(hs);
    uint ow = uint(ws);
    if (pc.stride != 1u) {
        oh = uint(hs) / pc.stride;
        ow = uint(ws) / pc.stride;
        if (oh * pc.stride != uint(hs) || ow * pc.stride != uint(ws)) {
            return 0.0;
        }
    }
    if (oh >= pc.OH || ow >= pc.OW) {
        return 0.0;
    }
    return dY[row.base + (t.k * pc.OH + oh) * pc.OW + ow];
}

// B[(k, r, s), c] = Wt[k, c, r, s]: a column is the input channel, a reduction index (k, r*S + s).
struct BCol {
    uint c;
};

BCol b_col(uint c) {
    return BCol(c);
}

struct BIdx {
    uint k;
    uint rs;
};

BIdx b_idx(uint kk) {
    uint taps = pc.R * pc.S;
    uint k = kk / taps;
    return BIdx(k, kk - k * taps);
}

void b_step(inout BIdx t, BIdx d) {
    uint taps = pc.R * pc.S;
    t.rs += d.rs;
    uint carry = uint(t.rs >= taps);
    t.rs -= carry * taps;
    t.k += d.k + carry;
}

float b_get(BCol col, BIdx t) {
    return Wt[(t.k * pc.C + col.c) * (pc.R * pc.S) + t.rs];
}

void store_c(uint m, uint c, uint z, float v) {
    uint plane = pc.H * pc.W;
    uint n = m / plane;
    dX[(n * pc.C + c) * plane + (m - n * plane)] = v;
}
