// The backward of an activation: see unary_backward_body.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "unary_backward_body.glsl"
