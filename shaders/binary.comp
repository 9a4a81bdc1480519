// Z = a * (X op Y) elementwise, op a BINARY_* code (add, sub, mul). Unknown codes write NaN.
// Z may alias X or Y (each element is read before it is written, by the same invocation).
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 2) writeonly buffer ZBuf { float Z[]; };

#include "elementwise_head.glsl"

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        float x = X[i];
        float y = Y[i];
        float z;
        if (pc.fn == BINARY_ADD) {
            z = x + y;
        } else if (pc.fn == BINARY_SUB) {
            z = x - y;
        } else if (pc.fn == BINARY_MUL) {
            z = x * y;
        } else {
            z = uintBitsToFloat(0x7fc00000u);
        }
        Z[i] = z * pc.a;
    }
}
