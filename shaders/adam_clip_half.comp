// In-place Adam / AdamW over n parameters on gradients scaled by clip[1], writing each updated
// parameter's float16 copy to H: see adam.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define CLIP 1
#define HALVES 1
#include "adam.glsl"
