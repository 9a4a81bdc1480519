// layernorm_copy.comp that writes only H, Y's float16 copy (and the statistics), not Y: mixed
// precision's LayerNorm whose output no launch reads but as halves (flow.autodiff
// _write_halves_only), which saves a quarter of its traffic. D is even.
#version 450
#extension GL_GOOGLE_include_directive : require
#define LAYERNORM_COPY 1
#define LAYERNORM_HALF_ONLY 1
#include "layernorm_body.glsl"
