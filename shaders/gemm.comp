// C[M,N] = act(alpha * op(A) @ op(B) + (accumulate ? C : 0) + bias[N]), fp32, row-major.
// trans_a: A is stored [K,M]; trans_b: B is stored [N,K]. Any M, N, K (tiles are bounds-checked).
//
// One workgroup computes a BM x BN tile of C with (BM/TM)*(BN/TN) threads (local_size_x must
// equal that). Each thread owns TM x TN outputs, as a grid of sub-blocks up to 4 x 4 that are
// spread over the tile (rows g * BM/RGM + ty * SWM + r, likewise columns): so in the inner loop
// the threads of a warp read consecutive vec4s of a shared row, which is free of bank conflicts
// (contiguous TM x TN blocks put successive threads TN words apart: a 2-way conflict at TN = 8).
//
// A and B stream through shared memory BK at a time, both stored k-major, double-buffered: the
// next K tile is loaded from global memory into registers while the current one is multiplied,
// then stored into the other buffer, so each K step needs one barrier, not two.
//
// The transposition flags are the specialisation constants TA and TB (tune_gemm copies them
// from the launch's trans_a / trans_b; the push constants are ignored here), so every load path
// compiles to straight-line code: a runtime branch between the layouts inside the K loop broke
// the NVIDIA compiler's scheduling (see gemm_coopmat.comp). VEC (bit 0: A, bit 1: B, bit 2: C)
// says the contiguous dimension of that operand is a multiple of 4, so its rows start 16-byte
// aligned and the operand is loaded (stored, for C) as vec4 granules; otherwise scalar loads.
// GM > 1 visits the workgroups in bands of GM tile rows, so tiles running at the same time
// share their panels of A and B in L2.
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
layout(constant_id = 11) const uint GM = 1;  // tile rows per L2 band

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
// Sub-blocks: SWM x SWN outputs each (4 when TM, TN allow), RGM x RGN of them per thread, the
// groups BM/RGM rows (BN/RGN columns) apart. Integer arithmetic only: glslang 13.1 emits
// invalid SPIR-V for ?: between specialisation constants.
const uint TM4 = uint(TM % 4u == 0u);
const uint TN4 = uint(TN % 4u == 0u);
const uint SWM = TM4 * 4u + (1u - TM4) * TM;
const uint SWN = TN4 * 4u + (1u - TN4) * TN;
const uint RGM = TM / SWM;
const uint RGN = TN / SWN;
const uint GSM = BM / RGM;  // row distance between a thread's sub-blocks
const uint GSN = BN / RGN;
// Contiguous tile extent of each operand in global memory, and its granule width (4 when the
// rows are 16-byte aligned and the tile extent takes whole vec4s, else 1).
const uint TA1 = TA & 1u;
const uint TB1 = TB & 1u;
const uint A_ROW = TA1 * BM + (1u - TA1) * BK;
const uint B_ROW = TB1 * BK + (1u - TB1) * BN;
const uint GA = 1u + 3u * ((VEC & 1u) & (1u - ((A_ROW | (A_ROW >> 1u)) & 1u)));
const uint GB = 1u + 3u * ((VEC >> 1u) & 1u & (1u - ((B_ROW | (B_ROW >> 1u)) & 1u)));
const bool VC = (VEC & 4u) != 0u && SWN == 4u;
// Shared rows (k-major), in floats: 4 words of padding keep rows 16-byte aligned for the vec4
// reads of the inner loop and shift successive k rows across the banks for the column stores.
const uint SA = BM + 4u;
const uint SB = BN + 4u;
const uint A_BUF = BK * SA / 4u;  // vec4s per buffer
const uint B_BUF = BK * SB / 4u;
const uint A_GRAN = BM * BK / GA;  // granules per tile
const uint B_GRAN = BK * BN / GB;
const uint A_LOADS = (A_GRAN + NT - 1u) / NT;
const uint B_LOADS = (B_GRAN + NT - 1u) / NT;

shared vec4 As[2u * A_BUF];
shared vec4 Bs[2u * B_BUF];

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

// Store granule l into buffer `base` (in vec4s) of the k-major A tile.
void put_a(uint base, uint l, vec4 v) {
    if (l < A_GRAN) {
        uvec2 s = a_slot(l);
        uint w = s.y * SA + s.x;  // word offset in the buffer
        if (GA == 1u) {
            As[base + (w >> 2u)][w & 3u] = v.x;
        } else if (TA != 0u) {
            As[base + (w >> 2u)] = v;  // along m: one aligned vec4
        } else {
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                uint wc = w + c * SA;
                As[base + (wc >> 2u)][wc & 3u] = v[c];
            }
        }
    }
}

void put_b(uint base, uint l, vec4 v) {
    if (l < B_GRAN) {
        uvec2 s = b_slot(l);
        uint w = s.y * SB + s.x;
        if (GB == 1u) {
            Bs[base + (w >> 2u)][w & 3u] = v.x;
        } else if (TB == 0u) {
            Bs[base + (w >> 2u)] = v;  // along n: one aligned vec4
        } else {
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                uint wc = w + c * SB;
                Bs[base + (wc >> 2u)][wc & 3u] = v[c];
            }
        }
    }
}

