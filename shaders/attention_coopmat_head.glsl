// What the tensor-core attention kernels share (attention_coopmat*.comp, the mixed-precision
// counterparts of attention*.comp, same bindings, push block and results): tiles, the push block,
// head-row staging and the 16x16 fragment types.
//
// Tensors as in attention_head.glsl: qkv [N, T, 3D], Y and dY [N, T, D], L and Drow [N, H, T],
// all float32. A workgroup of WARPS subgroups owns BR = 16 * WARPS rows (queries; keys in the kv
// kernel), 16 per subgroup, and streams blocks of BC rows of the other side through shared memory
// as float16 (each row padded by 16 bytes, so the rows of a fragment fall in distinct banks).
// Products run as GL_KHR_cooperative_matrix 16x16x16 fp16 multiply-adds with fp32 accumulators;
// scores go through a per-subgroup fp32 strip in shared memory, where LPR lanes per row apply the
// mask and the softmax in fp32 and write P (or dS) back as fp16 for the next product. Scores stay
// in base 2 (multiplied by scale * log2(e) in fp32), so every exponential is exp2.
// shaders/attention_tiles.py (coopmat_attention_shared_bytes) mirrors the shared arrays.
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

const uint BR = 16u * WARPS;
const uint NT = WARPS * SG;
const uint LPR = SG / 16u;          // lanes per row of a subgroup's 16-row strip
const uint CPL = BC / LPR;          // columns of a strip row per lane (a multiple of 4)
const uint FD = DH / 16u;           // fragments along a head row
const uint FC = BC / 16u;           // fragments along a block
const uint HS = (DH + 8u) / 4u;     // fp16 head row stride in shared memory, uvec2 (4 halves)
const uint SS = BC + 4u;            // fp32 strip row stride, floats
const uint PS = (BC + 8u) / 4u;     // fp16 strip row stride, uvec2
const uint STAGED = BC * HS;        // uvec2 per staged block of head rows
const uint LOADS_BC = (BC * DH / 4u + NT - 1u) / NT;  // vec4 an invocation loads per block
const uint LOADS_BR = (BR * DH / 4u + NT - 1u) / NT;  // and of the owned rows
const float LOG2E = 1.4426950408889634;
const float MASKED = -3.0e38;       // finite, so that max and differences with it stay finite

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
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

// Head rows t0.. of a buffer whose row t starts at START(t) floats go to shared memory in two
// halves: LOAD_ROWS issues every global load of the block into REGS (COUNT vec4 an invocation:
// LOADS_BC for a streamed block, LOADS_BR for the owned rows), so that they are in flight
// together, then STORE_ROWS writes them as halves into the shared array DST from uvec2 BASE on.
// Rows past T are zeros (0 * garbage may be NaN).
#define LOAD_ROWS(REGS, COUNT, BUF4, START, t0, ROWS)                    \
    [[unroll]] for (uint x = 0u; x < COUNT; x++) {                        \
        const uint e = gl_LocalInvocationID.x + x * NT;                   \
        const uint c = e / (DH / 4u);                                     \
        const uint t = min((t0) + c, pc.T - 1u);                          \
        const bool real = (t0) + c < pc.T && e < (ROWS) * (DH / 4u);      \
        REGS[x] = real ? BUF4[(START) / 4u + e % (DH / 4u)] : vec4(0.0);  \
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
    subgroupMemoryBarrierShared();
    subgroupBarrier();
}
