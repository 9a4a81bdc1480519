// What gemm.comp and gemm_coopmat.comp share: one op contract (C = act(alpha * op(A) @ op(B) +
// (accumulate ? C : 0) + bias)), hence the same bindings, each seen as floats and as vec4s, the
// push block the registry gives both (_GEMM_PUSH), and the epilogue's activation functions.
// gemm.comp takes three fields more (split-K and its fused backward launches): it defines
// GEMM_PUSH_EXTRA to their declarations before including this header, so the shared fields stay
// first in one place, as the registry lists them.
#ifndef VKFLOW_GEMM_HEAD_GLSL
#define VKFLOW_GEMM_HEAD_GLSL

layout(std430, set = 0, binding = 0) readonly buffer ABuf { float A[]; };
layout(std430, set = 0, binding = 0) readonly buffer ABuf4 { vec4 A4[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBuf { float B[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBuf4 { vec4 B4[]; };
layout(std430, set = 0, binding = 2) readonly buffer BiasBuf { float bias[]; };
layout(std430, set = 0, binding = 2) readonly buffer BiasBuf4 { vec4 bias4[]; };
layout(std430, set = 0, binding = 3) buffer CBuf { float C[]; };
layout(std430, set = 0, binding = 3) buffer CBuf4 { vec4 C4[]; };

#ifndef GEMM_PUSH_EXTRA
#define GEMM_PUSH_EXTRA
#endif

layout(push_constant) uniform Push {
    uint M;
    uint N;
    uint K;
    uint trans_a;  // A stored [K,M]; gemm.comp reads its copy, the constant TA, instead
    uint trans_b;  // B stored [N,K]; gemm.comp: TB
    uint has_bias;
    uint act;  // an ACT_* code; gemm.comp reads its copy, the constant ACT, instead
    uint accumulate;
    float alpha;
    float slope;
    GEMM_PUSH_EXTRA
} pc;

#include "common_gemm_act.glsl"

#endif
