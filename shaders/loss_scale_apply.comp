// X[i] *= S[0] over n elements: the loss's gradient times the loss scale (flow.optim.LOSS_SCALE),
// read on the device so a change of scale never re-records the program.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer SBuf { float S[]; };

layout(push_constant) uniform Push {
    uint n;
} pc;

void main() {
    float scale = S[0];
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        X[i] *= scale;
    }
}
