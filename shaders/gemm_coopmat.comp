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
// invocations, each owning a WM x WN warp tile held as (WM/16)*(WN/16) fp32 accumulators. A and B
// stream through shared memory BK at a time, double-buffered: while the tensor cores multiply
// one stage, every invocation holds the next K slab of fp32 in registers (two vec4 per granule
// of 8 elements, scalar with bounds checks at edges or when a row is not 16-byte aligned), then
// converts and stores it into the other stage, so one barrier per K slab suffices. Each operand
// is kept in shared memory in its global orientation (the contiguous dimension contiguous, 8
// halves of padding per row so ldmatrix-style row reads hit distinct banks), and the transposed
// case is read with a column-major coopMatLoad instead of being transposed on the way in.
// Out-of-range rows, columns and K are zero-filled in shared memory.
//
// Epilogue: after the last slab the tile memory is reused as per-subgroup fp32 staging; each
// subgroup stores one 16-row strip of its accumulators, then its invocations apply alpha, the
// old C, the bias and the activation per element and write C with bounds checks (vec4 where N
// is a multiple of 4).
//
// Workgroups are visited in groups of GM tile rows (the x/y grid is remapped), so tiles that run
// at the same time share A and B panels in L2.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint BM = 128;
layout(constant_id = 4) const uint BN = 128;
layout(constant_id = 5) const uint BK = 32;
layout(constant_id = 6) const uint WM = 64;
layout(constant_id = 7) const uint WN = 32;
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

// How one operand streams: a stored row-major R x L matrix, read as TR x TC tiles.
struct Operand {
    uint R;          // stored rows
    uint L;          // stored row length (the contiguous dimension)
    uint TC;         // tile columns (TR = tile elements / TC)
    uint r0;         // first stored row of this workgroup's tiles (k slabs add to it if k_rows)
    uint c0;         // first stored column
    bool k_rows;     // K runs along stored rows (true) or along columns
    bool vec;        // rows are 16-byte aligned, so whole vec4 loads are legal
};

// Loads the 8 elements of granule g of the tile at slab k0; zeros outside the matrix.
void load_granule(const Operand o, const bool is_a, uint g, uint k0, out vec4 lo, out vec4 hi) {
    uint gpr = o.TC / 8;
    uint r = o.r0 + g / gpr + (o.k_rows ? k0 : 0u);
    uint c = o.c0 + (g % gpr) * 8u + (o.k_rows ? 0u : k0);
    uint base = r * o.L + c;
    if (o.vec && r < o.R && c + 8u <= o.L) {
        uint v = base / 4u;
        lo = is_a ? A4[v] : B4[v];
        hi = is_a ? A4[v + 1u] : B4[v + 1u];
        return;
    }
    float e[8];
    for (uint i = 0u; i < 8u; ++i) {
        e[i] = 0.0;
        if (r < o.R && c + i < o.L) {
            e[i] = is_a ? A[base + i] : B[base + i];
        }
    }
    lo = vec4(e[0], e[1], e[2], e[3]);
    hi = vec4(e[4], e[5], e[6], e[7]);
}

uvec4 to_half8(vec4 lo, vec4 hi) {
    return uvec4(packHalf2x16(lo.xy), packHalf2x16(lo.zw), packHalf2x16(hi.xy), packHalf2x16(hi.zw));
}

