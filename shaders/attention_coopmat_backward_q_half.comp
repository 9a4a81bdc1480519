// attention_coopmat_backward_q reading qkv's float16 copy and writing its output's float16 copy H (see
// attention_coopmat_backward_q_body.glsl): mixed precision's attention between GEMMs that read and write halves.
#version 450
#extension GL_GOOGLE_include_directive : require
#define QKV_HALF 1
#include "attention_coopmat_backward_q_body.glsl"
