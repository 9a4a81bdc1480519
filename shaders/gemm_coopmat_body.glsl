// gemm_coopmat.comp's body (see its header for the design): gemm_coopmat.comp includes it as it is,
// gemm_coopmat_copy.comp with GEMM_HALF_COPY defined, which adds binding 4 and has the epilogue
// write a float16 copy of C (or of act_HA(C)) there too (and with GEMM_HALF_ONLY as well, only the
// copy: gemm_coopmat_half.comp), and gemm_coopmat_residual.comp with
// GEMM_RESIDUAL, which adds binding 4 (R, read) to the finished C. Separate files rather than a
// specialisation constant because a binding the shader references must be in the pipeline's layout
// even where a constant folds the reference away, and gemm_coopmat's launches bind four buffers.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint BM = 128;
layout(constant_id = 4) const uint BN = 128;
layout(constant_id = 5) const uint BK = 32;
layout(constant_id = 6) const uint WM = 64;
layout(constant_id = 7) const uint WN = 64;
layout(constant_id = 8) const uint SG = 32;  // subgroup size; local_size_x = subgroups * SG
layout(constant_id = 9) const uint GM = 8;   // tile rows per L2 group
layout(constant_id = 10) const uint AH = 0;  // 1: A is float16 in memory, 0: float32
layout(constant_id = 11) const uint BH = 0;  // 1: B is float16 in memory, 0: float32
layout(constant_id = 12) const uint PD = 1;  // K slabs in flight in registers (>= 1)
layout(constant_id = 13) const uint NS = 2;  // shared stages: 2 (one barrier per slab) or 1 (two)
layout(constant_id = 14) const uint AD = 0;  // act_grad: times f'(D), D[M,N] bound as the bias

// gemm.comp's push fields after the shared ones, so that a plan can give either op the same
// launch: k_splits (split-K into a [splits, M, N] workspace) and ones_row (the bias gradient as
// op(A)'s extra row of ones). act_grad, gemm.comp's fused activation derivative, is read through
// its copy AD (the tune sets it), so the epilogue of a plain launch keeps no branch on it.
#define GEMM_PUSH_EXTRA uint k_splits; uint act_grad; uint ones_row;
#include "gemm_head.glsl"

#ifdef GEMM_HALF_COPY
#include "half_bits.glsl"
// C's float16 copy: words of two halves, written as pairs (uvec2, 4 halves) or single words.
layout(std430, set = 0, binding = 4) writeonly buffer HBuf { uint Hw[]; };
layout(std430, set = 0, binding = 4) writeonly buffer HBuf2 { uvec2 H2[]; };
// The copy's own activation (an ACT_* code, from the launch's copy_act): H = fp16(act_HA(C)), so
// a Linear followed by GELU writes its pre-activation C (GELU's backward reads it) and the next
// GEMM's fp16 operand GELU(C) from one epilogue, with no unary launch and no fp32 GELU(C).
layout(constant_id = 15) const uint HA = 0;
float copy_value(float x) {
    return vk_activate(x, HA, 0.0);
}
#ifdef HALF_RTE
// The device rounds float16 conversions to nearest even and keeps subnormals when asked (device
// fact fp16_exact_rounding; the .comp enables GL_EXT_spirv_intrinsics): half_bits's rounding, bit
// for bit, in one conversion a pair, but a NaN's payload is the hardware's. Keeping numpy's NaN
// payload (half_bits for NaNs) cost the fc1 copy 145 us against 121 on an H100 (session 15).
spirv_execution_mode(extensions = ["SPV_KHR_float_controls"], capabilities = [4467], 4462, 16);
spirv_execution_mode(extensions = ["SPV_KHR_float_controls"], capabilities = [4464], 4459, 16);
uint copy_pair(float lo, float hi) {
    return packFloat2x16(f16vec2(copy_value(lo), copy_value(hi)));
}
#else
uint copy_pair(float lo, float hi) {
    return half_pair(copy_value(lo), copy_value(hi));
}
#endif
#endif
#ifdef GEMM_RESIDUAL
// R[M,N] (fp32), added to the finished C (after the activation): a residual block's x + f(x)
// written by the GEMM of f, with no binary launch re-reading both; R is left as it is.
layout(std430, set = 0, binding = 4) readonly buffer RBuf { float R[]; };
layout(std430, set = 0, binding = 4) readonly buffer RBuf4 { vec4 R4[]; };
#endif

