// Y[r, c] = X[r, c] + B[c] for r < rows, c < cols: one row added to every row of a batch (a
// learned position embedding added to each sample's (T, D) input).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBuf { float B[]; };
layout(std430, set = 0, binding = 2) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
} pc;

void main() {
    const uint total = pc.rows * pc.cols;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        Y[i] = X[i] + B[i % pc.cols];
    }
}
