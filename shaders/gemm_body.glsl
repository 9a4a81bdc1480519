// gemm.comp's body (see its header for the design): gemm.comp includes it as it is, gemm_copy.comp
// with GEMM_SECOND_OUTPUT defined, which adds binding 4 (Y) and has the epilogue write Y = act_YA(C)
// beside C, and gemm_residual.comp with GEMM_RESIDUAL, which adds binding 4 (R, read) to the
// finished C. Separate files rather than specialisation constants because a binding the shader
// references must be in the pipeline's layout, and gemm's launches bind four buffers.
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
// stored k-major or a K slice is not a multiple of 4. Session 13: those figures had the runtime
// test for a row of ones (see NR) in A's loads; without it, KR 0 with warp tiles (WL 8) is faster
// (43.2 against 41.5 with KR).
layout(constant_id = 16) const uint KR = 0;
// WL != 0: warp tiling. Each group of 32 invocations (a subgroup on NVIDIA) owns a sub-tile of
// the block tile, (32 / WL) lanes along m by WL along n, each lane TM x TN outputs as its
// sub-blocks: so a shared read of A or B by a warp touches 32 / WL or WL distinct vec4s, in
// consecutive words (conflict-free, and broadcast to the lanes sharing them), where the
// block-wide layout (WL = 0) has a warp span all BN columns. With KR, a lane's rows are
// interleaved with its neighbours' (row r of a sub-block at lane_m + r * lanes along m), so the
// k-contiguous reads of 32 / WL lanes fall in distinct banks. Needs (BM/TM)(BN/TN) a multiple of
// 32 and the warp tile to divide the block tile (tiles.gemm_layout_problem). H100, 128 x 128 x 32
// / 8 x 8, NR 1: A k-major 44.4 -> 47.0 TFLOP/s with WL 8; row-major A (KR 0) 43.2 either way.
layout(constant_id = 17) const uint WL = 0;
// XS = 1: an operand stored k-contiguous in global memory and transposed to k-major on the way
// into shared memory (A stored [M,K] without KR, B stored [N,K]) is loaded by runs of 16
// consecutive rows per k granule instead of whole rows: a warp's scalar stores of one k then hit
// 16 consecutive words of two k rows 16 banks apart (BM + 4 = 4 mod 32): no bank conflicts,
// where whole rows put 4 rows of 8 granules on 8 banks (4-way). Each row still reads one
// 32-byte sector per two lanes. Ignored when BM (BN for B) is not a multiple of 16. Slower on an
// H100 wherever it applies (4096^3, 128 x 128 x 32 with KR 1: 40.4 -> 36.9; B stored [N,K]:
// 39.1 -> 32.8), even where it changes only the loads (with KR): 16 rows a warp instruction.
layout(constant_id = 18) const uint XS = 0;
// CT = 1: compute C^T = op(B)^T op(A)^T, a (N x M) product whose operands are the launch's B and
// A, and store it transposed. Row-major A and B (NN) become A' = B stored k-major and B' = A
// stored [N', K]: the transposition moves from A's shared stores to B's. It first looked faster
// (4096^3: 42.2 TFLOP/s against 40.4), but that was the row-of-ones test leaving A's loads (NR):
// with NR both run at 43.1-43.2, and the H100 table takes it only where it ties or wins by under
// 1 % (the weight gradient took it while its loads tested for the row of ones: 44.5 -> 45.0;
// with that row written into shared memory instead, see NR, WL 8 without CT gives 45.5). A
// thread's 4 x 4 sub-blocks transpose in registers, so C is still written as vec4s along its
// rows. TA, TB and VEC stay the launch's; the kernel's are derived below. A row of ones
// (ones_row) becomes a column of ones of B'.
layout(constant_id = 19) const uint CT = 0;
// NR = 1: the launch has no row of ones (ones_row 0; tune_gemm sets it from the launch), so the
// code that writes it into shared memory (put_ones) is compiled out. 0 (the default) is right for
// any launch. The loads never test for that row: they stop at the stored rows, and the workgroups
// whose tile holds it write it into the shared tile after each K step's stores (a branch uniform
// over the workgroup, behind one more barrier). Until session 13's H17, every granule load tested
// for it, which cost more than any layout choice: H100, 128 x 128 x 32 / 8 x 8 with WL 8, 4096^3
// NN 36.3 -> 43.2 TFLOP/s without it, A k-major 44.4 -> 47.0; the weight gradient with its row
// (8192 x 4096 x 4097, A k-major) 43.5 -> 45.5 with the shared write instead.
layout(constant_id = 20) const uint NR = 0;

