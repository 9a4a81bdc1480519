// The ceiling of KHR cooperative matrices on a device, step by step towards gemm_coopmat's K loop:
// each subgroup multiplies FM x FN 16x16x16 fp16 -> fp32 tiles, slab after slab of BK, as
// shaders/gemm_coopmat_body.glsl's inner loop does.
// FEED 0: the A and B fragments are loaded once and stay in registers (the tensor cores alone).
// FEED 1: every k step loads them from shared tiles laid out as gemm_coopmat's ([BM][BK + 8] and
//         [BK][BN + 8] halves): the kernel's inner loop without its global loads and barriers.
// FEED 2: and after each slab, gemm_coopmat's one-stage choreography: a barrier, every invocation
//         stores its granules of the tile (values it holds in registers), another barrier.
// FEED 3: and those granules come from global memory, loaded at the start of the slab as
//         gemm_coopmat does (PD 1), each slab from a different 64 KiB chunk of a large buffer: the
//         whole K loop, with an L2-resident stream instead of two matrices.
// FEED 4: no shared memory and no barriers: every k step loads the fragments straight from the
//         global stream (the chunk of FEED 3, read as the shared tiles are laid out).
// FEED 5: FEED 4 with the next k step's fragments loaded before this step's multiply-adds.
// The shared contents never change (the source repeats a 4096-granule pattern), so every FEED
// gives the same result. The k offset turns with the slab (push `shift`, 16 at run time) so that
// the driver cannot hoist the loads out of the loop. bench/coopmat_peak.py registers and times it;
// it is not a library op.
#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint WARPS_M = 2;
layout(constant_id = 4) const uint WARPS_N = 2;
layout(constant_id = 5) const uint FM = 4;
layout(constant_id = 6) const uint FN = 4;
layout(constant_id = 7) const uint FEED = 1;
layout(constant_id = 8) const uint BK = 64;

