// C[M,N] = act(alpha * op(A) @ op(B) + (accumulate ? C : 0) + bias[N]), fp32, row-major.
// trans_a: A is stored [K,M]; trans_b: B is stored [N,K]. Any M, N, K (tiles are bounds-checked).
//
// Two fusions for the backward pass of a dense layer, each saving a launch and a pass over memory:
// - act_grad != 0 (an ACTIVATIONS code): binding 2 holds D[M,N], the previous layer's saved
//   activation output, instead of a bias, and the result is multiplied by f'(D) (slope: the
//   leaky slope): dX and the activation's backward in one launch. Not with has_bias or split-K.
// - ones_row != 0: row M-1 of op(A) is all ones and is not read from A (A holds M-1 rows), so
//   row M-1 of C is the column sums of op(B): with C = [dW; db] laid out contiguously, one
//   launch gives the weight gradient and the bias gradient.
//
// One workgroup computes a BM x BN tile of C with (BM/TM)*(BN/TN)*SK threads (local_size_x must
// equal that; TN must be a multiple of 4). Each thread owns TM x TN outputs, as a grid of
// sub-blocks up to 4 x 4 that are spread over the tile (rows g * BM/RGM + ty * SWM + r, columns
// h * BN/RGN + tx * 4 + c): so in the inner loop the threads of a warp read consecutive vec4s of
// a shared row, which is free of bank conflicts (contiguous TM x TN blocks put successive
// threads TN words apart: a 2-way conflict at TN = 8). The accumulators are vec4s, one per row
// and column group: as a 64-element float array, a 128 x 128 tile with 8 x 8 per thread ran at
// 2.3 TFLOP/s on an H200 (it looked spilled); as vec4s, 34 TFLOP/s on an H100.
//
// A and B stream through shared memory BK at a time, stored k-major (A row-major may stay
// k-contiguous instead: KR, below): the next K tile is loaded from global memory into registers
// while the current one is multiplied, then stored into shared memory. With DB = 1 it goes into
// a second buffer, so each K step needs one barrier; with DB = 0 (one buffer) it waits for a
// second barrier.
//
// The transposition flags are the specialisation constants TA and TB (tune_gemm copies them
// from the launch's trans_a / trans_b; the push constants are ignored here), so every load path
// compiles to straight-line code: a runtime branch between the layouts inside the K loop broke
// the NVIDIA compiler's scheduling (see gemm_coopmat.comp). VEC (bit 0: A, bit 1: B, bit 2: C)
// says the contiguous dimension of that operand is a multiple of 4, so its rows start 16-byte
// aligned and the operand is loaded (stored, for C) as vec4 granules; otherwise scalar loads.
// GM > 1 visits the workgroups in bands of GM tile rows, so tiles running at the same time
// share their panels of A and B in L2. DB = 0 (the default: faster on an H100 at every size
// measured, see registry.GEMM_TILES) keeps one shared buffer and a second barrier per K step.
//
// Sliced-K (SK > 1): the workgroup holds SK groups of (BM/TM)*(BN/TN) threads; all of them load
// each K tile, and group s multiplies only its BK/SK rows of it. At the end the groups' partial
// tiles are summed through shared memory. It gives a tile SK times the threads without more
// tiles or a second launch: at M = 256 (an MLP's batch) there are too few tiles to fill a big
// GPU, and smaller tiles would cut the work per shared-memory read instead.
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
layout(constant_id = 12) const uint SK = 1;  // K slices per workgroup (sliced-K)
layout(constant_id = 13) const uint DB = 0;  // 1: double-buffered shared tiles; 0: one buffer
// The epilogue's activation and activation derivative (ACTIVATIONS codes), copied by tune_gemm
// from the launch's act and act_grad (the push constants act and act_grad are unused): only the
// code in use is compiled. With a runtime switch over every activation, the fused input-gradient
// GEMM of the small MLP (256 x 1024 x 1024) took 38.7 us in a step on an H100, against 30.0 us
// for the same tiles without the derivative.
layout(constant_id = 14) const uint ACT = 0;
layout(constant_id = 15) const uint AG = 0;
// KR = 1 (A stored [M,K]): keep A's tile k-contiguous in shared memory, as it is in global
// memory, instead of transposing it to k-major on the way in (4 scalar stores per vec4 granule,
// with bank conflicts). The tile is BM rows of BK + 4 words: one conflict-free vec4 store per
// granule, and the inner loop reads a vec4 of 4 k's per row of the thread and does 4 k steps
// from registers (the same shared reads per multiply-add; the padding puts the 2 or 4 rows a
// warp reads, 4 apart, in distinct banks, and keeps the reads at fixed offsets from one base).
// H100, 4096^3, 128 x 128 x 32 / 8 x 8: 36.6 -> 39.9 TFLOP/s (A k-major: 44.6); the best tile
// without it, 64 x 128 x 32 / 4 x 8, drops to 33.8 with it. The same layout for B stored [N,K]
// (slots rotated against bank conflicts) was slower at BK 32 and is not kept. Ignored when A is
// stored k-major or a K slice is not a multiple of 4.
layout(constant_id = 16) const uint KR = 0;

