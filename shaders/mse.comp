// Mean squared error over the first n = stepvals[4] rows of Y, T [rows, cols] (the rest are
// padding of a partial batch): loss_rows[r] = mean_c (Y - T)^2 / n, so their sum is the batch
// mean, and when write_grad != 0, dY = 2 (Y - T) / (n * cols) (dY is not touched otherwise, so
// any buffer may be bound). Padding rows get 0 in both.
// One workgroup per row, looping rows with stride gl_NumWorkGroups.x; shared-memory tree.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 1) readonly buffer TBuf { float T[]; };
layout(std430, set = 0, binding = 2) writeonly buffer LossBuf { float loss_rows[]; };
layout(std430, set = 0, binding = 3) writeonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 4) readonly buffer StepBuf { float stepvals[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint write_grad;
} pc;

shared float partial[gl_WorkGroupSize.x];

#include "batch_rows.glsl"

uint first_stride() {
    uint p = 1u;
    while (p < gl_WorkGroupSize.x) {
        p <<= 1;
    }
    return p >> 1;
}

float group_sum(float v) {
    uint lid = gl_LocalInvocationID.x;
    partial[lid] = v;
    barrier();
    for (uint s = first_stride(); s > 0u; s >>= 1) {
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
    uint n = valid_rows(stepvals[4], pc.rows);
    float divisor = mean_divisor(stepvals[5], n);
    float scale = 2.0 / (divisor * float(pc.cols));
    for (uint row = gl_WorkGroupID.x; row < pc.rows; row += gl_NumWorkGroups.x) {
        uint base = row * pc.cols;
        bool real = row < n;  // uniform in the workgroup: one row per group
        float sum = 0.0;
        for (uint c = lid; c < pc.cols; c += size) {
            float d = real ? Y[base + c] - T[base + c] : 0.0;
            sum += d * d;
            if (pc.write_grad != 0u) {
                dY[base + c] = scale * d;
            }
        }
        sum = group_sum(sum);
        if (lid == 0u) {
            loss_rows[row] = sum / (float(pc.cols) * divisor);
        }
    }
}
