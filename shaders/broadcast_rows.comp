// Y[r, j] = alpha * X[r] for r < rows, j < cols: each row's one value spread over its row (the
// backward of a mean over a row, global average pooling's, has alpha = 1 / cols).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    float alpha;
} pc;

void main() {
    const uint total = pc.rows * pc.cols;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        Y[i] = pc.alpha * X[i / pc.cols];
    }
}
