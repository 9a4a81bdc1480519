// In-place Adam / AdamW over n parameters: see adam.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "adam.glsl"
