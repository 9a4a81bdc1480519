// The tiled main loop of the implicit-GEMM convolutions (conv2d_gemm.comp and its two backward
// shaders): C[M,N] = A[M,Kd] @ B[Kd,N] where A and B are never stored. The including shader
// defines the push block (through conv_gemm_head.glsl), store_c(m, n, z, value) (the epilogue and
// the NCHW scatter), the macros A_MFAST and B_NFAST (1 or 0: whether consecutive threads load
// along m (n) or along k, whichever walks memory contiguously for that operand, so global loads
// coalesce), and the element gathers, split so that the im2col index math is not redone per
// element (each element gathered cost several integer divisions, more than its multiply-adds):
//   ARow a_row(m): what a row m of A needs (its decomposition, e.g. (n, oh, ow)); once per thread.
//   AIdx a_idx(kk): the decomposition of a reduction index (e.g. (c, r, s)); once per thread, and
//       a_idx(BK) once as the step.
//   void a_step(inout AIdx t, AIdx d): t becomes the decomposition of kk + BK, given d = a_idx(BK)
//       (a mixed-radix add with carries: no division).
//   float a_get(ARow row, AIdx t): A[m, kk], zero outside the convolution.
// and likewise BCol b_col(n), BIdx b_idx(kk), b_step and b_get(BCol, BIdx) for B. Each thread
// loads the same (row, k offset) slots of every K tile, so its rows are decomposed once and its
// reduction indices walk forward by BK per tile.
//
// The tiles are gemm.comp's (see its header): one workgroup per BM x BN tile of C with
// (BM/TM)*(BN/TN) threads, each owning TM x TN outputs as 4 x 4 sub-blocks spread over the tile
// so the inner loop's vec4 reads of the k-major shared tiles are free of bank conflicts; the next
// K tile is gathered into registers while the current one is multiplied. Split-K (k_splits > 1):
// workgroup z sums only its slice of K and store_c receives z to write raw partial sums.
#ifndef VKFLOW_CONV_GEMM_BODY_GLSL
#define VKFLOW_CONV_GEMM_BODY_GLSL

const uint WM = BM / TM;  // threads along m
const uint WN = BN / TN;  // threads along n
const uint NT = WM * WN;  // threads per workgroup
const uint TM4 = uint(TM % 4u == 0u);
const uint SWM = TM4 * 4u + (1u - TM4) * TM;
const uint RGM = TM / SWM;
const uint RGN = TN / 4u;
const uint GSM = BM / RGM;
const uint GSN = BN / RGN;
const uint SA = BM + 4u;
const uint SB = BN + 4u;
const uint A_BUF = BK * SA / 4u;
const uint B_BUF = BK * SB / 4u;
const uint A_LOADS = (BM * BK + NT - 1u) / NT;
const uint B_LOADS = (BK * BN + NT - 1u) / NT;
// A thread's load l = tid + i * NT sits at the same row (column) for every i when its operand is
// m-fast (n-fast) and NT is a multiple of BM (BN), and at the same k offset when it is k-fast and
// NT is a multiple of BK: then one decomposition, slot 0's, serves all its loads (see main).
// (Chosen by the preprocessor: glslang mis-emits `&&` on specialisation constants.)
// An m-fast A with one row per thread (NT a multiple of BM) has its loads at k offsets s0 + i * D,
// D = NT / BM, and A_LOADS * D == BK: one reduction index walks them all, stepping by D after
// each load (A_WALK), rather than A_LOADS indices each stepping by BK (registers: up to 32 loads).
#if A_MFAST
const bool A_ONE_ROW = NT % BM == 0u;
const bool A_WALK = NT % BM + (BM * BK) % NT == 0u;  // (`&&` of spec constants mis-emits)
const bool A_ONE_IDX = A_WALK;
const bool A_TILE_STEP = !A_WALK;
#else
const bool A_ONE_ROW = false;
const bool A_WALK = false;
const bool A_ONE_IDX = NT % BK == 0u;
const bool A_TILE_STEP = true;
#endif
#if B_NFAST
const bool B_ONE_COL = NT % BN == 0u;
const bool B_ONE_IDX = false;
#else
const bool B_ONE_COL = false;
const bool B_ONE_IDX = NT % BK == 0u;
#endif
const bool A_ROWS = !A_ONE_ROW;  // whether each load has its own row
const bool A_IDXS = !A_ONE_IDX;
const bool B_COLS = !B_ONE_COL;
const bool B_IDXS = !B_ONE_IDX;

shared vec4 As[A_BUF];
shared vec4 Bs[B_BUF];

// (row along m, k) within the A tile of element l.
uvec2 a_slot(uint l) {
#if A_MFAST
    return uvec2(l % BM, l / BM);
#else
    return uvec2(l / BK, l % BK);
#endif
}

// (column along n, k) within the B tile of element l.
uvec2 b_slot(uint l) {
#if B_NFAST
    return uvec2(l % BN, l / BN);
#else
    return uvec2(l / BK, l % BK);
#endif
}

float load_a(uint l, uint m0, uint kt, uint k_end, ARow row, AIdx t) {
    uvec2 s = a_slot(l);
    return (l < BM * BK && m0 + s.x < pc_M() && kt + s.y < k_end) ? a_get(row, t) : 0.0;
}

