// In-place Adam / AdamW over n parameters on gradients scaled by clip[1]: see adam.glsl and
// grad_norm.comp.
#version 450
#extension GL_GOOGLE_include_directive : require
#define CLIP 1
#include "adam.glsl"