// The push fields after those gemm_coopmat shares (registry: gemm's push list): k_splits, and
// act_grad (unused: AG) and ones_row for the fusions above.
#define GEMM_PUSH_EXTRA uint k_splits; uint act_grad; uint ones_row;
#include "gemm_head.glsl"

const uint WM = BM / TM;  // threads along m
const uint WN = BN / TN;  // threads along n
const uint NTS = WM * WN;  // threads per K slice
const uint NT = NTS * SK;  // threads per workgroup
const uint KS = BK / SK;   // k rows of each tile per slice
// Sub-blocks: SWM x SWN outputs each (4 when TM, TN allow), RGM x RGN of them per thread, the
// groups BM/RGM rows (BN/RGN columns) apart. Integer arithmetic only: glslang 13.1 emits
// invalid SPIR-V for ?: between specialisation constants.
const uint TM4 = uint(TM % 4u == 0u);
const uint SWM = TM4 * 4u + (1u - TM4) * TM;
const uint SWN = 4u;
const uint RGM = TM / SWM;
const uint RGN = TN / 4u;
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
const bool VC = (VEC & 4u) != 0u;
// Shared rows (k-major), in floats: 4 words of padding keep rows 16-byte aligned for the vec4
// reads of the inner loop and shift successive k rows across the banks for the column stores.
const uint SA = BM + 4u;
const uint SB = BN + 4u;
// A buffer: the larger of the k-major tile and the k-contiguous one (BM rows of BK + 4 words, see
// KR), max(BM, BK) in unsigned arithmetic (no ?: on specialisation constants).
const uint MAX_MK = BM + (BK - BM) * ((BM - BK) >> 31u);
const uint A_BUF = (BK * BM + 4u * MAX_MK) / 4u;  // vec4s per buffer
const uint B_BUF = BK * SB / 4u;
const uint A_GRAN = BM * BK / GA;  // granules per tile
const uint B_GRAN = BK * BN / GB;
const uint A_LOADS = (A_GRAN + NT - 1u) / NT;
const uint B_LOADS = (B_GRAN + NT - 1u) / NT;

shared vec4 As[(1u + DB) * A_BUF];
shared vec4 Bs[(1u + DB) * B_BUF];
// Sliced-K: one slice's partial tile at a time, for the final sum (1 - 1/SK: 0 or 1).
const uint RED = (1u - 1u / SK) * BM * BN / 4u + 1u;
shared vec4 Red[RED];
// Whether A is k-contiguous in shared memory (see KR): the flag, A stored [M,K], and a K slice
// of whole vec4s. QS: k steps per shared read of A (4 when it is, else 1).
const uint KS4 = 1u - ((KS | (KS >> 1u)) & 1u);
const uint AR = (KR & 1u) * (1u - TA1) * KS4;
const uint QS = 1u + 3u * AR;

