// C[M,N] = act(alpha * op(A) @ op(B) + (accumulate ? C : 0) + bias[N]) on tensor cores: the op,
// bindings and push constants of gemm.comp, with A, B, bias and C fp32 row-major buffers.
// trans_a: A is stored [K,M]; trans_b: B is stored [N,K]. Any M, N, K.
//
// Precision: the mixed-precision fast path. Each element of A and B is rounded to float16 (round
// to nearest even on the devices tested) as it enters shared memory; products are summed in
// fp32 by GL_KHR_cooperative_matrix 16x16x16 fp16 -> fp32 multiply-adds, and the epilogue is
// fp32. Against fp32 inputs the relative error is about 1e-3 (the fp16 input rounding); against
// the same product of fp16-rounded inputs only fp32 accumulation error remains. Magnitudes above
// 65504 overflow to infinity. (glslang 13.1 has no GL_EXT_bfloat16, so there is no bf16 variant.)
//
// Tiling: a workgroup computes a BM x BN tile of C with (BM/WM)*(BN/WN) subgroups of SG
// invocations (SG must be the device's subgroup size: 32 on NVIDIA), each owning a WM x WN warp
// tile held as (WM/16)*(WN/16) fp32 accumulators. A and B stream through shared memory BK at a
// time, double-buffered: while the tensor cores multiply one stage, every invocation holds the
// next K slab in registers as fp32 (two vec4 per granule of 8 elements; scalar loads with bounds
// checks only in edge tiles or when a row is not 16-byte aligned), then converts and stores it
// into the other stage, so one barrier per slab suffices. Each operand keeps its global
// orientation in shared memory (contiguous dimension contiguous, 8 halves of padding per row so
// the rows of a fragment fall in distinct banks); a transposed operand is read with a
// column-major coopMatLoad rather than transposed on the way in. Out-of-range rows, columns and
// K are zero-filled in shared memory.
//
// Epilogue: after the last slab the tile memory is reused as per-subgroup fp32 staging; each
// subgroup stores one 16-row strip of its accumulators, then its invocations apply alpha, the
// old C, the bias and the activation per element and write C with bounds checks (vec4 where N
// is a multiple of 4).
//
// Workgroups are visited in groups of GM tile rows (the x/y grid is remapped), so tiles that run
// at the same time share A and B panels in L2.
//
// Speed (H200, 4096^3, default tiles 128x128x32, 4 subgroups of 64x64): ~178 TFLOP/s. Every
// loop over tiles is [[unroll]]ed and the K loop is instantiated per transposition pair (see
// mainloop): without the first the accumulators live in local memory (~32 TFLOP/s), without the
// second ~116. What remains is the fp32 staging: it doubles global traffic and register use
// against fp16 inputs, which caps the tile at 128x128 under 48 KiB of shared memory and two
// workgroups per SM; the multiply-adds alone run at ~515 TFLOP/s.
#version 450
#extension GL_GOOGLE_include_directive : require
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
    uint trans_a;
    uint trans_b;
    uint has_bias;
    uint act;
    uint accumulate;
    float alpha;
    float slope;
} p;

#include "common_gemm_act.glsl"

const uint T = 16;                      // coopmat edge
const uint FM = WM / T;                 // accumulators per warp tile along m
const uint FN = WN / T;                 // and along n
const uint WARPS_M = BM / WM;
const uint WARPS_N = BN / WN;
const uint NT = WARPS_M * WARPS_N * SG; // invocations per workgroup
const uint PAD = 8;                     // halves of padding per shared row (one uvec4)

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
const uint MAIN_VECS = 2 * STAGE;
const uint EPI_VECS = WARPS_M * WARPS_N * ST_VECS;
const uint SMEM_VECS = MAIN_VECS > EPI_VECS ? MAIN_VECS : EPI_VECS;

// Granules of 8 consecutive elements per operand tile, and per invocation.
const uint A_GRANULES = BM * BK / 8;
const uint B_GRANULES = BK * BN / 8;
const uint A_LOADS = (A_GRANULES + NT - 1) / NT;
const uint B_LOADS = (B_GRANULES + NT - 1) / NT;

// fp16 tiles as uvec4 words (8 halves): coopMatLoad counts offset and stride in these units, and
// 16-byte elements keep every row start aligned for wide shared loads. Reused as fp32 staging.
shared uvec4 smem[SMEM_VECS];

