// Y = f(X) elementwise. fn: an ACTIVATIONS code (a = slope), or UNARY_EXTRA: 6 scale_shift
// (Y = X * a + b), 7 copy, 8 exp. Unknown codes write NaN.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "activations.glsl"

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint n;
    uint fn;
    float a;
    float b;
} pc;

const uint FN_SCALE_SHIFT = 6u;
const uint FN_COPY = 7u;
const uint FN_EXP = 8u;

void main() {
    // Grid-stride: the registry caps the group count, so one launch covers any n.
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        float x = X[i];
        float y;
        if (pc.fn == FN_SCALE_SHIFT) {
            y = x * pc.a + pc.b;
        } else if (pc.fn == FN_COPY) {
            y = x;
        } else if (pc.fn == FN_EXP) {
            y = exp(x);
        } else {
            y = activate(x, pc.fn, pc.a);
        }
        Y[i] = y;
    }
}
