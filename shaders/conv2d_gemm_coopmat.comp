// conv2d as an implicit GEMM on tensor cores, for mixed precision: the gathers and
// epilogue of conv2d_gemm.comp (shared through conv2d_gemm.glsl) around
// conv_gemm_coopmat_body.glsl's main loop (operands rounded to float16, fp32 sums).
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require

#define CONV_COOPMAT 1
#include "conv2d_gemm.glsl"
#include "conv_gemm_coopmat_body.glsl"
