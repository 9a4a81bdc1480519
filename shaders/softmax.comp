// Row-wise softmax (log = 0) or log-softmax (log = 1) of X [rows, cols], stable: the row max is
// subtracted before exponentiating. One workgroup per row, looping rows with stride
// gl_NumWorkGroups.x (the registry caps the group count); invocations split the columns and join
// through shared-memory trees.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint log;  // a member, so it does not hide the built-in log()
} pc;

shared float partial[gl_WorkGroupSize.x];

// max that keeps NaN, as numpy's: GLSL's max() is undefined for a NaN operand, so a row holding
// NaN could come out finite on one driver and NaN on another.
float max_nan(float a, float b) {
    return isnan(a) || a > b ? a : b;
}

uint first_stride() {
    uint p = 1u;
    while (p < gl_WorkGroupSize.x) {
        p <<= 1;
    }
    return p >> 1;
}

// Workgroup-wide max or sum of v; every invocation gets the result. Call in uniform control flow.
float group_reduce(float v, bool take_max) {
    uint lid = gl_LocalInvocationID.x;
    partial[lid] = v;
    barrier();
    for (uint s = first_stride(); s > 0u; s >>= 1) {
        if (lid < s && lid + s < gl_WorkGroupSize.x) {
            float other = partial[lid + s];
            partial[lid] = take_max ? max_nan(partial[lid], other) : partial[lid] + other;
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
        float m = uintBitsToFloat(0xff800000u);  // -inf
        for (uint c = lid; c < pc.cols; c += size) {
            m = max_nan(m, X[base + c]);
        }
        m = group_reduce(m, true);
        float sum = 0.0;
        for (uint c = lid; c < pc.cols; c += size) {
            sum += exp(X[base + c] - m);
        }
        sum = group_reduce(sum, false);
        if (pc.log != 0u) {
            float log_sum = log(sum);
            for (uint c = lid; c < pc.cols; c += size) {
                Y[base + c] = (X[base + c] - m) - log_sum;
            }
        } else {
            float inv = 1.0 / sum;
            for (uint c = lid; c < pc.cols; c += size) {
                Y[base + c] = exp(X[base + c] - m) * inv;
            }
        }
    }
}
