// Y = f(X) elementwise. fn: an ACT_* code (a = slope), or a UNARY_* one: scale_shift
// (Y = X * a + b), copy or exp. Unknown codes write NaN.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };

#include "elementwise_head.glsl"
#include "activations.glsl"

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        float x = X[i];
        float y;
        if (pc.fn == UNARY_SCALE_SHIFT) {
            y = x * pc.a + pc.b;
        } else if (pc.fn == UNARY_COPY) {
            y = x;
        } else if (pc.fn == UNARY_EXP) {
            y = exp(x);
        } else {
            y = activate(x, pc.fn, pc.a);
        }
        Y[i] = y;
    }
}
