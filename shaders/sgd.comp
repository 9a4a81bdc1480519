// In-place SGD over n parameters: see sgd.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "sgd.glsl"