// Each operand buffer is seen as fp32 (scalars and vec4, from gemm_head.glsl) and as fp16 (32-bit
// words holding two halves, the lower index in the low bits, and uvec4 granules of 8 halves);
// AH/BH pick the view.
layout(std430, set = 0, binding = 0) readonly buffer ABufW { uint Aw[]; };
layout(std430, set = 0, binding = 0) readonly buffer ABufH { uvec4 Ah8[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBufW { uint Bw[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBufH { uvec4 Bh8[]; };

const uint T = 16;                      // coopmat edge
const uint FM = WM / T;                 // accumulators per warp tile along m
const uint FN = WN / T;                 // and along n
const uint WARPS_M = BM / WM;
const uint WARPS_N = BN / WN;
const uint NT = WARPS_M * WARPS_N * SG; // invocations per workgroup
const uint PAD = 8;                     // halves of padding per shared row (one uvec4)
const uint AH1 = AH & 1u;
const uint BH1 = BH & 1u;
const uint NS1 = (NS - 1u) & 1u;        // stage index mask: 1 with two stages, 0 with one
// Elements per 16-byte global granule: a row starts 16-byte aligned when its length is a multiple.
const uint AG = 4u + 4u * AH1;
const uint BG = 4u + 4u * BH1;

// Shared rows in halves for each orientation: [BM][BK] / [BK][BM] for A, [BK][BN] / [BN][BK] for B.
const uint A_ROWS_N = BM * (BK + PAD);  // A stored [M,K]: m rows of k
const uint A_ROWS_T = BK * (BM + PAD);  // A stored [K,M]: k rows of m
const uint B_ROWS_N = BK * (BN + PAD);  // B stored [K,N]: k rows of n
const uint B_ROWS_T = BN * (BK + PAD);  // B stored [N,K]: n rows of k
// Tile sizes in uvec4 (8 halves), the larger orientation of each.
const uint A_VECS = (A_ROWS_N > A_ROWS_T ? A_ROWS_N : A_ROWS_T) / 8;
const uint B_VECS = (B_ROWS_N > B_ROWS_T ? B_ROWS_N : B_ROWS_T) / 8;
const uint STAGE = A_VECS + B_VECS;
// Epilogue staging: one 16 x WN fp32 strip per subgroup, 4 floats of padding per row.
const uint ST_STRIDE = (WN + 4) / 4;    // in uvec4
const uint ST_VECS = T * ST_STRIDE;
const uint MAIN_VECS = (NS1 + 1u) * STAGE;
const uint EPI_VECS = WARPS_M * WARPS_N * ST_VECS;
const uint SMEM_VECS = MAIN_VECS > EPI_VECS ? MAIN_VECS : EPI_VECS;

// Granules of 8 consecutive elements per operand tile, and per invocation.
const uint A_GRANULES = BM * BK / 8;
const uint B_GRANULES = BK * BN / 8;
const uint A_LOADS = (A_GRANULES + NT - 1) / NT;
const uint B_LOADS = (B_GRANULES + NT - 1) / NT;
// Staging registers: PD slots of each operand's granules, as two vec4 per fp32 granule or one
// uvec4 per fp16 granule; the array of the kind an operand does not use keeps one element.
const uint RA32 = PD * 2u * A_LOADS * (1u - AH1) + AH1;
const uint RA16 = PD * A_LOADS * AH1 + (1u - AH1);
const uint RB32 = PD * 2u * B_LOADS * (1u - BH1) + BH1;
const uint RB16 = PD * B_LOADS * BH1 + (1u - BH1);

// fp16 tiles as uvec4 words (8 halves): coopMatLoad counts offset and stride in these units, and
// 16-byte elements keep every row start aligned for wide shared loads. Reused as fp32 staging.
shared uvec4 smem[SMEM_VECS];

// Whether element (r, c) just outside a stored matrix of R rows of L is one of op(A)'s ones
// (ones_row): the extra column L of a transposed A (stored [K, M-1]) or the extra row R of a plain
// A (stored [M-1, K]).
bool is_one(uint ones, uint r, uint c, uint R, uint L) {
    return (ones == 1u && c == L && r < R) || (ones == 2u && r == R && c < L);
}

// Loads elements (r, c..c+7) of a stored row-major fp32 matrix with R rows of L; zeros outside it
// (ones where is_one says so). vec: rows start 16-byte aligned (L % 4 == 0), so a granule inside the
// matrix is two vec4 loads.
void load8(const bool is_a, bool vec, uint r, uint c, uint R, uint L, uint ones, out vec4 lo, out vec4 hi) {
    uint base = r * L + c;
    if (vec && r < R && c + 8u <= L) {
        uint v = base / 4u;
        lo = is_a ? A4[v] : B4[v];
        hi = is_a ? A4[v + 1u] : B4[v + 1u];
        return;
    }
    float e[8];
    [[unroll]] for (uint i = 0u; i < 8u; ++i) {
        e[i] = 0.0;
        if (r < R && c + i < L) {
            e[i] = is_a ? A[base + i] : B[base + i];
        } else if (is_one(ones, r, c + i, R, L)) {
            e[i] = 1.0;
        }
    }
    lo = vec4(e[0], e[1], e[2], e[3]);
    hi = vec4(e[4], e[5], e[6], e[7]);
}

// The same for a stored fp16 matrix, as 8 packed halves (the bits as stored; zero halves outside).
// vec: rows start 16-byte aligned (L % 8 == 0), so a granule inside the matrix is one uvec4 load;
// otherwise each half is cut out of its 32-bit word (in range: the buffer is whole words).
uvec4 load8h(const bool is_a, bool vec, uint r, uint c, uint R, uint L, uint ones) {
    uint base = r * L + c;
    if (vec && r < R && c + 8u <= L) {
        return is_a ? Ah8[base / 8u] : Bh8[base / 8u];
    }
    uint h[8];
    [[unroll]] for (uint i = 0u; i < 8u; ++i) {
        h[i] = 0u;
        if (r < R && c + i < L) {
            uint e = base + i;
            uint w = is_a ? Aw[e / 2u] : Bw[e / 2u];
            h[i] = (w >> ((e & 1u) * 16u)) & 0xFFFFu;
        } else if (is_one(ones, r, c + i, R, L)) {
            h[i] = 0x3C00u;  // 1.0 in fp16
        }
    }
    return uvec4(h[0] | (h[1] << 16u), h[2] | (h[3] << 16u), h[4] | (h[5] << 16u), h[6] | (h[7] << 16u));
}

uvec4 to_half8(vec4 lo, vec4 hi) {
    return uvec4(packHalf2x16(lo.xy), packHalf2x16(lo.zw), packHalf2x16(hi.xy), packHalf2x16(hi.zw));
}

coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator> acc[FM * FN];
uint m0, n0, wm, wn;

// The K loop for one pair of transposition flags. It is called with constant flags, so once the
// driver inlines it every coopMatLoad has a fixed layout and the loop body is one basic block
// the compiler can schedule freely (a uniform branch between fragment loads and multiply-adds
// inside the loop cost about a third of the throughput).
void mainloop(const bool TA, const bool TB) {
    const uint tid = gl_LocalInvocationID.x;
    const uint M = pc.M;
    const uint N = pc.N;
    const uint K = pc.K;

    // Each operand is a stored row-major matrix of ar rows by al (its contiguous dimension),
    // streamed as tiles of atc columns; K advances along its rows (transposed A, plain B) or
    // along its columns. The granules an invocation copies, and where they go in shared memory,
    // are fixed for the whole loop, so they are computed once.
    // ones_row: op(A)'s last row is ones, and A stores only the Ma rows before it.
    const uint one = min(pc.ones_row, 1u);
    const uint Ma = M - one;
    const uint ones = one * (TA ? 1u : 2u);  // is_one's code
    const uint ar = TA ? K : Ma;
    const uint al = TA ? Ma : K;
    const uint atc = TA ? BM : BK;
    const bool avec = (al % AG) == 0u;
    const uint br = TB ? N : K;
    const uint bl = TB ? K : N;
    const uint btc = TB ? BK : BN;
    const bool bvec = (bl % BG) == 0u;
    uint a_r[A_LOADS], a_c[A_LOADS], a_s[A_LOADS];
    uint b_r[B_LOADS], b_c[B_LOADS], b_s[B_LOADS];
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        uint g = tid + i * NT;
        uint row = g / (atc / 8u);
        uint col = (g % (atc / 8u)) * 8u;
        a_r[i] = (TA ? 0u : m0) + row;
        a_c[i] = (TA ? m0 : 0u) + col;
        a_s[i] = (row * (atc + PAD) + col) / 8u;
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        uint g = tid + i * NT;
        uint row = g / (btc / 8u);
        uint col = (g % (btc / 8u)) * 8u;
        b_r[i] = (TB ? n0 : 0u) + row;
        b_c[i] = (TB ? 0u : n0) + col;
        b_s[i] = A_VECS + (row * (btc + PAD) + col) / 8u;
    }
    // Whole tiles in range along m (n): with K in range too, a slab needs no bounds checks.
    const bool a_inside = avec && m0 + BM <= Ma;
    const bool b_inside = bvec && n0 + BN <= N;
    const uint sa = TA ? BM + PAD : BK + PAD;  // shared strides in halves
    const uint sb = TB ? BK + PAD : BN + PAD;

    [[unroll]] for (uint i = 0u; i < FM * FN; ++i) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator>(0.0);
    }
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseA> fa[FM];
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseB> fb[FN];
    vec4 ra[RA32];
    uvec4 rah[RA16];
    vec4 rb[RB32];
    uvec4 rbh[RB16];
    // Split-K (k_splits > 1): workgroup z multiplies only its slice of K, whole slabs of BK, so
    // every slab still ends at a multiple of BK or at K and the bounds checks stay those of K.
    const uint splits = max(pc.k_splits, 1u);
    const uint k_chunk = ((K + splits * BK - 1u) / (splits * BK)) * BK;
    const uint k_begin = min(K, gl_WorkGroupID.z * k_chunk);
    const uint slabs = (min(K, k_begin + k_chunk) - k_begin + BK - 1u) / BK;
    const uint steps = slabs + PD;

    // Iteration t issues the global loads of slab t into register slot t % PD, multiplies slab
    // t - PD from its shared stage, then stores slab t - PD + 1 (loaded PD - 1 iterations ago)
    // into the other stage; so a load has PD - 1 whole iterations and one slab of multiply-adds
    // to land. The loop is unrolled PD times so that every register slot index is a constant.
    for (uint s = 0u; s < steps; s += PD) {
        [[unroll]] for (uint u = 0u; u < PD; ++u) {
            const uint t = s + u;
            if (PD == 1u || t < steps) {
                if (t < slabs) {
                    const uint k0 = k_begin + t * BK;
                    const uint akr = TA ? k0 : 0u;
                    const uint akc = TA ? 0u : k0;
                    const uint bkr = TB ? 0u : k0;
                    const uint bkc = TB ? k0 : 0u;
                    const bool k_inside = k0 + BK <= K;
                    if (AH1 == 1u) {
                        if (a_inside && k_inside) {
                            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                                if (A_GRANULES % NT == 0u || tid + i * NT < A_GRANULES) {
                                    rah[u * A_LOADS + i] = Ah8[((a_r[i] + akr) * al + a_c[i] + akc) / 8u];
                                }
                            }
                        } else {
                            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                                if (A_GRANULES % NT == 0u || tid + i * NT < A_GRANULES) {
                                    rah[u * A_LOADS + i] =
                                        load8h(true, avec, a_r[i] + akr, a_c[i] + akc, ar, al, ones);
                                }
                            }
                        }
                    } else {
                        if (a_inside && k_inside) {
                            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                                if (A_GRANULES % NT == 0u || tid + i * NT < A_GRANULES) {
                                    uint v = ((a_r[i] + akr) * al + a_c[i] + akc) / 4u;
                                    ra[2u * (u * A_LOADS + i)] = A4[v];
                                    ra[2u * (u * A_LOADS + i) + 1u] = A4[v + 1u];
                                }
                            }
                        } else {
                            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                                if (A_GRANULES % NT == 0u || tid + i * NT < A_GRANULES) {
                                    load8(true, avec, a_r[i] + akr, a_c[i] + akc, ar, al, ones,
                                          ra[2u * (u * A_LOADS + i)], ra[2u * (u * A_LOADS + i) + 1u]);
                                }
                            }
                        }
                    }
                    if (BH1 == 1u) {
                        if (b_inside && k_inside) {
                            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                                if (B_GRANULES % NT == 0u || tid + i * NT < B_GRANULES) {
                                    rbh[u * B_LOADS + i] = Bh8[((b_r[i] + bkr) * bl + b_c[i] + bkc) / 8u];
                                }
                            }
                        } else {
                            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                                if (B_GRANULES % NT == 0u || tid + i * NT < B_GRANULES) {
                                    rbh[u * B_LOADS + i] =
                                        load8h(false, bvec, b_r[i] + bkr, b_c[i] + bkc, br, bl, 0u);
                                }
                            }
                        }
                    } else {
                        if (b_inside && k_inside) {
                            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                                if (B_GRANULES % NT == 0u || tid + i * NT < B_GRANULES) {
                                    uint v = ((b_r[i] + bkr) * bl + b_c[i] + bkc) / 4u;
                                    rb[2u * (u * B_LOADS + i)] = B4[v];
                                    rb[2u * (u * B_LOADS + i) + 1u] = B4[v + 1u];
                                }
                            }
                        } else {
                            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                                if (B_GRANULES % NT == 0u || tid + i * NT < B_GRANULES) {
                                    load8(false, bvec, b_r[i] + bkr, b_c[i] + bkc, br, bl, 0u,
                                          rb[2u * (u * B_LOADS + i)], rb[2u * (u * B_LOADS + i) + 1u]);
                                }
                            }
                        }
                    }
                }

                if (t >= PD) {
                    const uint cur = ((t - PD) & NS1) * STAGE;
                    [[unroll]] for (uint kk = 0u; kk < BK; kk += T) {
                        [[unroll]] for (uint i = 0u; i < FM; ++i) {
                            if (TA) {
                                uint e = kk * sa + wm * WM + i * T;
                                coopMatLoad(fa[i], smem, cur + e / 8u, sa / 8u,
                                            gl_CooperativeMatrixLayoutColumnMajor);
                            } else {
                                uint e = (wm * WM + i * T) * sa + kk;
                                coopMatLoad(fa[i], smem, cur + e / 8u, sa / 8u,
                                            gl_CooperativeMatrixLayoutRowMajor);
                            }
                        }
                        [[unroll]] for (uint j = 0u; j < FN; ++j) {
                            if (TB) {
                                uint e = (wn * WN + j * T) * sb + kk;
                                coopMatLoad(fb[j], smem, cur + A_VECS + e / 8u, sb / 8u,
                                            gl_CooperativeMatrixLayoutColumnMajor);
                            } else {
                                uint e = kk * sb + wn * WN + j * T;
                                coopMatLoad(fb[j], smem, cur + A_VECS + e / 8u, sb / 8u,
                                            gl_CooperativeMatrixLayoutRowMajor);
                            }
                        }
                        [[unroll]] for (uint i = 0u; i < FM; ++i) {
                            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                                acc[i * FN + j] = coopMatMulAdd(fa[i], fb[j], acc[i * FN + j]);
                            }
                        }
                    }
                }

                // Slab t + 1 - PD, from slot (t + 1) % PD. While t + 1 < PD the index wraps around
                // to beyond any slab count, so one comparison covers both ends.
                if (t + 1u - PD < slabs) {
                    if (NS1 == 0u) {
                        barrier();  // one stage: every subgroup has finished multiplying it
                    }
                    const uint nxt = ((t + 1u - PD) & NS1) * STAGE;
                    const uint w = (u + 1u) % PD;
                    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                        if (A_GRANULES % NT == 0u || tid + i * NT < A_GRANULES) {
                            if (AH1 == 1u) {
                                smem[nxt + a_s[i]] = rah[w * A_LOADS + i];
                            } else {
                                uint r = 2u * (w * A_LOADS + i);
                                smem[nxt + a_s[i]] = to_half8(ra[r], ra[r + 1u]);
                            }
                        }
                    }
                    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                        if (B_GRANULES % NT == 0u || tid + i * NT < B_GRANULES) {
                            if (BH1 == 1u) {
                                smem[nxt + b_s[i]] = rbh[w * B_LOADS + i];
                            } else {
                                uint r = 2u * (w * B_LOADS + i);
                                smem[nxt + b_s[i]] = to_half8(rb[r], rb[r + 1u]);
                            }
                        }
                    }
                }
                barrier();
            }
        }
    }
}

