// gemm.comp plus a residual: C = R + act(alpha * op(A) @ op(B) + bias), R[M,N] read from binding 4
// (a residual block's x), in one launch instead of the GEMM of f and a binary add of x + f(x).
// K is not split.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GEMM_RESIDUAL 1
#include "gemm_body.glsl"