float load_b(uint l, uint n0, uint kt, uint k_end, BCol col, BIdx t) {
    uvec2 s = b_slot(l);
    return (l < BK * BN && n0 + s.x < pc_N() && kt + s.y < k_end) ? b_get(col, t) : 0.0;
}

void put_a(uint l, float v) {
    if (l < BM * BK) {
        uvec2 s = a_slot(l);
        uint w = s.y * SA + s.x;
        As[w >> 2u][w & 3u] = v;
    }
}

void put_b(uint l, float v) {
    if (l < BK * BN) {
        uvec2 s = b_slot(l);
        uint w = s.y * SB + s.x;
        Bs[w >> 2u][w & 3u] = v;
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint tx = tid % WN;
    const uint ty = tid / WN;
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint K = pc_K();
    const uint splits = max(pc.k_splits, 1u);
    const uint k_chunk = ((K + splits * BK - 1u) / (splits * BK)) * BK;
    const uint k_begin = gl_WorkGroupID.z * k_chunk;
    const uint k_end = min(K, k_begin + k_chunk);

    vec4 acc[TM * RGN];
    [[unroll]] for (uint i = 0u; i < TM * RGN; ++i) {
        acc[i] = vec4(0.0);
    }
    float ra[A_LOADS];
    float rb[B_LOADS];

    // This thread's slots, the same in every K tile: their rows (columns) decomposed once, their
    // reduction indices decomposed at k_begin and then stepped by BK after each tile's loads.
    ARow arow[A_LOADS];
    AIdx aidx[A_LOADS];
    BCol bcol[B_LOADS];
    BIdx bidx[B_LOADS];
    const AIdx astep = a_idx(BK);
    const BIdx bstep = b_idx(BK);
    const AIdx awalk = a_idx(NT / BM);
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        if (A_ROWS || i == 0u) {
            arow[i] = a_row(m0 + a_slot(tid + i * NT).x);
        }
    }
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        if (A_IDXS || i == 0u) {
            aidx[i] = a_idx(k_begin + a_slot(tid + i * NT).y);
        }
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        if (B_COLS || i == 0u) {
            bcol[i] = b_col(n0 + b_slot(tid + i * NT).x);
        }
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        if (B_IDXS || i == 0u) {
            bidx[i] = b_idx(k_begin + b_slot(tid + i * NT).y);
        }
    }

    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        put_a(tid + i * NT, load_a(tid + i * NT, m0, k_begin, k_end, arow[A_ONE_ROW ? 0u : i],
                                   aidx[A_ONE_IDX ? 0u : i]));
        if (A_WALK) {
            a_step(aidx[0], awalk);
        }
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        put_b(tid + i * NT, load_b(tid + i * NT, n0, k_begin, k_end, bcol[B_ONE_COL ? 0u : i],
                                   bidx[B_ONE_IDX ? 0u : i]));
    }
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        if (A_TILE_STEP && (A_IDXS || i == 0u)) {
            a_step(aidx[i], astep);
        }
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        if (B_IDXS || i == 0u) {
            b_step(bidx[i], bstep);
        }
    }
    barrier();

    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        const uint k1 = k0 + BK;
        const bool more = k1 < k_end;
        if (more) {
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                ra[i] = load_a(tid + i * NT, m0, k1, k_end, arow[A_ONE_ROW ? 0u : i],
                               aidx[A_ONE_IDX ? 0u : i]);
                if (A_WALK) {
                    a_step(aidx[0], awalk);
                }
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                rb[i] = load_b(tid + i * NT, n0, k1, k_end, bcol[B_ONE_COL ? 0u : i],
                               bidx[B_ONE_IDX ? 0u : i]);
            }
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                if (A_TILE_STEP && (A_IDXS || i == 0u)) {
                    a_step(aidx[i], astep);
                }
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                if (B_IDXS || i == 0u) {
                    b_step(bidx[i], bstep);
                }
            }
        }
        [[unroll]] for (uint kk = 0u; kk < BK; ++kk) {
            float a[TM];
            [[unroll]] for (uint g = 0u; g < RGM; ++g) {
                uint w = kk * SA + g * GSM + ty * SWM;
                if (SWM == 4u) {
                    vec4 v = As[w >> 2u];
                    a[4u * g] = v.x;
                    a[4u * g + 1u] = v.y;
                    a[4u * g + 2u] = v.z;
                    a[4u * g + 3u] = v.w;
                } else {
                    [[unroll]] for (uint r = 0u; r < SWM; ++r) {
                        a[g * SWM + r] = As[(w + r) >> 2u][(w + r) & 3u];
                    }
                }
            }
            vec4 b[RGN];
            [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                b[h] = Bs[(kk * SB + h * GSN + tx * 4u) >> 2u];
            }
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                    acc[i * RGN + h] = fma(vec4(a[i]), b[h], acc[i * RGN + h]);
                }
            }
        }
        barrier();  // one buffer: everyone has read it before it is overwritten
        if (more) {
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                put_a(tid + i * NT, ra[i]);
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                put_b(tid + i * NT, rb[i]);
            }
        }
        barrier();
    }

    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        const uint m = m0 + (i / SWM) * GSM + ty * SWM + i % SWM;
        [[unroll]] for (uint h = 0u; h < RGN; ++h) {
            const uint nc = n0 + h * GSN + tx * 4u;
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                if (m < pc_M() && nc + c < pc_N()) {
                    store_c(m, nc + c, gl_WorkGroupID.z, acc[i * RGN + h][c]);
                }
            }
        }
    }
}

#endif