// The push fields after those gemm_coopmat shares (registry: gemm's push list): k_splits, and
// act_grad (unused: AG) and ones_row for the fusions above.
#define GEMM_PUSH_EXTRA uint k_splits; uint act_grad; uint ones_row;
#include "gemm_head.glsl"

#ifdef GEMM_SECOND_OUTPUT
// Y[M,N] = act_YA(C) (YA: an ACT_* code, from the launch's copy_act), written beside C: a Linear
// followed by GELU keeps its pre-activation C for GELU's backward and gives the next layer GELU(C)
// from one epilogue, with no unary launch re-reading C. Not with split-K.
layout(constant_id = 21) const uint YA = 0;
layout(std430, set = 0, binding = 4) writeonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 4) writeonly buffer YBuf4 { vec4 Y4[]; };
#endif
#ifdef GEMM_RESIDUAL
// R[M,N], added to the finished C (after the activation): a residual block's x + f(x) written by
// the GEMM of f, with no binary launch re-reading both. R is another tensor, left as it is.
layout(std430, set = 0, binding = 4) readonly buffer RBuf { float R[]; };
layout(std430, set = 0, binding = 4) readonly buffer RBuf4 { vec4 R4[]; };
#endif

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
// Contiguous tile extent of each operand in global memory, and its granule width (4 when the
// rows are 16-byte aligned and the tile extent takes whole vec4s, else 1).
// The kernel's operands (see CT): A and B as stored, or op(B)^T and op(A)^T. TA1 / TB1: the
// kernel's A stored k-major, its B stored k-contiguous; VA / VB: their vec4 bits of VEC.
const uint CT1 = CT & 1u;
const uint TA1 = CT1 * (1u - (TB & 1u)) + (1u - CT1) * (TA & 1u);
const uint TB1 = CT1 * (1u - (TA & 1u)) + (1u - CT1) * (TB & 1u);
const uint VA = CT1 * ((VEC >> 1u) & 1u) + (1u - CT1) * (VEC & 1u);
const uint VB = CT1 * (VEC & 1u) + (1u - CT1) * ((VEC >> 1u) & 1u);
const uint A_ROW = TA1 * BM + (1u - TA1) * BK;
const uint B_ROW = TB1 * BK + (1u - TB1) * BN;
const uint GA = 1u + 3u * (VA & (1u - ((A_ROW | (A_ROW >> 1u)) & 1u)));
const uint GB = 1u + 3u * (VB & (1u - ((B_ROW | (B_ROW >> 1u)) & 1u)));
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
// The thread layout (see WL): invocations in groups of GSZ (a warp, or the whole slice when WL
// is 0), each group LMM x LNN lanes (m x n) over an (LMM * TM) x (LNN * TN) sub-tile, WPN groups
// along n. A thread's output row i is tile_row(rbase, i) = rbase + (i / SWM) * RSTEP + (i % SWM)
// * RSUB, its column group h starts at cbase + h * CSTEP. WL = 0 gives the block-wide layout.
const uint WT1 = uint(WL != 0u);
const uint WLS = WL + 1u - WT1;  // WL, or 1 (no division by zero when WL is 0)
const uint LNN = WT1 * WL + (1u - WT1) * WN;
const uint LMM = WT1 * (32u / WLS) + (1u - WT1) * WM;
const uint GSZ = WT1 * 32u + (1u - WT1) * NTS;
const uint WPN = BN / (LNN * TN);
// Rows interleaved across lanes (k-contiguous A, warp tiles; not under CT, whose transposed
// store wants a sub-block's 4 rows adjacent).
const uint RI1 = WT1 * AR * (1u - CT1);
const uint RSTEP = LMM * SWM;
const uint RSUB = RI1 * LMM + 1u - RI1;
const uint CSTEP = LNN * 4u;

// Word offset of (row, k) in the k-contiguous A tile: BK + 4 words per row.
uint ar_word(uint row, uint k) {
    return row * (BK + 4u) + k;
}

