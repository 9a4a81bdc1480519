// C[M,N] = act(alpha * op(A) @ op(B) + (accumulate ? C : 0) + bias[N]), fp32, row-major.
// trans_a: A is stored [K,M]; trans_b: B is stored [N,K]. Any M, N, K (tiles are bounds-checked).
//
// One workgroup computes a BM x BN tile of C. Its (BM/TM)*(BN/TN) threads (local_size_x must
// equal that) each own a contiguous TM x TN block of it, so each k step reads its TM values of
// A and TN of B from shared memory as vec4s (a quarter of the shared loads of scalar reads;
// threads of one row or column read the same words, a broadcast). A and B stream through
// shared memory BK at a time, both stored k-major; the next K tile is prefetched into registers
// while the current one is multiplied, hiding global latency.
//
// The transposition flags are the specialisation constants TA and TB (tune_gemm copies them
// from the launch's trans_a / trans_b; the push constants are ignored here), so every load path
// compiles to straight-line code: a runtime branch between the layouts inside the K loop broke
// the NVIDIA compiler's scheduling (see gemm_coopmat.comp). VEC (bit 0: A, bit 1: B, bit 2: C)
// says the contiguous dimension of that operand is a multiple of 4, so its rows start 16-byte
// aligned and the operand is loaded (stored, for C) as vec4 granules; otherwise scalar loads.
#version 450
#extension GL_GOOGLE_include_directive : require
// [[unroll]]: the register tiles must stay in registers; a loop the driver leaves rolled indexes
// them dynamically and spills them to local memory (3x slower in the cooperative-matrix GEMM).
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint BM = 64;
layout(constant_id = 4) const uint BN = 64;
layout(constant_id = 5) const uint BK = 16;
layout(constant_id = 6) const uint TM = 4;
layout(constant_id = 7) const uint TN = 4;
layout(constant_id = 8) const uint TA = 0;   // A stored [K,M]
layout(constant_id = 9) const uint TB = 0;   // B stored [N,K]
layout(constant_id = 10) const uint VEC = 0; // vec4 access: bit 0 A, bit 1 B, bit 2 C

