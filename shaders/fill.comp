// X[i] = value for i < n (float32).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) writeonly buffer XBuf { float X[]; };

layout(push_constant) uniform Push {
    uint n;
    float value;
} pc;

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        X[i] = pc.value;
    }
}