// Word offset of (row, k) in the k-contiguous A tile: BK + 4 words per row.
uint ar_word(uint row, uint k) {
    return row * (BK + 4u) + k;
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
    // The stored rows of A: M, or M - 1 under a row of ones (its granules hold only ones, as
    // tune_gemm vectorises A only when M - 1 is a multiple of 4).
    const uint stored = pc.M - min(pc.ones_row, 1u);
    if (l < A_GRAN && gm >= stored && gm < pc.M && gk < k_end) {
        v = vec4(1.0);
    } else if (l < A_GRAN && gm < pc.M && gk < k_end) {
        uint idx = TA == 0u ? gm * pc.K + gk : gk * stored + gm;
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
    if (l < B_GRAN && gn < pc.N && gk < k_end) {
        uint idx = TB == 0u ? gk * pc.N + gn : gn * pc.K + gk;
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
        if (AR == 1u) {
            w = ar_word(s.x, s.y);  // granules run along k: one vec4, or one scalar
            if (GA == 1u) {
                As[base + (w >> 2u)][w & 3u] = v.x;
            } else {
                As[base + (w >> 2u)] = v;
            }
        } else if (GA == 1u) {
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

// Column of C in the tile of a thread's column group h (4 columns from there).
uint tile_col(uint tx, uint h) {
    return h * GSN + tx * 4u;
}

// Row of C in the tile of a thread's output row i.
uint tile_row(uint ty, uint i) {
    return (i / SWM) * GSM + ty * SWM + i % SWM;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint slice = tid / NTS;
    const uint tx = (tid % NTS) % WN;
    const uint ty = (tid % NTS) / WN;
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
    const uint M = pc.M;
    const uint N = pc.N;
    const uint K = pc.K;
    // Split-K: workgroup z sums only its slice of K and writes raw partial sums into slice z of
    // C viewed as [splits, M, N]; a splitk_epilogue launch then adds the slices and applies the
    // epilogue. It keeps a GPU busy when M x N has too few tiles (e.g. the logits of a classifier).
    const uint splits = max(pc.k_splits, 1u);
    const uint k_chunk = ((K + splits * BK - 1u) / (splits * BK)) * BK;
    const uint k_begin = gl_WorkGroupID.z * k_chunk;
    const uint k_end = min(K, k_begin + k_chunk);

    // acc[i * RGN + h]: output row i, columns tile_col(tx, h) .. + 3.
    vec4 acc[TM * RGN];
    [[unroll]] for (uint i = 0u; i < TM * RGN; ++i) {
        acc[i] = vec4(0.0);
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
        [[unroll]] for (uint kq = 0u; kq < KS; kq += QS) {
            const uint k4 = slice * KS + kq;
            // k-contiguous A: 4 k's of each of the thread's rows in one vec4 read.
            vec4 av[TM * AR + 1u - AR];
            if (AR == 1u) {
                [[unroll]] for (uint i = 0u; i < TM; ++i) {
                    av[i] = As[a_base + (ar_word(tile_row(ty, i), k4) >> 2u)];
                }
            }
            [[unroll]] for (uint j = 0u; j < QS; ++j) {
                const uint kk = k4 + j;
                float a[TM];
                if (AR == 1u) {
                    [[unroll]] for (uint i = 0u; i < TM; ++i) {
                        a[i] = av[i][j];
                    }
                } else {
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
                }
                vec4 b[RGN];
                [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                    b[h] = Bs[b_base + ((kk * SB + tile_col(tx, h)) >> 2u)];
                }
                [[unroll]] for (uint i = 0u; i < TM; ++i) {
                    [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                        acc[i * RGN + h] = fma(vec4(a[i]), b[h], acc[i * RGN + h]);
                    }
                }
            }
        }

        if (DB == 0u) {
            barrier();  // one buffer: everyone has read it before it is overwritten
        }
        if (more) {
            // Into the other buffer: every thread finished reading it before the last barrier.
            stage ^= DB;
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                put_a(stage * A_BUF, tid + i * NT, ra[i]);
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                put_b(stage * B_BUF, tid + i * NT, rb[i]);
            }
        }
        barrier();
    }

    // Sliced-K: slices 1..SK-1 in turn hand their partial tile to slice 0, which finishes.
    if (SK > 1u) {
        [[unroll]] for (uint from = 1u; from < SK; ++from) {
            if (slice == from) {
                [[unroll]] for (uint i = 0u; i < TM; ++i) {
                    [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                        Red[(tile_row(ty, i) * BN + tile_col(tx, h)) >> 2u] = acc[i * RGN + h];
                    }
                }
            }
            barrier();
            if (slice == 0u) {
                [[unroll]] for (uint i = 0u; i < TM; ++i) {
                    [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                        acc[i * RGN + h] += Red[(tile_row(ty, i) * BN + tile_col(tx, h)) >> 2u];
                    }
                }
            }
            barrier();
        }
        if (slice != 0u) {
            return;
        }
    }

    // Same order as cpu_ops.gemm: scale, then the old C, then the bias, then act. No `continue`
    // inside these unrolled loops: a loop the compiler cannot unroll indexes acc dynamically.
    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        const uint m = m0 + tile_row(ty, i);
        [[unroll]] for (uint h = 0u; h < RGN; ++h) {
            const uint nc = n0 + tile_col(tx, h);
            const vec4 raw = acc[i * RGN + h];
            if (m < M && VC && nc < N) {
                // N % 4 == 0 and every column group starts at a multiple of 4: wholly in or out.
                if (splits > 1u) {
                    C4[((gl_WorkGroupID.z * M + m) * N + nc) >> 2u] = raw;
                } else {
                    uint o = (m * N + nc) >> 2u;
                    vec4 v = raw * pc.alpha;
                    if (pc.accumulate != 0u) {
                        v += C4[o];
                    }
                    if (pc.has_bias != 0u) {
                        v += bias4[nc >> 2u];
                    }
                    if (AG != ACT_NONE) {
                        vec4 d = bias4[o];
                        v *= vec4(activation_derivative(d.x, AG, pc.slope),
                                  activation_derivative(d.y, AG, pc.slope),
                                  activation_derivative(d.z, AG, pc.slope),
                                  activation_derivative(d.w, AG, pc.slope));
                    }
                    C4[o] = vec4(vk_activate(v.x, ACT, pc.slope), vk_activate(v.y, ACT, pc.slope),
                                 vk_activate(v.z, ACT, pc.slope), vk_activate(v.w, ACT, pc.slope));
                }
            } else if (m < M && !VC) {
                [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                    const uint n = nc + c;
                    if (n < N) {
                        if (splits > 1u) {
                            C[(gl_WorkGroupID.z * M + m) * N + n] = raw[c];
                        } else {
                            float v = raw[c] * pc.alpha;
                            if (pc.accumulate != 0u) {
                                v += C[m * N + n];
                            }
                            if (pc.has_bias != 0u) {
                                v += bias[n];
                            }
                            if (AG != ACT_NONE) {
                                v *= activation_derivative(bias[m * N + n], AG, pc.slope);
                            }
                            C[m * N + n] = vk_activate(v, ACT, pc.slope);
                        }
                    }
                }
            }
        }
    }
}
