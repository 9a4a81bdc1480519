// The tensor-core main loop of the implicit-GEMM convolutions (conv2d_gemm_coopmat*.comp): the
// same C[M,N] = A[M,Kd] @ B[Kd,N] as conv_gemm_body.glsl, from the same including-shader
// functions (a_row/a_idx/a_step/a_get, b_col/b_idx/b_step/b_get, store_c, A_MFAST, B_NFAST: see
// that file's header), but each gathered element is rounded to float16 (packHalf2x16, two at a
// time) into shared memory and the tile is multiplied by GL_KHR_cooperative_matrix 16x16x16
// multiply-adds into fp32 accumulators. Precision is gemm_coopmat's: about 1e-3 relative error
// from the input rounding, magnitudes above 65504 overflow.
//
// Tiles: a workgroup computes BM x BN of C with (BM/WM)*(BN/WN) subgroups of SG invocations, each
// a WM x WN warp tile of (WM/16)*(WN/16) accumulators. A thread gathers pairs of neighbours along
// the operand's walking direction (m for an m-fast A, else k; B always along k) and stores each
// pair as one 32-bit word, so shared memory keeps that direction contiguous (rows padded by 8
// halves against bank conflicts) and the fragments are read row- or column-major to match. The
// tile rules (shaders/conv_coopmat_tiles.py checks them): NT is a multiple of the pairs in a
// shared row and divides the pairs of a tile, so a thread's pair position in its row is the same
// for every load and its rows (or reduction indices) are decomposed once, as in the fp32 body.
// The next K tile is gathered into registers while the current one is multiplied. Split-K as in
// the fp32 body: workgroup z sums its slice of K and hands z to store_c.
//
// Epilogue: each subgroup stores one accumulator at a time column-major into its own staging
// (the tile memory, reused), and its invocations call store_c element by element, neighbouring
// invocations along m (the contiguous direction of the NCHW outputs).
#ifndef VKFLOW_CONV_GEMM_COOPMAT_BODY_GLSL
#define VKFLOW_CONV_GEMM_COOPMAT_BODY_GLSL

#if B_NFAST
#error "the tensor-core main loop gathers B along k only"
#endif

const uint T = 16;  // coopmat edge
const uint FM = WM / T;
const uint FN = WN / T;
const uint WARPS_M = BM / WM;
const uint WARPS_N = BN / WN;
const uint NT = WARPS_M * WARPS_N * SG;
const uint PAD = 8;  // halves of padding per shared row
const uint BK2 = BK / 2u;
#if A_MFAST
const uint A_FAST = BM;  // shared A: k rows of m
#else
const uint A_FAST = BK;  // shared A: m rows of k
#endif
const uint A_PAIRS = A_FAST / 2u;            // pairs (words) of data per shared row of A
const uint A_STRIDE = (A_FAST + PAD) / 2u;   // words per shared row of A
const uint A_WORDS = (BM + BK - A_FAST) * A_STRIDE;
const uint B_STRIDE = (BK + PAD) / 2u;       // shared B: n rows of k
const uint B_WORDS = BN * B_STRIDE;
const uint A_LOADS = BM * BK2 / NT;          // pairs per thread per tile
const uint B_LOADS = BN * BK2 / NT;
const uint A_D = NT / A_PAIRS;               // shared rows between a thread's loads
const uint B_D = NT / BK2;
const uint ST_STRIDE = T + 4u;               // epilogue staging: 16 columns of 16 (+4) floats
const uint ST_WORDS = T * ST_STRIDE;
const uint MAIN_WORDS = A_WORDS + B_WORDS;
const uint EPI_WORDS = WARPS_M * WARPS_N * ST_WORDS;
const uint SMEM_WORDS = MAIN_WORDS > EPI_WORDS ? MAIN_WORDS : EPI_WORDS;

shared uint smem[SMEM_WORDS];

coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator> acc[FM * FN];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint warp = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint wm = warp % WARPS_M;
    const uint wn = warp / WARPS_M;
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint M = pc_M();
    const uint N = pc_N();
    const uint K = pc_K();
    const uint splits = max(pc.k_splits, 1u);
    const uint k_chunk = ((K + splits * BK - 1u) / (splits * BK)) * BK;
    const uint k_begin = gl_WorkGroupID.z * k_chunk;
    const uint k_end = min(K, k_begin + k_chunk);

    // This thread's pairs: the same place in every shared row it fills, rows A_D (B_D) apart.
    const uint a_pair = tid % A_PAIRS;
    const uint a_row0 = tid / A_PAIRS;
    const uint b_pair = tid % BK2;
    const uint b_row0 = tid / BK2;
#if A_MFAST
    // Two rows of A (m, m + 1) for all loads; one reduction index walks the loads' k offsets.
    const uint am = m0 + 2u * a_pair;
    const bool a_in0 = am < M;
    const bool a_in1 = am + 1u < M;
    const ARow ar0 = a_row(am);
    const ARow ar1 = a_row(am + 1u);
    AIdx ai = a_idx(k_begin + a_row0);
    const AIdx a_walk = a_idx(A_D);
