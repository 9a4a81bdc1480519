// C[M,N] = act(alpha * op(A) @ op(B) + (accumulate ? C : 0) + bias[N]) on tensor cores: the op,
// bindings and push constants of gemm.comp, with bias and C fp32 row-major buffers and A and B
// row-major buffers of fp32 or, per operand, fp16 (AH, BH). trans_a: A is stored [K,M]; trans_b: B
// is stored [N,K]. Any M, N, K.
//
// Precision: the mixed-precision fast path. Products are summed in fp32 by GL_KHR_cooperative_matrix
// 16x16x16 fp16 -> fp32 multiply-adds, and the epilogue is fp32. An fp32 operand (AH/BH = 0,
// registry op gemm_coopmat) has each element rounded to float16 (round to nearest even on the
// devices tested) as it enters shared memory: against fp32 inputs the relative error is about 1e-3
// (the fp16 input rounding), and magnitudes above 65504 overflow to infinity. An fp16 operand
// (AH/BH = 1, registry op gemm_coopmat_f16) is copied bit for bit. Against the product of the
// fp16(-rounded) inputs only fp32 accumulation error remains. (glslang 13.1 has no
// GL_EXT_bfloat16, so there is no bf16 variant.)
//
// Why one shader for both input types: the fp16 path differs only in how a granule of 8 elements
// travels from global to shared memory (one 16-byte load and store, no conversion, instead of two
// vec4 loads and a packHalf2x16 per pair); the tiling, K loop, fragment loads and epilogue are
// shared. AH and BH are specialisation constants, so the driver folds every branch on them at
// pipeline creation and each pipeline holds only its own path; with AH = BH = 0, PD = 1 and
// NS = 2 (gemm_coopmat's defaults) every added branch folds away and the K loop is the one the
// fp32 path had before. Operands are independent (mixed fp16/fp32 works, through the constants).
// fp16 buffers are read as uint words and uvec4 granules rather than float16_t, so no 16-bit
// storage feature is needed and the halves are moved, never converted.
//
// Tiling: a workgroup computes a BM x BN tile of C with (BM/WM)*(BN/WN) subgroups of SG
// invocations (SG must be the device's subgroup size: 32 on NVIDIA), each owning a WM x WN warp
// tile held as (WM/16)*(WN/16) fp32 accumulators. A and B stream through shared memory BK at a
// time: every invocation holds its granules of the next slab(s) in registers (two vec4 per fp32
// granule, one uvec4 per fp16 granule; scalar loads with bounds checks only in edge tiles or when
// a row is not 16-byte aligned) while the tensor cores multiply the current stage, then stores
// them (converted, for fp32) into the other stage. PD slabs are in flight in registers: a load
// issued in one iteration is stored PD - 1 iterations later, after PD slabs of multiply-adds
// (PD = 1 is the classic register prefetch; fp16 granules are half the registers, which pays
// for PD = 2). NS = 2 shared stages need one barrier per slab; NS = 1 halves the shared memory
// (so BK = 32 fits with 128x256 tiles under 48 KiB) at the cost of a second barrier. Each operand
// keeps its global orientation in shared memory (contiguous dimension contiguous, 8 halves of
// padding per row so the rows of a fragment fall in distinct banks); a transposed operand is read
// with a column-major coopMatLoad rather than transposed on the way in. Out-of-range rows,
// columns and K are zero-filled in shared memory. Shared memory (registry.coopmat_shared_bytes
// mirrors this): max(NS * stage, epilogue staging), in 16-byte words.
//
// Split-K (push k_splits > 1, as gemm.comp): workgroup z multiplies whole BK slabs of its slice of
// K and writes raw sums into slice z of C seen as [k_splits, M, N]; splitk_epilogue adds them and
// applies the epilogue. It fills the GPU where M x N has few tiles and K is long (a weight
// gradient over 16384 rows). ones_row (as gemm.comp): op(A)'s last row is all ones and A stores
// only the M - 1 rows before it, so C's last row is the column sums of op(B), a bias gradient
// beside its weight gradient; the ones enter through the edge loads, like the zero padding.
//
// Epilogue: after the last slab the tile memory is reused as per-subgroup fp32 staging; each
// subgroup stores one 16-row strip of its accumulators, then its invocations apply alpha, the
// old C, the bias and the activation per element and write C with bounds checks (vec4 where N
// is a multiple of 4).
//
// Workgroups are visited in groups of GM tile rows (the x/y grid is remapped), so tiles that run
// at the same time share A and B panels in L2.
//
// Speed (fp32 inputs, H200, 4096^3, tiles 128x128x32, 4 subgroups of 64x64): ~178 TFLOP/s. Every
// loop over tiles is [[unroll]]ed and the K loop is instantiated per transposition pair (see
// mainloop): without the first the accumulators live in local memory (~32 TFLOP/s), without the
// second ~116. With fp32 inputs the staging doubles global traffic and register use against
// fp16 inputs, which caps the tile at 128x128 under 48 KiB of shared memory and two workgroups
// per SM; the multiply-adds alone run at ~515 TFLOP/s. fp16 inputs halve the L2 -> SM traffic per
// flop, and 128x256 or 256x128 tiles (8 subgroups of 64x64) cut it by another quarter against
// 128x128; which tiles win on a device is what bench/sweep_coopmat.py measures.
//
// Integer arithmetic only on specialisation constants in new code (no ?: on them inside
// functions): glslang 13.1 emits invalid SPIR-V for some of those. tests/test_ops_coopmat.py
// specialises every listed tile config with spirv-opt and runs spirv-val on the result.
// Epilogue extras: a specialisation constant AD (an ACT_* code, from the launch's act_grad) makes
// the epilogue multiply by the derivative of the previous layer's activation at its saved output,
// bound in place of the bias (gemm.comp's fused input-gradient GEMM): no unary_backward launch.
// gemm_coopmat_copy.comp also writes C's float16 copy (binding H) from the same registers, rounded
// as cast.comp rounds (half_bits.glsl): the next GEMMs read halves with no cast launch between.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "gemm_coopmat_body.glsl"