// Column (row) of C in the tile for a thread's output column j (row i).
uint tile_col(uint tx, uint j) {
    return (j / SWN) * GSN + tx * SWN + j % SWN;
}

uint tile_row(uint ty, uint i) {
    return (i / SWM) * GSM + ty * SWM + i % SWM;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint tx = tid % WN;
    const uint ty = tid / WN;
    // Tile coordinates, banded for L2 reuse when GM > 1.
    uint tile_m = gl_WorkGroupID.y;
    uint tile_n = gl_WorkGroupID.x;
    if (GM > 1u) {
        uint across = gl_NumWorkGroups.x;
        uint linear = gl_WorkGroupID.y * across + gl_WorkGroupID.x;
        uint band = linear / (GM * across);
        uint first = band * GM;
        uint rows = min(gl_NumWorkGroups.y - first, GM);
        uint inside = linear - band * GM * across;
        tile_m = first + inside % rows;
        tile_n = inside / rows;
    }
    const uint m0 = tile_m * BM;
    const uint n0 = tile_n * BN;
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

    // The first K tile goes straight into buffer 0.
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        put_a(0u, tid + i * NT, load_a(tid + i * NT, m0, k_begin, k_end));
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        put_b(0u, tid + i * NT, load_b(tid + i * NT, n0, k_begin, k_end));
    }
    barrier();

    uint stage = 0u;
    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        const uint k1 = k0 + BK;
        const bool more = k1 < k_end;
        if (more) {
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                ra[i] = load_a(tid + i * NT, m0, k1, k_end);
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                rb[i] = load_b(tid + i * NT, n0, k1, k_end);
            }
        }

        const uint a_base = stage * A_BUF;
        const uint b_base = stage * B_BUF;
        [[unroll]] for (uint kk = 0u; kk < BK; ++kk) {
            float a[TM];
            float b[TN];
            [[unroll]] for (uint g = 0u; g < RGM; ++g) {
                uint w = kk * SA + g * GSM + ty * SWM;
                if (SWM == 4u) {
                    vec4 v = As[a_base + (w >> 2u)];
                    a[4u * g] = v.x;
                    a[4u * g + 1u] = v.y;
                    a[4u * g + 2u] = v.z;
                    a[4u * g + 3u] = v.w;
                } else {
                    [[unroll]] for (uint r = 0u; r < SWM; ++r) {
                        a[g * SWM + r] = As[a_base + ((w + r) >> 2u)][(w + r) & 3u];
                    }
                }
            }
            [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                uint w = kk * SB + h * GSN + tx * SWN;
                if (SWN == 4u) {
                    vec4 v = Bs[b_base + (w >> 2u)];
                    b[4u * h] = v.x;
                    b[4u * h + 1u] = v.y;
                    b[4u * h + 2u] = v.z;
                    b[4u * h + 3u] = v.w;
                } else {
                    [[unroll]] for (uint c = 0u; c < SWN; ++c) {
                        b[h * SWN + c] = Bs[b_base + ((w + c) >> 2u)][(w + c) & 3u];
                    }
                }
            }
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                [[unroll]] for (uint j = 0u; j < TN; ++j) {
                    acc[i * TN + j] = fma(a[i], b[j], acc[i * TN + j]);
                }
            }
        }

        if (more) {
            // Into the other buffer: every thread finished reading it before the last barrier.
            stage ^= 1u;
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                put_a(stage * A_BUF, tid + i * NT, ra[i]);
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                put_b(stage * B_BUF, tid + i * NT, rb[i]);
            }
        }
        barrier();
    }

    // Same order as cpu_ops.gemm: scale, then the old C, then the bias, then act. No `continue`
    // inside these unrolled loops: a loop the compiler cannot unroll indexes acc dynamically.
    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        const uint m = m0 + tile_row(ty, i);
        if (m < M) {
            if (VC) {
                // N % 4 == 0 and every sub-block starts at a multiple of 4: wholly in or out.
                [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                    const uint n = n0 + tile_col(tx, 4u * h);
                    if (n < N) {
                        vec4 v = vec4(acc[i * TN + 4u * h], acc[i * TN + 4u * h + 1u],
                                      acc[i * TN + 4u * h + 2u], acc[i * TN + 4u * h + 3u]);
                        if (splits > 1u) {
                            C4[((gl_WorkGroupID.z * M + m) * N + n) >> 2u] = v;
                        } else {
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
                    }
                }
            } else {
                [[unroll]] for (uint j = 0u; j < TN; ++j) {
                    const uint n = n0 + tile_col(tx, j);
                    if (n < N) {
                        if (splits > 1u) {
                            C[(gl_WorkGroupID.z * M + m) * N + n] = acc[i * TN + j];
                        } else {
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
        }
    }
}
