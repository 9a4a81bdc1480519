// Y[i] = X[i] for n 32-bit words, bit for bit (float32, int32 or uint32 alike: uint words carry
// NaN payloads and negative zeros unchanged).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { uint X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { uint Y[]; };

layout(push_constant) uniform Push {
    uint n;
} pc;

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        Y[i] = X[i];
    }
}
