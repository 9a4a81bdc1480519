// Y[r, y_offset + c] = X[r, x_offset + c] for r < rows, c < cols, in rows x_width and y_width
// floats long: a block of columns moved between matrices of different widths. A Concat's forward
// places each input's columns in the output; its backward takes them back out of the gradient.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint x_width;
    uint x_offset;
    uint y_width;
    uint y_offset;
} pc;

void main() {
    const uint total = pc.rows * pc.cols;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        const uint r = i / pc.cols;
        const uint c = i - r * pc.cols;
        Y[r * pc.y_width + pc.y_offset + c] = X[r * pc.x_width + pc.x_offset + c];
    }
}
