// unary_backward.comp that also writes H, dX's float16 copy (rounded as cast.comp rounds: bit for
// bit numpy's astype), two halves a word: mixed precision's gradient of a GELU before a Linear
// (the char GPT's fc1), whose weight and input gradients read the copy, with no cast launch.
#version 450
#extension GL_GOOGLE_include_directive : require
#define DX_HALF_COPY 1
#include "unary_backward_body.glsl"