layout(push_constant) uniform Push {
    uint slabs;
    uint shift;
    uint chunks;  // 4096-granule chunks in the source
} pc;
layout(std430, set = 0, binding = 0) readonly buffer Src { uvec4 src[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Dst { float dst[]; };

const uint T = 16;
const uint PAD = 8;
const uint BM = WARPS_M * FM * T;
const uint BN = WARPS_N * FN * T;
const uint SA = BK + PAD;  // halves per shared row of A ([BM][BK])
const uint SB = BN + PAD;  // and of B ([BK][BN])
const uint A_VECS = BM * SA / 8u;
const uint B_VECS = BK * SB / 8u;
const uint SRC_VECS = 4096u;  // the source pattern's length in uvec4
const uint TILE_VECS = A_VECS + B_VECS;
const uint THREADS = WARPS_M * WARPS_N * 32u;
const uint LOADS = (TILE_VECS + THREADS - 1u) / THREADS;  // granules an invocation stores a slab
shared uvec4 smem[TILE_VECS];

void main() {
    const uint warp = gl_SubgroupID;
    const uint wm = warp % WARPS_M;
    const uint wn = warp / WARPS_M;
    const uint tid = gl_LocalInvocationID.x;
    for (uint i = tid; i < TILE_VECS; i += THREADS) {
        smem[i] = src[i % SRC_VECS];
    }
    uvec4 held[LOADS];
    [[unroll]] for (uint i = 0u; i < LOADS; ++i) {
        held[i] = src[(tid + i * THREADS) % SRC_VECS];
    }
    barrier();

    coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator> acc[FM * FN];
    [[unroll]] for (uint i = 0u; i < FM * FN; ++i) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, T, T, gl_MatrixUseAccumulator>(0.0);
    }
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseA> fa[FM];
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseB> fb[FN];
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        coopMatLoad(fa[i], smem, (wm * FM * T + i * T) * SA / 8u, SA / 8u, gl_CooperativeMatrixLayoutRowMajor);
    }
    [[unroll]] for (uint j = 0u; j < FN; ++j) {
        coopMatLoad(fb[j], smem, A_VECS + (wn * FN * T + j * T) / 8u, SB / 8u, gl_CooperativeMatrixLayoutRowMajor);
    }
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseA> na[FM];
    coopmat<float16_t, gl_ScopeSubgroup, T, T, gl_MatrixUseB> nb[FN];
    for (uint s = 0u; s < pc.slabs; ++s) {
        const uint chunk = ((gl_WorkGroupID.x * pc.slabs + s) % pc.chunks) * SRC_VECS;
        if (FEED == 3u) {
            [[unroll]] for (uint i = 0u; i < LOADS; ++i) {
                held[i] = src[chunk + (tid + i * THREADS) % SRC_VECS];
            }
        }
        [[unroll]] for (uint kk = 0u; kk < BK; kk += T) {
            const uint k = (kk + s * pc.shift) % BK;
            if (FEED >= 1u && FEED <= 3u) {
                [[unroll]] for (uint i = 0u; i < FM; ++i) {
                    coopMatLoad(fa[i], smem, ((wm * FM * T + i * T) * SA + k) / 8u, SA / 8u,
                                gl_CooperativeMatrixLayoutRowMajor);
                }
                [[unroll]] for (uint j = 0u; j < FN; ++j) {
                    coopMatLoad(fb[j], smem, A_VECS + (k * SB + wn * FN * T + j * T) / 8u, SB / 8u,
                                gl_CooperativeMatrixLayoutRowMajor);
                }
            }
            if (FEED == 4u) {
                [[unroll]] for (uint i = 0u; i < FM; ++i) {
                    coopMatLoad(fa[i], src, chunk + ((wm * FM * T + i * T) * SA + k) / 8u, SA / 8u,
                                gl_CooperativeMatrixLayoutRowMajor);
                }
                [[unroll]] for (uint j = 0u; j < FN; ++j) {
                    coopMatLoad(fb[j], src, chunk + A_VECS + (k * SB + wn * FN * T + j * T) / 8u, SB / 8u,
                                gl_CooperativeMatrixLayoutRowMajor);
                }
            }
            if (FEED == 5u) {
                // The step after this one: the next kk of this slab, or the first of the next slab.
                const bool last = kk + T == BK;
                const uint k2 = last ? ((s + 1u) * pc.shift) % BK : (kk + T + s * pc.shift) % BK;
                const uint c2 = last ? ((gl_WorkGroupID.x * pc.slabs + s + 1u) % pc.chunks) * SRC_VECS : chunk;
                if (s == 0u && kk == 0u) {
                    [[unroll]] for (uint i = 0u; i < FM; ++i) {
                        coopMatLoad(fa[i], src, chunk + ((wm * FM * T + i * T) * SA + k) / 8u, SA / 8u,
                                    gl_CooperativeMatrixLayoutRowMajor);
                    }
                    [[unroll]] for (uint j = 0u; j < FN; ++j) {
                        coopMatLoad(fb[j], src, chunk + A_VECS + (k * SB + wn * FN * T + j * T) / 8u, SB / 8u,
                                    gl_CooperativeMatrixLayoutRowMajor);
                    }
                }
                [[unroll]] for (uint i = 0u; i < FM; ++i) {
                    coopMatLoad(na[i], src, c2 + ((wm * FM * T + i * T) * SA + k2) / 8u, SA / 8u,
                                gl_CooperativeMatrixLayoutRowMajor);
                }
                [[unroll]] for (uint j = 0u; j < FN; ++j) {
                    coopMatLoad(nb[j], src, c2 + A_VECS + (k2 * SB + wn * FN * T + j * T) / 8u, SB / 8u,
                                gl_CooperativeMatrixLayoutRowMajor);
                }
            }
            [[unroll]] for (uint i = 0u; i < FM; ++i) {
                [[unroll]] for (uint j = 0u; j < FN; ++j) {
                    acc[i * FN + j] = coopMatMulAdd(fa[i], fb[j], acc[i * FN + j]);
                }
            }
            if (FEED == 5u) {
                [[unroll]] for (uint i = 0u; i < FM; ++i) {
                    fa[i] = na[i];
                }
                [[unroll]] for (uint j = 0u; j < FN; ++j) {
                    fb[j] = nb[j];
                }
            }
        }
        if (FEED == 2u || FEED == 3u) {
            barrier();
            [[unroll]] for (uint i = 0u; i < LOADS; ++i) {
                if (tid + i * THREADS < TILE_VECS) {
                    smem[tid + i * THREADS] = held[i];
                }
            }
            barrier();
        }
    }
    [[unroll]] for (uint i = 1u; i < FM * FN; ++i) {
        acc[0] = acc[0] + acc[i];
    }
    coopMatStore(acc[0], dst, (gl_WorkGroupID.x * WARPS_M * WARPS_N + warp) * T * T, T,
                 gl_CooperativeMatrixLayoutRowMajor);
}