// (row, k) of granule l of a tile of `rows` rows stored k-contiguous, `per_row` granules of
// width g a row: whole rows in turn, or with XS runs of 16 rows per granule column.
uvec2 k_contiguous_slot(uint l, uint rows, uint per_row, uint g) {
    if (XS != 0u && rows % 16u == 0u) {
        return uvec2(l % 16u + (l / (16u * per_row)) * 16u, ((l / 16u) % per_row) * g);
    }
    return uvec2(l / per_row, (l % per_row) * g);
}

// (row along m, k) within the tile of A granule l; the granule runs along the contiguous dim.
uvec2 a_slot(uint l) {
    return TA1 == 0u ? k_contiguous_slot(l, BM, BK / GA, GA) : uvec2((l % (BM / GA)) * GA, l / (BM / GA));
}

// (column along n, k) within the tile of B granule l.
uvec2 b_slot(uint l) {
    return TB1 == 0u ? uvec2((l % (BN / GB)) * GB, l / (BN / GB)) : k_contiguous_slot(l, BN, BK / GB, GB);
}

// Granule l of the A tile whose K begins at kt (zeros outside the matrix or this K slice).
// Granules never straddle an edge: with GA == 4 the contiguous dimension is a multiple of 4.
// Under CT the kernel's A is the launch's B (binding 1), M' = N, and it has no row of ones.
vec4 load_a(uint l, uint m0, uint kt, uint k_end) {
    uvec2 s = a_slot(l);
    uint gm = m0 + s.x;
    uint gk = kt + s.y;
    vec4 v = vec4(0.0);
    const uint rows = CT1 != 0u ? pc.N : pc.M;
    // The stored rows of A: M, or M - 1 under a row of ones (loaded as zeros here: put_ones writes
    // it; tune_gemm vectorises A only when M - 1 is a multiple of 4).
    const uint stored = rows - min(pc.ones_row, 1u) * (1u - NR) * (1u - CT1);
    if (l < A_GRAN && gm < stored && gk < k_end) {
        uint idx = TA1 == 0u ? gm * pc.K + gk : gk * stored + gm;
        if (GA == 4u) {
            v = CT1 != 0u ? B4[idx >> 2u] : A4[idx >> 2u];
        } else {
            v.x = CT1 != 0u ? B[idx] : A[idx];
        }
    }
    return v;
}

// Under CT the kernel's B is the launch's A (binding 0), N' = M, and A's row of ones is its
// column N' - 1.
vec4 load_b(uint l, uint n0, uint kt, uint k_end) {
    uvec2 s = b_slot(l);
    uint gn = n0 + s.x;
    uint gk = kt + s.y;
    vec4 v = vec4(0.0);
    const uint cols = CT1 != 0u ? pc.M : pc.N;
    const uint stored = cols - min(pc.ones_row, 1u) * (1u - NR) * CT1;
    if (l < B_GRAN && gn < stored && gk < k_end) {
        uint idx = TB1 == 0u ? gk * stored + gn : gn * pc.K + gk;
        if (GB == 4u) {
            v = CT1 != 0u ? A4[idx >> 2u] : B4[idx >> 2u];
        } else {
            v.x = CT1 != 0u ? A[idx] : B[idx];
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
        } else if (TA1 != 0u) {
            As[base + (w >> 2u)] = v;  // along m: one aligned vec4
        } else {
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                uint wc = w + c * SA;
                As[base + (wc >> 2u)][wc & 3u] = v[c];
            }
        }
    }
}

// The row of ones (the kernel's A row M - 1, or its B column N - 1 under CT; see NR) into the
// shared tile at buffer offsets a_base / b_base; `local`: its row (column) within the tile. Every k
// of the tile: past K, B's zeros cancel it.
void put_ones(uint a_base, uint b_base, uint local, uint tid) {
    for (uint k = tid; k < BK; k += NT) {
        if (CT1 != 0u) {
            uint w = k * SB + local;
            Bs[b_base + (w >> 2u)][w & 3u] = 1.0;
        } else {
            uint w = AR == 1u ? ar_word(local, k) : k * SA + local;
            As[a_base + (w >> 2u)][w & 3u] = 1.0;
        }
    }
}

void put_b(uint base, uint l, vec4 v) {
    if (l < B_GRAN) {
        uvec2 s = b_slot(l);
        uint w = s.y * SB + s.x;
        if (GB == 1u) {
            Bs[base + (w >> 2u)][w & 3u] = v.x;
        } else if (TB1 == 0u) {
            Bs[base + (w >> 2u)] = v;  // along n: one aligned vec4
        } else {
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                uint wc = w + c * SB;
                Bs[base + (wc >> 2u)][wc & 3u] = v[c];
            }
        }
    }
}

