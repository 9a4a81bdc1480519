// layernorm_backward_data.comp that also writes H, dX's float16 copy (rounded as cast.comp rounds:
// bit for bit numpy's astype), two halves a word: mixed precision's residual-stream gradient that
// a wide Linear's weight gradient reads, with no cast launch after it. D is even.
#version 450
#extension GL_GOOGLE_include_directive : require
#define LAYERNORM_COPY 1
#include "layernorm_backward_data_body.glsl"
