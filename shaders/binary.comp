// Z = a * (X op Y) elementwise, op from BINARY: 0 add, 1 sub, 2 mul. Unknown codes write NaN.
// Z may alias X or Y (each element is read before it is written, by the same invocation).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 2) writeonly buffer ZBuf { float Z[]; };

layout(push_constant) uniform Push {
    uint n;
    uint fn;
    float a;
    float b;
} pc;

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        float x = X[i];
        float y = Y[i];
        float z;
        if (pc.fn == 0u) {
            z = x + y;
        } else if (pc.fn == 1u) {
            z = x - y;
        } else if (pc.fn == 2u) {
            z = x * y;
        } else {
            z = uintBitsToFloat(0x7fc00000u);
        }
        Z[i] = z * pc.a;
    }
}