// Column of C in the tile of a thread's column group h (4 columns from there); cbase: its first.
uint tile_col(uint cbase, uint h) {
    return cbase + h * CSTEP;
}

// Row of C in the tile of a thread's output row i; rbase: its first.
uint tile_row(uint rbase, uint i) {
    return rbase + (i / SWM) * RSTEP + (i % SWM) * RSUB;
}

// The epilogue of one output C[m, n..n+3] (vec4, VC) or C[m, n] (scalar, lane 0 of raw), as
// cpu_ops.gemm orders it: scale, the old C, the bias, the activation derivative, the activation.
// Split-K writes the raw sums into slice z of C viewed as [splits, M, N] instead.
void store_vec4(uint m, uint n, vec4 raw) {
    if (max(pc.k_splits, 1u) > 1u) {
        C4[((gl_WorkGroupID.z * pc.M + m) * pc.N + n) >> 2u] = raw;
        return;
    }
    uint o = (m * pc.N + n) >> 2u;
    vec4 v = raw * pc.alpha;
    if (pc.accumulate != 0u) {
        v += C4[o];
    }
    if (pc.has_bias != 0u) {
        v += bias4[n >> 2u];
    }
    if (AG != ACT_NONE) {
        vec4 d = bias4[o];
        v *= vec4(activation_derivative(d.x, AG, pc.slope), activation_derivative(d.y, AG, pc.slope),
                  activation_derivative(d.z, AG, pc.slope), activation_derivative(d.w, AG, pc.slope));
    }
    v = vec4(vk_activate(v.x, ACT, pc.slope), vk_activate(v.y, ACT, pc.slope),
             vk_activate(v.z, ACT, pc.slope), vk_activate(v.w, ACT, pc.slope));
#ifdef GEMM_RESIDUAL
    v = R4[o] + v;  // binary.comp's add, x + f(x)
#endif
    C4[o] = v;
#ifdef GEMM_SECOND_OUTPUT
    Y4[o] = vec4(vk_activate(v.x, YA, 0.0), vk_activate(v.y, YA, 0.0), vk_activate(v.z, YA, 0.0),
                 vk_activate(v.w, YA, 0.0));
#endif
}

