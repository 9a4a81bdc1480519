// In-place SGD over n parameters on gradients scaled by clip[1]: see sgd.glsl and grad_norm.comp.
#version 450
#extension GL_GOOGLE_include_directive : require
#define CLIP 1
#include "sgd.glsl"