void main() {
    const uint warp = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint M = pc.M;
    const uint N = pc.N;

    // Grouped tile order: GM consecutive tile rows sweep the tile columns together.
    const uint tiles_n = gl_NumWorkGroups.x;
    const uint tiles_m = gl_NumWorkGroups.y;
    const uint pid = gl_WorkGroupID.y * tiles_n + gl_WorkGroupID.x;
    const uint group_tiles = GM * tiles_n;
    const uint first_m = (pid / group_tiles) * GM;
    const uint group_m = min(tiles_m - first_m, GM);
    m0 = (first_m + (pid % group_tiles) % group_m) * BM;
    n0 = ((pid % group_tiles) / group_m) * BN;
    wm = warp % WARPS_M;
    wn = warp / WARPS_M;

    if (pc.trans_a != 0u) {
        if (pc.trans_b != 0u) {
            mainloop(true, true);
        } else {
            mainloop(true, false);
        }
    } else {
        if (pc.trans_b != 0u) {
            mainloop(false, true);
        } else {
            mainloop(false, false);
        }
    }

    // Epilogue, one 16-row strip of the warp tile at a time through this subgroup's staging.
    const uint stage = warp * ST_VECS;
    const bool vec_c = (N % 4u) == 0u;
    // Split-K: raw sums into slice z of C seen as [splits, M, N]; splitk_epilogue finishes them.
    const bool raw = pc.k_splits > 1u;
    const uint slice = gl_WorkGroupID.z * M * N;
    const uint quads = T * WN / 4u;
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            coopMatStore(acc[i * FN + j], smem, stage + j * (T / 4u), ST_STRIDE,
                         gl_CooperativeMatrixLayoutRowMajor);
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        for (uint q = lane; q < quads; q += SG) {
            uint r = q / (WN / 4u);
            uint c = (q % (WN / 4u)) * 4u;
            uint m = m0 + wm * WM + i * T + r;
            uint n = n0 + wn * WN + c;
            if (m >= M || n >= N) {
                continue;
            }
            vec4 v = uintBitsToFloat(smem[stage + r * ST_STRIDE + c / 4u]);
            uint o = m * N + n;
            if (raw) {
                if (vec_c && n + 4u <= N) {
                    C4[(slice + o) / 4u] = v;
                } else {
                    for (uint e = 0u; e < 4u && n + e < N; ++e) {
                        C[slice + o + e] = v[e];
                    }
                }
                continue;
            }
            // Same order as cpu_ops.gemm: scale, then the old C, then the bias, then f'(D), then act.
            v *= pc.alpha;
            if (vec_c && n + 4u <= N) {
                if (pc.accumulate != 0u) {
                    v += C4[o / 4u];
                }
                if (pc.has_bias != 0u) {
                    v += bias4[n / 4u];
                }
                if (AD != ACT_NONE) {
                    vec4 d = bias4[o / 4u];
                    v *= vec4(activation_derivative(d.x, AD, pc.slope), activation_derivative(d.y, AD, pc.slope),
                              activation_derivative(d.z, AD, pc.slope), activation_derivative(d.w, AD, pc.slope));
                }
                v = vec4(vk_activate(v.x, pc.act, pc.slope), vk_activate(v.y, pc.act, pc.slope),
                         vk_activate(v.z, pc.act, pc.slope), vk_activate(v.w, pc.act, pc.slope));
#ifdef GEMM_RESIDUAL
                v = R4[o / 4u] + v;  // binary.comp's add, x + f(x)
#endif
#ifndef GEMM_HALF_ONLY
                C4[o / 4u] = v;
#endif
#ifdef GEMM_HALF_COPY
                H2[o / 4u] = uvec2(copy_pair(v.x, v.y), copy_pair(v.z, v.w));
#endif
            } else {
                for (uint e = 0u; e < 4u && n + e < N; ++e) {
                    float x = v[e];
                    if (pc.accumulate != 0u) {
                        x += C[o + e];
                    }
                    if (pc.has_bias != 0u) {
                        x += bias[n + e];
                    }
                    if (AD != ACT_NONE) {
                        x *= activation_derivative(bias[o + e], AD, pc.slope);
                    }
                    v[e] = vk_activate(x, pc.act, pc.slope);
#ifdef GEMM_RESIDUAL
                    v[e] = R[o + e] + v[e];
#endif
#ifndef GEMM_HALF_ONLY
                    C[o + e] = v[e];
#endif
                }
#ifdef GEMM_HALF_COPY
                // N is even and n a multiple of 4, so o is even and each word is this invocation's.
                for (uint e = 0u; e < 4u && n + e < N; e += 2u) {
                    Hw[(o + e) / 2u] = copy_pair(v[e], v[e + 1u]);
                }
#endif
            }
        }
        subgroupBarrier();
    }
}
