// layernorm.comp that also writes H, Y's float16 copy (rounded as cast.comp rounds: bit for bit
// numpy's astype), two halves a word: mixed precision's LayerNorm before a wide Linear, whose GEMMs
// read the copy, with no cast launch after it. D is even.
#version 450
#extension GL_GOOGLE_include_directive : require
#define LAYERNORM_COPY 1
#include "layernorm_body.glsl"
