// gemm_coopmat_half.comp (the copy alone) with the copy converted by the hardware, as
// gemm_coopmat_copy_rte.comp: for devices with the fact fp16_exact_rounding.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_spirv_intrinsics : require
#define GEMM_HALF_COPY 1
#define GEMM_HALF_ONLY 1
#define HALF_RTE 1
#include "gemm_coopmat_body.glsl"
