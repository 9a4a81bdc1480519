// gemm_coopmat_copy.comp with the copy converted by the hardware, rounded to nearest even with
// subnormals kept (SPV_KHR_float_controls execution modes): bit for bit half_bits.glsl's rounding
// (a NaN stays a NaN, its payload the hardware's) in a fraction of the instructions. For devices
// with the fact fp16_exact_rounding (registry resolve picks it there).
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_spirv_intrinsics : require
#define GEMM_HALF_COPY 1
#define HALF_RTE 1
#include "gemm_coopmat_body.glsl"