#else
    // Two reduction indices (k, k + 1) for all loads, stepped by BK per tile; a row per load.
    const uint ak = 2u * a_pair;
    ARow ar[A_LOADS];
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        ar[i] = a_row(m0 + a_row0 + i * A_D);
    }
    AIdx ai0 = a_idx(k_begin + ak);
    AIdx ai1 = a_idx(k_begin + ak + 1u);
    const AIdx a_tile = a_idx(BK);
#endif
    const uint bk = 2u * b_pair;
    BCol bc[B_LOADS];
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        bc[i] = b_col(n0 + b_row0 + i * B_D);
    }
    BIdx bi0 = b_idx(k_begin + bk);
    BIdx bi1 = b_idx(k_begin + bk + 1u);
    const BIdx b_tile = b_idx(BK);

    uint ra[A_LOADS];
    uint rb[B_LOADS];
    [[unroll]] for (uint i = 0u; i < FM * FN; ++i) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator>(0.0);
    }
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseA> fa[FM];
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseB> fb[FN];

    for (uint k0 = k_begin; k0 < k_end + BK; k0 += BK) {
        // Gather tile k0 into registers (the first iteration), while tile k0 - BK is multiplied.
        const bool gather = k0 < k_end;
        if (gather) {
#if A_MFAST
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                const bool kin = k0 + a_row0 + i * A_D < k_end;
                float v0 = (kin && a_in0) ? a_get(ar0, ai) : 0.0;
                float v1 = (kin && a_in1) ? a_get(ar1, ai) : 0.0;
                ra[i] = packHalf2x16(vec2(v0, v1));
                a_step(ai, a_walk);
            }
#else
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                const bool m_in = m0 + a_row0 + i * A_D < M;
                float v0 = (m_in && k0 + ak < k_end) ? a_get(ar[i], ai0) : 0.0;
                float v1 = (m_in && k0 + ak + 1u < k_end) ? a_get(ar[i], ai1) : 0.0;
                ra[i] = packHalf2x16(vec2(v0, v1));
            }
            a_step(ai0, a_tile);
            a_step(ai1, a_tile);
#endif
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                const bool nin = n0 + b_row0 + i * B_D < N;
                float v0 = (nin && k0 + bk < k_end) ? b_get(bc[i], bi0) : 0.0;
                float v1 = (nin && k0 + bk + 1u < k_end) ? b_get(bc[i], bi1) : 0.0;
                rb[i] = packHalf2x16(vec2(v0, v1));
            }
            b_step(bi0, b_tile);
            b_step(bi1, b_tile);
        }
        if (k0 > k_begin) {
            [[unroll]] for (uint kk = 0u; kk < BK; kk += T) {
                [[unroll]] for (uint i = 0u; i < FM; ++i) {
#if A_MFAST
                    coopMatLoad(fa[i], smem, kk * A_STRIDE + (wm * WM + i * T) / 2u, A_STRIDE,
                                gl_CooperativeMatrixLayoutColumnMajor);
#else
                    coopMatLoad(fa[i], smem, (wm * WM + i * T) * A_STRIDE + kk / 2u, A_STRIDE,
                                gl_CooperativeMatrixLayoutRowMajor);
#endif
                }
                [[unroll]] for (uint j = 0u; j < FN; ++j) {
                    coopMatLoad(fb[j], smem, A_WORDS + (wn * WN + j * T) * B_STRIDE + kk / 2u, B_STRIDE,
                                gl_CooperativeMatrixLayoutColumnMajor);
                }
                [[unroll]] for (uint i = 0u; i < FM; ++i) {
                    [[unroll]] for (uint j = 0u; j < FN; ++j) {
                        acc[i * FN + j] = coopMatMulAdd(fa[i], fb[j], acc[i * FN + j]);
                    }
                }
            }
            barrier();  // one buffer: everyone has read it before it is overwritten
        }
        if (gather) {
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                smem[(a_row0 + i * A_D) * A_STRIDE + a_pair] = ra[i];
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                smem[A_WORDS + (b_row0 + i * B_D) * B_STRIDE + b_pair] = rb[i];
            }
            barrier();
        }
    }

    const uint stage = warp * ST_WORDS;
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            coopMatStore(acc[i * FN + j], smem, stage, ST_STRIDE, gl_CooperativeMatrixLayoutColumnMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint e = lane; e < T * T; e += SG) {
                const uint m = m0 + wm * WM + i * T + e % T;
                const uint n = n0 + wn * WN + j * T + e / T;
                if (m < M && n < N) {
                    store_c(m, n, gl_WorkGroupID.z, uintBitsToFloat(smem[stage + (e / T) * ST_STRIDE + e % T]));
                }
            }
            subgroupBarrier();
        }
    }
}

#endif
