// attention_coopmat_backward_kv reading qkv's float16 copy (see attention_coopmat_backward_kv_body.glsl):
// mixed precision's attention after a qkv GEMM that writes halves. dqkv's float16 copy, which the
// qkv GEMMs read, is written by the qkv bias's column_sum_copy, which reads all of dqkv anyway
// (writing it here cost the kv kernel 47 us a launch on an H100: bench/RESULTS.md, session 15).
#version 450
#extension GL_GOOGLE_include_directive : require
#define QKV_HALF 1
#include "attention_coopmat_backward_kv_body.glsl"
