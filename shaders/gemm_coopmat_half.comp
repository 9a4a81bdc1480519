// gemm_coopmat_copy.comp that writes only H, C's float16 copy, not C: mixed precision's GEMM whose
// output no launch reads but as halves (the char GPT's qkv projection, read only by the attention
// kernels; flow.autodiff _write_halves_only). N even, K not split, no accumulate (C is not read).
#version 450
#extension GL_GOOGLE_include_directive : require
#define GEMM_HALF_COPY 1
#define GEMM_HALF_ONLY 1
#include "gemm_coopmat_body.glsl"