void store_scalar(uint m, uint n, float raw) {
    if (max(pc.k_splits, 1u) > 1u) {
        C[(gl_WorkGroupID.z * pc.M + m) * pc.N + n] = raw;
        return;
    }
    float v = raw * pc.alpha;
    if (pc.accumulate != 0u) {
        v += C[m * pc.N + n];
    }
    if (pc.has_bias != 0u) {
        v += bias[n];
    }
    if (AG != ACT_NONE) {
        v *= activation_derivative(bias[m * pc.N + n], AG, pc.slope);
    }
    v = vk_activate(v, ACT, pc.slope);
#ifdef GEMM_RESIDUAL
    v = R[m * pc.N + n] + v;
#endif
    C[m * pc.N + n] = v;
#ifdef GEMM_SECOND_OUTPUT
    Y[m * pc.N + n] = vk_activate(v, YA, 0.0);
#endif
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint slice = tid / NTS;
    // The thread's place in its group (see WL): group (warp) index and lane.
    const uint warp = (tid % NTS) / GSZ;
    const uint lane = (tid % NTS) % GSZ;
    const uint rbase = (warp / WPN) * LMM * TM + (lane / LNN) * (RI1 + (1u - RI1) * SWM);
    const uint cbase = (warp % WPN) * LNN * TN + (lane % LNN) * 4u;
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
    // The kernel's M x N (N x M under CT).
    const uint M = CT1 != 0u ? pc.N : pc.M;
    const uint N = CT1 != 0u ? pc.M : pc.N;
    const uint K = pc.K;
    // Split-K: workgroup z sums only its slice of K and writes raw partial sums into slice z of
    // C viewed as [splits, M, N]; a splitk_epilogue launch then adds the slices and applies the
    // epilogue. It keeps a GPU busy when M x N has too few tiles (e.g. the logits of a classifier).
    const uint splits = max(pc.k_splits, 1u);
    const uint k_chunk = ((K + splits * BK - 1u) / (splits * BK)) * BK;
    const uint k_begin = gl_WorkGroupID.z * k_chunk;
    const uint k_end = min(K, k_begin + k_chunk);

    // acc[i * RGN + h]: output row i, columns tile_col(cbase, h) .. + 3.
    vec4 acc[TM * RGN];
    [[unroll]] for (uint i = 0u; i < TM * RGN; ++i) {
        acc[i] = vec4(0.0);
    }
    vec4 ra[A_LOADS];
    vec4 rb[B_LOADS];
    // Whether this tile holds the row of ones (uniform over the workgroup: see NR), and where.
    const uint ones_at = pc.M - 1u;  // the kernel's row M - 1, or under CT its column N' - 1
    const uint ones_from = CT1 != 0u ? n0 : m0;
    const uint ones_extent = CT1 != 0u ? BN : BM;
    const bool ones_tile = NR == 0u && pc.ones_row != 0u && ones_at >= ones_from
        && ones_at < ones_from + ones_extent;
    const uint ones_local = ones_at - ones_from;

    // The first K tile goes straight into buffer 0.
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        put_a(0u, tid + i * NT, load_a(tid + i * NT, m0, k_begin, k_end));
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        put_b(0u, tid + i * NT, load_b(tid + i * NT, n0, k_begin, k_end));
    }
    if (ones_tile) {
        barrier();  // after the zeros the loads left in its place
        put_ones(0u, 0u, ones_local, tid);
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
                    av[i] = As[a_base + (ar_word(tile_row(rbase, i), k4) >> 2u)];
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
                        uint w = kk * SA + tile_row(rbase, g * SWM);
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
                    b[h] = Bs[b_base + ((kk * SB + tile_col(cbase, h)) >> 2u)];
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
            if (ones_tile) {
                barrier();
                put_ones(stage * A_BUF, stage * B_BUF, ones_local, tid);
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
                        Red[(tile_row(rbase, i) * BN + tile_col(cbase, h)) >> 2u] = acc[i * RGN + h];
                    }
                }
            }
            barrier();
            if (slice == 0u) {
                [[unroll]] for (uint i = 0u; i < TM; ++i) {
                    [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                        acc[i * RGN + h] += Red[(tile_row(rbase, i) * BN + tile_col(cbase, h)) >> 2u];
                    }
                }
            }
            barrier();
        }
        if (slice != 0u) {
            return;
        }
    }

    // CT's epilogue: the kernel's row r is C's column and its column c is C's row. With 4 adjacent
    // kernel rows per sub-block (SWM 4, not interleaved) and C's rows in vec4s (VC), column c of a
    // 4 x 4 sub-block is one vec4 along a row of C; else one scalar per output.
    if (CT1 != 0u) {
        if (SWM == 4u && RSUB == 1u && VC) {
            [[unroll]] for (uint g = 0u; g < RGM; ++g) {
                const uint n = m0 + tile_row(rbase, g * 4u);
                [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                    [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                        const uint m = n0 + tile_col(cbase, h) + c;
                        const uint i = g * 4u * RGN + h;
                        vec4 raw = vec4(acc[i][c], acc[i + RGN][c], acc[i + 2u * RGN][c],
                                        acc[i + 3u * RGN][c]);
                        if (m < pc.M && n < pc.N) {
                            store_vec4(m, n, raw);
                        }
                    }
                }
            }
        } else {
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                const uint n = m0 + tile_row(rbase, i);
                [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                    [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                        const uint m = n0 + tile_col(cbase, h) + c;
                        if (m < pc.M && n < pc.N) {
                            store_scalar(m, n, acc[i * RGN + h][c]);
                        }
                    }
                }
            }
        }
        return;
    }

    // No `continue` inside these unrolled loops: a loop the compiler cannot unroll indexes acc
    // dynamically.
    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        const uint m = m0 + tile_row(rbase, i);
        [[unroll]] for (uint h = 0u; h < RGN; ++h) {
            const uint nc = n0 + tile_col(cbase, h);
            const vec4 raw = acc[i * RGN + h];
            if (m < M && VC && nc < N) {
                // N % 4 == 0 and every column group starts at a multiple of 4: wholly in or out.
                store_vec4(m, nc, raw);
            } else if (m < M && !VC) {
                [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                    if (nc + c < N) {
                        store_scalar(m, nc + c, raw[c]);
                    }
                }
            }
        }
    }
}
