// gemm_coopmat.comp with a second output: H, C's float16 copy (two halves a word, the lower index
// in the low bits), written by the epilogue beside C, bit for bit what cast.comp would write from C.
// For mixed precision, where the next layer's GEMMs read the output (or the input gradient) as halves.
// N must be even, so that no two invocations share a word of H, and K is not split.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GEMM_HALF_COPY 1
#include "gemm_coopmat_body.glsl"