layout(std430, set = 0, binding = 0) readonly buffer ABuf { float A[]; };
layout(std430, set = 0, binding = 0) readonly buffer ABuf4 { vec4 A4[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBuf { float B[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBuf4 { vec4 B4[]; };
layout(std430, set = 0, binding = 2) readonly buffer BiasBuf { float bias[]; };
layout(std430, set = 0, binding = 2) readonly buffer BiasBuf4 { vec4 bias4[]; };
layout(std430, set = 0, binding = 3) buffer CBuf { float C[]; };
layout(std430, set = 0, binding = 3) buffer CBuf4 { vec4 C4[]; };

layout(push_constant) uniform Push {
    uint M;
    uint N;
    uint K;
    uint trans_a;  // unused: TA
    uint trans_b;  // unused: TB
    uint has_bias;
    uint act;
    uint accumulate;
    float alpha;
    float slope;
    uint k_splits;
} p;

#include "common_gemm_act.glsl"

const uint WM = BM / TM;  // threads along m
const uint WN = BN / TN;  // threads along n
const uint NT = WM * WN;  // threads per workgroup
// Contiguous tile extent of each operand in global memory, and its granule width (4 when the
// rows are 16-byte aligned and the tile extent takes whole vec4s, else 1). Integer arithmetic
// only: glslang 13.1 emits invalid SPIR-V for ?: between specialisation constants.
const uint TA1 = TA & 1u;
const uint TB1 = TB & 1u;
const uint A_ROW = TA1 * BM + (1u - TA1) * BK;
const uint B_ROW = TB1 * BK + (1u - TB1) * BN;
const uint GA = 1u + 3u * ((VEC & 1u) & (1u - ((A_ROW | (A_ROW >> 1u)) & 1u)));
const uint GB = 1u + 3u * ((VEC >> 1u) & 1u & (1u - ((B_ROW | (B_ROW >> 1u)) & 1u)));
const bool VC = (VEC & 4u) != 0u && TN % 4u == 0u;
// Shared rows (k-major), in floats: 4 words of padding keep rows 16-byte aligned for the vec4
// reads of the inner loop and shift successive k rows across the banks for the column stores.
const uint SA = BM + 4u;
const uint SB = BN + 4u;
const uint A_GRAN = BM * BK / GA;  // granules per tile
const uint B_GRAN = BK * BN / GB;
const uint A_LOADS = (A_GRAN + NT - 1u) / NT;
const uint B_LOADS = (B_GRAN + NT - 1u) / NT;

shared vec4 As[BK * SA / 4u];
shared vec4 Bs[BK * SB / 4u];

void store_a(uint idx, float v) {
    As[idx >> 2u][idx & 3u] = v;
}

void store_b(uint idx, float v) {
    Bs[idx >> 2u][idx & 3u] = v;
}

// (row along m, k) within the tile of A granule l; the granule runs along the contiguous dim.
uvec2 a_slot(uint l) {
    return TA == 0u ? uvec2(l / (BK / GA), (l % (BK / GA)) * GA) : uvec2((l % (BM / GA)) * GA, l / (BM / GA));
}

// (column along n, k) within the tile of B granule l.
uvec2 b_slot(uint l) {
    return TB == 0u ? uvec2((l % (BN / GB)) * GB, l / (BN / GB)) : uvec2(l / (BK / GB), (l % (BK / GB)) * GB);
}

// Granule l of the A tile whose K begins at kt (zeros outside the matrix or this K slice).
// Granules never straddle an edge: with GA == 4 the contiguous dimension is a multiple of 4.
vec4 load_a(uint l, uint m0, uint kt, uint k_end) {
    uvec2 s = a_slot(l);
    uint gm = m0 + s.x;
    uint gk = kt + s.y;
    vec4 v = vec4(0.0);
    if (l < A_GRAN && gm < p.M && gk < k_end) {
        uint idx = TA == 0u ? gm * p.K + gk : gk * p.M + gm;
        if (GA == 4u) {
            v = A4[idx >> 2u];
        } else {
            v.x = A[idx];
        }
    }
    return v;
}

vec4 load_b(uint l, uint n0, uint kt, uint k_end) {
    uvec2 s = b_slot(l);
    uint gn = n0 + s.x;
    uint gk = kt + s.y;
    vec4 v = vec4(0.0);
    if (l < B_GRAN && gn < p.N && gk < k_end) {
        uint idx = TB == 0u ? gk * p.N + gn : gn * p.K + gk;
        if (GB == 4u) {
            v = B4[idx >> 2u];
        } else {
            v.x = B[idx];
        }
    }
    return v;
}

void put_a(uint l, vec4 v) {
    if (l < A_GRAN) {
        uvec2 s = a_slot(l);
        if (GA == 1u) {
            store_a(s.y * SA + s.x, v.x);
        } else if (TA != 0u) {
            As[(s.y * SA + s.x) >> 2u] = v;  // along m: one aligned vec4
        } else {
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                store_a((s.y + c) * SA + s.x, v[c]);
            }
        }
    }
}

void put_b(uint l, vec4 v) {
    if (l < B_GRAN) {
        uvec2 s = b_slot(l);
        if (GB == 1u) {
            store_b(s.y * SB + s.x, v.x);
        } else if (TB == 0u) {
            Bs[(s.y * SB + s.x) >> 2u] = v;  // along n: one aligned vec4
        } else {
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                store_b((s.y + c) * SB + s.x, v[c]);
            }
        }
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint tx = tid % WN;
    const uint ty = tid / WN;
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint M = p.M;
    const uint N = p.N;
    const uint K = p.K;
    // Split-K: workgroup z sums only its slice of K and writes raw partial sums into slice z of
    // C viewed as [splits, M, N]; a splitk_epilogue launch then adds the slices and applies the
    // epilogue. It keeps a GPU busy when M x N has too few tiles (e.g. the logits of a classifier).
    const uint splits = max(p.k_splits, 1u);
    const uint k_chunk = ((K + splits * BK - 1u) / (splits * BK)) * BK;
    const uint k_begin = gl_WorkGroupID.z * k_chunk;
    const uint k_end = min(K, k_begin + k_chunk);

    float acc[TM * TN];
    [[unroll]] for (uint i = 0u; i < TM * TN; ++i) {
        acc[i] = 0.0;
    }
    vec4 ra[A_LOADS];
    vec4 rb[B_LOADS];

    // Prefetch the first K tile.
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        ra[i] = load_a(tid + i * NT, m0, k_begin, k_end);
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        rb[i] = load_b(tid + i * NT, n0, k_begin, k_end);
    }

    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
            put_a(tid + i * NT, ra[i]);
        }
        [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
            put_b(tid + i * NT, rb[i]);
        }
        barrier();

        uint k1 = k0 + BK;
        if (k1 < k_end) {
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                ra[i] = load_a(tid + i * NT, m0, k1, k_end);
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                rb[i] = load_b(tid + i * NT, n0, k1, k_end);
            }
        }

        [[unroll]] for (uint kk = 0u; kk < BK; ++kk) {
            float a[TM];
            float b[TN];
            if (TM % 4u == 0u) {
                [[unroll]] for (uint q = 0u; q < TM / 4u; ++q) {
                    vec4 v = As[(kk * SA + ty * TM) / 4u + q];
                    a[4u * q] = v.x;
                    a[4u * q + 1u] = v.y;
                    a[4u * q + 2u] = v.z;
                    a[4u * q + 3u] = v.w;
                }
            } else {
                [[unroll]] for (uint i = 0u; i < TM; ++i) {
                    uint idx = kk * SA + ty * TM + i;
                    a[i] = As[idx >> 2u][idx & 3u];
                }
            }
            if (TN % 4u == 0u) {
                [[unroll]] for (uint q = 0u; q < TN / 4u; ++q) {
                    vec4 v = Bs[(kk * SB + tx * TN) / 4u + q];
                    b[4u * q] = v.x;
                    b[4u * q + 1u] = v.y;
                    b[4u * q + 2u] = v.z;
                    b[4u * q + 3u] = v.w;
                }
            } else {
                [[unroll]] for (uint j = 0u; j < TN; ++j) {
                    uint idx = kk * SB + tx * TN + j;
                    b[j] = Bs[idx >> 2u][idx & 3u];
                }
            }
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                [[unroll]] for (uint j = 0u; j < TN; ++j) {
                    acc[i * TN + j] = fma(a[i], b[j], acc[i * TN + j]);
                }
            }
        }
        barrier();
    }

    // Same order as cpu_ops.gemm: scale, then the old C, then the bias, then act.
    const uint nt = n0 + tx * TN;
    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        uint m = m0 + ty * TM + i;
        if (m >= M) {
            continue;
        }
        if (VC) {
            // N % 4 == 0 and nt % 4 == 0: each group of 4 columns is wholly in or out.
            [[unroll]] for (uint q = 0u; q < TN / 4u; ++q) {
                uint n = nt + 4u * q;
                if (n >= N) {
                    continue;
                }
                vec4 v = vec4(acc[i * TN + 4u * q], acc[i * TN + 4u * q + 1u],
                              acc[i * TN + 4u * q + 2u], acc[i * TN + 4u * q + 3u]);
                if (splits > 1u) {
                    C4[((gl_WorkGroupID.z * M + m) * N + n) >> 2u] = v;
                    continue;
                }
                uint o = (m * N + n) >> 2u;
                v *= p.alpha;
                if (p.accumulate != 0u) {
                    v += C4[o];
                }
                if (p.has_bias != 0u) {
                    v += bias4[n >> 2u];
                }
                C4[o] = vec4(vk_activate(v.x, p.act, p.slope), vk_activate(v.y, p.act, p.slope),
                             vk_activate(v.z, p.act, p.slope), vk_activate(v.w, p.act, p.slope));
            }
        } else {
            [[unroll]] for (uint j = 0u; j < TN; ++j) {
                uint n = nt + j;
                if (n >= N) {
                    continue;
                }
                if (splits > 1u) {
                    C[(gl_WorkGroupID.z * M + m) * N + n] = acc[i * TN + j];
                    continue;
                }
                float v = acc[i * TN + j] * p.alpha;
                if (p.accumulate != 0u) {
                    v += C[m * N + n];
                }
                if (p.has_bias != 0u) {
                    v += bias[n];
                }
                C[m * N + n] = vk_activate(v, p.act, p.slope);
            }
        }
    }
}
