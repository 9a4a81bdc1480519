// C[M,N] = act(alpha * op(A) @ op(B) + (accumulate ? C : 0) + bias[N]), fp32, row-major.
// trans_a: A is stored [K,M]; trans_b: B is stored [N,K]. Any M, N, K (tiles are bounds-checked).
//
// Two fusions for the backward pass of a dense layer, each saving a launch and a pass over memory:
// - act_grad != 0 (an ACTIVATIONS code): binding 2 holds D[M,N], the previous layer's saved
//   activation output, instead of a bias, and the result is multiplied by f'(D) (slope: the
//   leaky slope): dX and the activation's backward in one launch. Not with has_bias or split-K.
// - ones_row != 0: row M-1 of op(A) is all ones and is not read from A (A holds M-1 rows), so
//   row M-1 of C is the column sums of op(B): with C = [dW; db] laid out contiguously, one
//   launch gives the weight gradient and the bias gradient.
//
// One workgroup computes a BM x BN tile of C with (BM/TM)*(BN/TN)*SK threads (local_size_x must
// equal that; TN must be a multiple of 4). Each thread owns TM x TN outputs, as a grid of
// sub-blocks up to 4 x 4 that are spread over the tile (rows g * BM/RGM + ty * SWM + r, columns
// h * BN/RGN + tx * 4 + c; with WL, over the thread's warp tile instead): so in the inner loop
// the threads of a warp read consecutive vec4s of a shared row, which is free of bank conflicts
// (contiguous TM x TN blocks put successive threads TN words apart: a 2-way conflict at TN = 8).
// The accumulators are vec4s, one per row and column group: as a 64-element float array, a
// 128 x 128 tile with 8 x 8 per thread ran at 2.3 TFLOP/s on an H200 (it looked spilled); as
// vec4s, 34 TFLOP/s on an H100.
//
// A and B stream through shared memory BK at a time, stored k-major (A row-major may stay
// k-contiguous instead: KR, below): the next K tile is loaded from global memory into registers
// while the current one is multiplied, then stored into shared memory. With DB = 1 it goes into
// a second buffer, so each K step needs one barrier; with DB = 0 (one buffer) it waits for a
// second barrier.
//
// The transposition flags are the specialisation constants TA and TB (tune_gemm copies them
// from the launch's trans_a / trans_b; the push constants are ignored here), so every load path
// compiles to straight-line code: a runtime branch between the layouts inside the K loop broke
// the NVIDIA compiler's scheduling (see gemm_coopmat.comp). VEC (bit 0: A, bit 1: B, bit 2: C)
// says the contiguous dimension of that operand is a multiple of 4, so its rows start 16-byte
// aligned and the operand is loaded (stored, for C) as vec4 granules; otherwise scalar loads.
// GM > 1 visits the workgroups in bands of GM tile rows, so tiles running at the same time
// share their panels of A and B in L2. DB = 0 (the default: faster on an H100 at every size
// measured, see registry.GEMM_TILES) keeps one shared buffer and a second barrier per K step.
//
// Sliced-K (SK > 1): the workgroup holds SK groups of (BM/TM)*(BN/TN) threads; all of them load
// each K tile, and group s multiplies only its BK/SK rows of it. At the end the groups' partial
// tiles are summed through shared memory. It gives a tile SK times the threads without more
// tiles or a second launch: at M = 256 (an MLP's batch) there are too few tiles to fill a big
// GPU, and smaller tiles would cut the work per shared-memory read instead.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "gemm_body.glsl"
