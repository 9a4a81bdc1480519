// gemm.comp with a second output: Y = act_YA(C), written by the epilogue beside C (YA from the
// launch's copy_act). For fp32 plans, where a Linear followed by GELU keeps its pre-activation C
// (GELU's backward reads it) and the next layer reads GELU(C): one launch instead of a GEMM and a
// unary over C. K is not split.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GEMM_SECOND_OUTPUT 1
#include "gemm_body.glsl"
