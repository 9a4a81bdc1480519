// dX = dY * f'(S) for an ACT_* code fn (a = slope). S is the forward output for relu,
// leaky_relu, sigmoid and tanh, the forward input for gelu. Codes without a derivative write NaN.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer SBuf { float S[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };

#include "elementwise_head.glsl"
#include "activations.glsl"

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        dX[i] = dY[i] * activation_derivative(S[i], pc.fn, pc.a);
    }
}
