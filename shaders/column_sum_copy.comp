// column_sum.comp that also writes X's float16 copy H (see column_sum_body.glsl): the qkv bias's
// gradient in mixed precision, whose launch writes the copy of dqkv that the qkv GEMMs read.
#version 450
#extension GL_GOOGLE_include_directive : require
#define COLUMN_SUM_COPY 1
#include "column_sum_body.glsl"