// Shared index (uvec4) of granule g: tile rows of TC halves plus PAD.
uint granule_slot(uint tc, uint g) {
    uint gpr = tc / 8u;
    return (g / gpr) * ((tc + PAD) / 8u) + (g % gpr);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint warp = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint M = p.M;
    const uint N = p.N;
    const uint K = p.K;
#ifdef EXP_NOTRANS
    const bool ta = false;
    const bool tb = false;
#else
    const bool ta = p.trans_a != 0u;
    const bool tb = p.trans_b != 0u;
#endif

    // Grouped tile order: GM consecutive tile rows sweep the tile columns together.
    const uint tiles_n = gl_NumWorkGroups.x;
    const uint tiles_m = gl_NumWorkGroups.y;
    const uint pid = gl_WorkGroupID.y * tiles_n + gl_WorkGroupID.x;
    const uint group_tiles = GM * tiles_n;
    const uint first_m = (pid / group_tiles) * GM;
    const uint group_m = min(tiles_m - first_m, GM);
    const uint tile_m = first_m + (pid % group_tiles) % group_m;
    const uint tile_n = (pid % group_tiles) / group_m;
    const uint m0 = tile_m * BM;
    const uint n0 = tile_n * BN;

    const uint wm = warp % WARPS_M;
    const uint wn = warp / WARPS_M;

    Operand oa;
    oa.R = ta ? K : M;
    oa.L = ta ? M : K;
    oa.TC = ta ? BM : BK;
    oa.r0 = ta ? 0u : m0;
    oa.c0 = ta ? m0 : 0u;
    oa.k_rows = ta;
    oa.vec = (oa.L % 4u) == 0u;
    Operand ob;
    ob.R = tb ? N : K;
    ob.L = tb ? K : N;
    ob.TC = tb ? BK : BN;
    ob.r0 = tb ? n0 : 0u;
    ob.c0 = tb ? 0u : n0;
    ob.k_rows = !tb;
    ob.vec = (ob.L % 4u) == 0u;

    // Shared strides (halves) and fragment origins of this subgroup, per orientation.
    const uint sa = ta ? BM + PAD : BK + PAD;
    const uint sb = tb ? BK + PAD : BN + PAD;

    coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator> acc[FM * FN];
    for (uint i = 0u; i < FM * FN; ++i) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator>(0.0);
    }
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseA> fa[FM];
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseB> fb[FN];

    vec4 ra[2 * A_LOADS];
    vec4 rb[2 * B_LOADS];

    const uint slabs = (K + BK - 1u) / BK;

    // Prologue: slab 0 into stage 0.
    for (uint i = 0u; i < A_LOADS; ++i) {
        uint g = tid + i * NT;
        if (g < A_GRANULES) {
            load_granule(oa, true, g, 0u, ra[2 * i], ra[2 * i + 1]);
            smem[granule_slot(oa.TC, g)] = to_half8(ra[2 * i], ra[2 * i + 1]);
        }
    }
    for (uint i = 0u; i < B_LOADS; ++i) {
        uint g = tid + i * NT;
        if (g < B_GRANULES) {
            load_granule(ob, false, g, 0u, rb[2 * i], rb[2 * i + 1]);
            smem[A_VECS + granule_slot(ob.TC, g)] = to_half8(rb[2 * i], rb[2 * i + 1]);
        }
    }
    barrier();

    for (uint s = 0u; s < slabs; ++s) {
        const uint cur = (s & 1u) * STAGE;
        const uint nxt = STAGE - cur;
        const bool more = s + 1u < slabs;
        const uint k1 = (s + 1u) * BK;

        // Issue the next slab's global loads; they land while the tensor cores work.
#ifdef EXP_NOGLOBAL
        if (false) {
#else
        if (more) {
#endif
            for (uint i = 0u; i < A_LOADS; ++i) {
                uint g = tid + i * NT;
                if (g < A_GRANULES) {
                    load_granule(oa, true, g, k1, ra[2 * i], ra[2 * i + 1]);
                }
            }
            for (uint i = 0u; i < B_LOADS; ++i) {
                uint g = tid + i * NT;
                if (g < B_GRANULES) {
                    load_granule(ob, false, g, k1, rb[2 * i], rb[2 * i + 1]);
                }
            }
        }

        for (uint kk = 0u; kk < BK; kk += T) {
#ifdef EXP_NOLDS
            if (s == 0u && kk == 0u)
#endif
            if (ta) {
                for (uint i = 0u; i < FM; ++i) {
                    uint e = kk * sa + wm * WM + i * T;
                    coopMatLoad(fa[i], smem, cur + e / 8u, sa / 8u, gl_CooperativeMatrixLayoutColumnMajor);
                }
            } else {
                for (uint i = 0u; i < FM; ++i) {
                    uint e = (wm * WM + i * T) * sa + kk;
                    coopMatLoad(fa[i], smem, cur + e / 8u, sa / 8u, gl_CooperativeMatrixLayoutRowMajor);
                }
            }
#ifdef EXP_NOLDS
            if (s == 0u && kk == 0u)
#endif
            if (tb) {
                for (uint j = 0u; j < FN; ++j) {
                    uint e = (wn * WN + j * T) * sb + kk;
                    coopMatLoad(fb[j], smem, cur + A_VECS + e / 8u, sb / 8u,
                                gl_CooperativeMatrixLayoutColumnMajor);
                }
            } else {
                for (uint j = 0u; j < FN; ++j) {
                    uint e = kk * sb + wn * WN + j * T;
                    coopMatLoad(fb[j], smem, cur + A_VECS + e / 8u, sb / 8u,
                                gl_CooperativeMatrixLayoutRowMajor);
                }
            }
            for (uint i = 0u; i < FM; ++i) {
                for (uint j = 0u; j < FN; ++j) {
                    acc[i * FN + j] = coopMatMulAdd(fa[i], fb[j], acc[i * FN + j]);
                }
            }
        }

#ifdef EXP_NOGLOBAL
        if (false) {
#else
        if (more) {
#endif
            for (uint i = 0u; i < A_LOADS; ++i) {
                uint g = tid + i * NT;
                if (g < A_GRANULES) {
                    smem[nxt + granule_slot(oa.TC, g)] = to_half8(ra[2 * i], ra[2 * i + 1]);
                }
            }
            for (uint i = 0u; i < B_LOADS; ++i) {
                uint g = tid + i * NT;
                if (g < B_GRANULES) {
                    smem[nxt + A_VECS + granule_slot(ob.TC, g)] = to_half8(rb[2 * i], rb[2 * i + 1]);
                }
            }
        }
        barrier();
    }

    // Epilogue, one 16-row strip of the warp tile at a time through this subgroup's staging.
    const uint stage = warp * ST_VECS;
    const bool vec_c = (N % 4u) == 0u;
    const uint quads = T * WN / 4u;
    for (uint i = 0u; i < FM; ++i) {
        for (uint j = 0u; j < FN; ++j) {
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
