// What the tensor-core attention kernels share (attention_coopmat*.comp, the mixed-precision
// counterparts of attention*.comp, same bindings, push block and results): tiles, the push block,
// head-row staging, the 16x16 fragment types and the coordinates of a fragment's elements.
//
// Tensors as in attention_head.glsl: qkv [N, T, 3D], Y and dY [N, T, D], L and Drow [N, H, T],
// all float32. A workgroup of WARPS subgroups owns BR = 16 * WARPS rows (queries; keys in the kv
// kernel), 16 per subgroup, and streams blocks of BC rows of the other side through shared memory
// as float16 (each row padded by 16 bytes, so the rows of a fragment fall in distinct banks); the
// next block's global loads are in flight while the current one is multiplied (PREFETCH).
// Products run as GL_KHR_cooperative_matrix 16x16x16 fp16 multiply-adds with fp32 accumulators.
// The backward kernels keep their scores in the accumulators: every accumulator of a type holds
// element (r, c) at the same index of the same lane, so two accumulators loaded once with their
// elements' own row and column (FRAGMENT_COORDS) say where each element x[k] lies, and the mask,
// the exponentials and the per-row or per-column terms (L, Drow) are applied element by element in
// fp32; P and dS, converted to fp16 accumulators, go through shared memory to be loaded back as
// the A operand of the next product. Fragments that the causal mask or the end of the sequence
// leaves empty are skipped, and only the ones it cuts are masked. The forward keeps its scores in
// a per-subgroup fp32 strip (its running row maximum needs every element of a row). Scores stay
// in base 2 (multiplied by scale * log2(e) in fp32), so every exponential is exp2.
// shaders/attention_tiles.py (coopmat_attention_shared_bytes) mirrors the shared arrays.
// With QKV_HALF defined (the *_half.comp variants, mixed precision with MIXED_FUSIONS) qkv is read
// as its float16 copy, four halves a uvec2 (QKV_T), staged as they are: the same halves that the
// float32 kernels stage if the copy rounds as packHalf2x16 does (nearest even); and the forward's
// output Y also gets its float16 copy H, rounded by half_bits.glsl (bit for bit numpy's astype,
// as cast.comp), for the GEMMs after it to read as halves (dqkv's is column_sum_copy's).
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint BC = 32;    // rows per streamed block, a multiple of 16
layout(constant_id = 4) const uint DH = 64;    // the head size, a multiple of 16
layout(constant_id = 5) const uint SG = 32;    // the subgroup size; local_size_x = WARPS * SG
layout(constant_id = 6) const uint WARPS = 2;  // subgroups per workgroup
layout(constant_id = 7) const uint PREFETCH = 1u;  // 1: load the next block during this one's products
layout(constant_id = 8) const uint SYNC = 1u;      // subgroup_sync: 1 control barrier on shared memory
                                                   // only, 0 memory barrier then subgroup barrier

const uint BR = 16u * WARPS;
const uint NT = WARPS * SG;
const uint LPR = SG / 16u;          // lanes per row of a subgroup's 16-row strip
const uint FD = DH / 16u;           // fragments along a head row
const uint FC = BC / 16u;           // fragments along a block
const uint HS = (DH + 8u) / 4u;     // fp16 head row stride in shared memory, uvec2 (4 halves)
const uint SS = 20u;                // fp32 tile row stride, floats (16 and a pad)
const uint RP = 16u / LPR;          // columns of a tile row per lane
const uint PS = (BC + 8u) / 4u;     // fp16 strip (16 x BC) row stride, uvec2
const uint STAGED = BC * HS;        // uvec2 per staged block of head rows
const uint LOADS_BC = (BC * DH / 4u + NT - 1u) / NT;  // vec4 an invocation loads per block
const uint LOADS_BR = (BR * DH / 4u + NT - 1u) / NT;  // and of the owned rows
const float LOG2E = 1.4426950408889634;
const float MASKED = -3.0e38;       // finite, so that max and differences with it stay finite

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define ACC16 coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define MAT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define ROW_MAJOR gl_CooperativeMatrixLayoutRowMajor
#define COL_MAJOR gl_CooperativeMatrixLayoutColumnMajor

layout(push_constant) uniform Push {
    uint N;
    uint T;
    uint H;
    uint dh;
    float scale;
    uint causal;
} pc;

// Element index of head h's first element in row t of sample n of qkv; part 0 q, 1 k, 2 v.
uint qkv_start(uint n, uint t, uint part, uint h) {
    const uint d = pc.H * DH;
    return (n * pc.T + t) * 3u * d + part * d + h * DH;
}

