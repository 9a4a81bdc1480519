// attention_coopmat_backward_kv: qkv read as float32 (see attention_coopmat_backward_kv_body.glsl).
#version 450
#extension GL_GOOGLE_include_directive : require
#include "attention_coopmat_backward_kv_body.glsl"