// Loads elements (r, c..c+7) of a stored row-major matrix with R rows of L; zeros outside it.
// vec: rows start 16-byte aligned (L % 4 == 0), so a granule inside the matrix is two vec4 loads.
void load8(const bool is_a, bool vec, uint r, uint c, uint R, uint L, out vec4 lo, out vec4 hi) {
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
        }
    }
    lo = vec4(e[0], e[1], e[2], e[3]);
    hi = vec4(e[4], e[5], e[6], e[7]);
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
    const uint M = p.M;
    const uint N = p.N;
    const uint K = p.K;

    // Each operand is a stored row-major matrix of ar rows by al (its contiguous dimension),
    // streamed as tiles of atc columns; K advances along its rows (transposed A, plain B) or
    // along its columns. The granules an invocation copies, and where they go in shared memory,
    // are fixed for the whole loop, so they are computed once.
    const uint ar = TA ? K : M;
    const uint al = TA ? M : K;
    const uint atc = TA ? BM : BK;
    const bool avec = (al % 4u) == 0u;
    const uint br = TB ? N : K;
    const uint bl = TB ? K : N;
    const uint btc = TB ? BK : BN;
    const bool bvec = (bl % 4u) == 0u;
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
    const bool a_inside = avec && m0 + BM <= M;
    const bool b_inside = bvec && n0 + BN <= N;
    const uint sa = TA ? BM + PAD : BK + PAD;  // shared strides in halves
    const uint sb = TB ? BK + PAD : BN + PAD;

    [[unroll]] for (uint i = 0u; i < FM * FN; ++i) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator>(0.0);
    }
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseA> fa[FM];
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseB> fb[FN];
    vec4 ra[2 * A_LOADS];
    vec4 rb[2 * B_LOADS];
    const uint slabs = (K + BK - 1u) / BK;

    for (uint s = 0u; s <= slabs; ++s) {
        // Slab s's global loads are issued here, land while slab s-1 multiplies, and are stored
        // after it; so iteration s multiplies stage (s-1)&1 and fills stage s&1.
        const uint k0 = s * BK;
        const bool load = s < slabs;
        if (load) {
            const uint akr = TA ? k0 : 0u;
            const uint akc = TA ? 0u : k0;
            const uint bkr = TB ? 0u : k0;
            const uint bkc = TB ? k0 : 0u;
            const bool k_inside = k0 + BK <= K;
            if (a_inside && k_inside) {
                [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                    if (A_GRANULES % NT == 0u || tid + i * NT < A_GRANULES) {
                        uint v = ((a_r[i] + akr) * al + a_c[i] + akc) / 4u;
                        ra[2 * i] = A4[v];
                        ra[2 * i + 1] = A4[v + 1u];
                    }
                }
            } else {
                [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                    if (A_GRANULES % NT == 0u || tid + i * NT < A_GRANULES) {
                        load8(true, avec, a_r[i] + akr, a_c[i] + akc, ar, al, ra[2 * i], ra[2 * i + 1]);
                    }
                }
            }
            if (b_inside && k_inside) {
                [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                    if (B_GRANULES % NT == 0u || tid + i * NT < B_GRANULES) {
                        uint v = ((b_r[i] + bkr) * bl + b_c[i] + bkc) / 4u;
                        rb[2 * i] = B4[v];
                        rb[2 * i + 1] = B4[v + 1u];
                    }
                }
            } else {
                [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                    if (B_GRANULES % NT == 0u || tid + i * NT < B_GRANULES) {
                        load8(false, bvec, b_r[i] + bkr, b_c[i] + bkc, br, bl, rb[2 * i], rb[2 * i + 1]);
                    }
                }
            }
        }

        if (s > 0u) {
            const uint cur = ((s - 1u) & 1u) * STAGE;
            [[unroll]] for (uint kk = 0u; kk < BK; kk += T) {
                [[unroll]] for (uint i = 0u; i < FM; ++i) {
                    if (TA) {
                        uint e = kk * sa + wm * WM + i * T;
                        coopMatLoad(fa[i], smem, cur + e / 8u, sa / 8u, gl_CooperativeMatrixLayoutColumnMajor);
                    } else {
                        uint e = (wm * WM + i * T) * sa + kk;
                        coopMatLoad(fa[i], smem, cur + e / 8u, sa / 8u, gl_CooperativeMatrixLayoutRowMajor);
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

        if (load) {
            const uint nxt = (s & 1u) * STAGE;
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                if (A_GRANULES % NT == 0u || tid + i * NT < A_GRANULES) {
                    smem[nxt + a_s[i]] = to_half8(ra[2 * i], ra[2 * i + 1]);
                }
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                if (B_GRANULES % NT == 0u || tid + i * NT < B_GRANULES) {
                    smem[nxt + b_s[i]] = to_half8(rb[2 * i], rb[2 * i + 1]);
                }
            }
        }
        barrier();
    }
}

void main() {
    const uint warp = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint M = p.M;
    const uint N = p.N;

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

    if (p.trans_a != 0u) {
        if (p.trans_b != 0u) {
            mainloop(true, true);
        } else {
            mainloop(true, false);
        }
    } else {
        if (p.trans_b != 0u) {
            mainloop(false, true);
        } else {
            mainloop(false, false);
        }
    }

    // Epilogue, one 16-row strip of the warp tile at a time through this subgroup's staging.
    const uint stage = warp * ST_VECS;
    const bool vec_c = (N % 4u) == 0u;
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
            // Same order as cpu_ops.gemm: scale, then the old C, then the bias, then act.
            vec4 v = uintBitsToFloat(smem[stage + r * ST_STRIDE + c / 4u]) * p.alpha;
            uint o = m * N + n;
            if (vec_c && n + 4u <= N) {
                if (p.accumulate != 0u) {
                    v += C4[o / 4u];
                }
                if (p.has_bias != 0u) {
                    v += bias4[n / 4u];
                }
                C4[o / 4u] = vec4(vk_activate(v.x, p.act, p.slope), vk_activate(v.y, p.act, p.slope),
                                  vk_activate(v.z, p.act, p.slope), vk_activate(v.w, p.act, p.slope));
            } else {
                for (uint e = 0u; e < 4u && n + e < N; ++e) {
                    float x = v[e];
                    if (p.accumulate != 0u) {
                        x += C[o + e];
                    }
                    if (p.has_bias != 0u) {
                        x += bias[n + e];
                    }
                    C[o + e] = vk_activate(x, p.act, p.slope);
                }
            }
        }
        subgroupBarrier();
    }
}
