// In-place Adam / AdamW over n parameters, writing each updated
// parameter's float16 copy to H: see adam.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define HALVES 1
#include "adam.glsl"
