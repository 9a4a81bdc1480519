// Layer normalisation's forward: see layernorm_body.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "layernorm_body.glsl"
