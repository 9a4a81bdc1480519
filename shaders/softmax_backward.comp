// Backward of the row-wise softmax (log = 0) or log-softmax (log = 1), from its output Y:
//   softmax:     dX = Y * (dY - sum_c dY * Y)
//   log-softmax: dX = dY - exp(Y) * sum_c dY
// One workgroup per row, looping rows with stride gl_NumWorkGroups.x; invocations split the
// columns and join through a shared-memory tree.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 1) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint log;  // a member, so it does not hide the built-in log()
} pc;

shared float partial[gl_WorkGroupSize.x];

// Workgroup-wide sum of v; every invocation gets it. Call in uniform control flow.
float group_sum(float v) {
    uint lid = gl_LocalInvocationID.x;
    partial[lid] = v;
    barrier();
    uint s = 1u;
    while (s < gl_WorkGroupSize.x) {
        s <<= 1;
    }
    for (s >>= 1; s > 0u; s >>= 1) {
        if (lid < s && lid + s < gl_WorkGroupSize.x) {
            partial[lid] += partial[lid + s];
        }
        barrier();
    }
    float result = partial[0];
    barrier();
    return result;
}

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint size = gl_WorkGroupSize.x;
    for (uint row = gl_WorkGroupID.x; row < pc.rows; row += gl_NumWorkGroups.x) {
        uint base = row * pc.cols;
        float dot = 0.0;
        for (uint c = lid; c < pc.cols; c += size) {
            dot += pc.log != 0u ? dY[base + c] : dY[base + c] * Y[base + c];
        }
        dot = group_sum(dot);
        for (uint c = lid; c < pc.cols; c += size) {
            float y = Y[base + c];
            dX[base + c] = pc.log != 0u ? dY[base + c] - exp(y) * dot : y * (dY[base + c] - dot);
        }
    }
}