// The same in a [N, T, D] tensor (Y, dY).
uint row_start(uint n, uint t, uint h) {
    return (n * pc.T + t) * pc.H * DH + h * DH;
}

uvec2 halves(vec4 v) {
    return uvec2(packHalf2x16(v.xy), packHalf2x16(v.zw));
}

// Four halves of qkv's float16 copy, staged as they are.
uvec2 halves(uvec2 v) {
    return v;
}

vec4 zero_like(vec4 v) {
    return vec4(0.0);
}

uvec2 zero_like(uvec2 v) {
    return uvec2(0u);
}

#ifdef QKV_HALF
#include "half_bits.glsl"
#define QKV_T uvec2
#else
#define QKV_T vec4
#endif

// Head rows t0.. of a buffer whose row t starts at element START(t) go to shared memory in two
// halves: LOAD_ROWS issues every global load of the block into REGS (COUNT vec4, or uvec2 of four
// halves where the buffer is qkv's float16 copy, an invocation:
// LOADS_BC for a streamed block, LOADS_BR for the owned rows), so that they are in flight
// together, then STORE_ROWS writes them as halves into the shared array DST from uvec2 BASE on.
// Rows past T are zeros (0 * garbage may be NaN).
#define LOAD_ROWS(REGS, COUNT, BUF4, START, t0, ROWS)                    \
    [[unroll]] for (uint x = 0u; x < COUNT; x++) {                        \
        const uint e = gl_LocalInvocationID.x + x * NT;                   \
        const uint c = e / (DH / 4u);                                     \
        const uint t = min((t0) + c, pc.T - 1u);                          \
        const bool real = (t0) + c < pc.T && e < (ROWS) * (DH / 4u);      \
        REGS[x] = real ? BUF4[(START) / 4u + e % (DH / 4u)] : zero_like(BUF4[0]); \
    }

#define STORE_ROWS(DST, BASE, REGS, COUNT, ROWS)                          \
    [[unroll]] for (uint x = 0u; x < COUNT; x++) {                        \
        const uint e = gl_LocalInvocationID.x + x * NT;                   \
        if (e < (ROWS) * (DH / 4u)) {                                     \
            DST[(BASE) + (e / (DH / 4u)) * HS + e % (DH / 4u)] = halves(REGS[x]); \
        }                                                                 \
    }

// Makes a subgroup's shared-memory writes visible to its own lanes (coopMatStore, then the lanes
// read the strip; the lanes write, then coopMatLoad).
void subgroup_sync() {
    if (SYNC != 0u) {
        controlBarrier(gl_ScopeSubgroup, gl_ScopeSubgroup, gl_StorageSemanticsShared, gl_SemanticsAcquireRelease);
    } else {
        subgroupMemoryBarrierShared();
        subgroupBarrier();
    }
}

// RID and CID: accumulators whose every element holds its own row (column) index, loaded through
// the subgroup's fp32 tile TILE[BASE..] (16 rows of SS floats).
#define FRAGMENT_COORDS(RID, CID, TILE, BASE)                                     \
    for (uint e = gl_SubgroupInvocationID; e < 256u; e += SG) {                  \
        TILE[(BASE) + (e / 16u) * SS + e % 16u] = float(e / 16u);                \
    }                                                                             \
    subgroup_sync();                                                              \
    coopMatLoad(RID, TILE, BASE, SS, ROW_MAJOR);                                  \
    subgroup_sync();                                                              \
    for (uint e = gl_SubgroupInvocationID; e < 256u; e += SG) {                  \
        TILE[(BASE) + (e / 16u) * SS + e % 16u] = float(e % 16u);                \
    }                                                                             \
    subgroup_sync();                                                              \
    coopMatLoad(CID, TILE, BASE, SS, ROW_MAJOR);                                  \
    subgroup_sync();

// The sum (OP +) or maximum (OP max) of row `row` of the tile at TILE[BASE..], on every lane of
// the row (LPR lanes a row, RP columns each, combined by shuffles in a fixed order).
#define ROW_REDUCE(RESULT, OP, TILE, BASE, row, part)                             \
    {                                                                             \
        RESULT = TILE[(BASE) + (row) * SS + (part) * RP];                         \
        [[unroll]] for (uint c = 1u; c < RP; c++) {                               \
            RESULT = OP(RESULT, TILE[(BASE) + (row) * SS + (part) * RP + c]);     \
        }                                                                         \
        [[unroll]] for (uint o_ = 1u; o_ < LPR; o_ *= 2u) {                       \
            RESULT = OP(RESULT, subgroupShuffleXor(RESULT, o_));                  \
        }                                                                         \
    }
float add(float a, float b) {
    return a + b;
}
