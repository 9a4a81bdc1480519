// In-place SGD over n parameters, writing each updated
// parameter's float16 copy to H: see sgd.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define HALVES 1
#include "sgd.glsl"
