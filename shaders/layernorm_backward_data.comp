// Layer normalisation's input gradient: see layernorm_backward_data_body.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "layernorm_backward_data_body.glsl"
