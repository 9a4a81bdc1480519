// The pointwise losses over the first n = stepvals[4] rows of Y, T [rows, cols] (the rest are
// padding of a partial batch), each output against its own target, by fn (registry LOSSES):
//   LOSS_MSE            f = d^2, f' = 2 d                     (d = Y - T)
//   LOSS_L1             f = |d|, f' = sign(d) (0 at 0)
//   LOSS_HUBER          f = d^2 / 2 where |d| < delta, else delta (|d| - delta / 2); f' = clamp(d, -delta, delta)
//   LOSS_BCEWITHLOGITS  f = max(Y, 0) - Y T + log(1 + exp(-|Y|)), f' = sigmoid(Y) - T
// loss_rows[r] = mean_c f / divisor, so their sum is the batch mean, and when write_grad != 0,
// dY = f' / (divisor * cols) (dY is not touched otherwise, so any buffer may be bound). Padding
// rows get 0 in both. One workgroup per row, looping rows with stride gl_NumWorkGroups.x.
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
    uint fn;
    float delta;
} pc;

shared float partial[gl_WorkGroupSize.x];

#include "batch_rows.glsl"
#include "op_codes.glsl"

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

// f and f' of one output y against its target t; returns f, writes f' to grad.
float pointwise(float y, float t, out float grad) {
    float d = y - t;
    if (pc.fn == LOSS_L1) {
        grad = sign(d);
        return abs(d);
    }
    if (pc.fn == LOSS_HUBER) {
        float a = abs(d);
        grad = clamp(d, -pc.delta, pc.delta);
        return a < pc.delta ? 0.5 * d * d : pc.delta * (a - 0.5 * pc.delta);
    }
    if (pc.fn == LOSS_BCEWITHLOGITS) {
        float e = exp(-abs(y));
        // sigmoid(y) without overflow: 1 / (1 + e) for y >= 0, e / (1 + e) below.
        grad = (y >= 0.0 ? 1.0 : e) / (1.0 + e) - t;
        return max(y, 0.0) - y * t + log(1.0 + e);
    }
    grad = 2.0 * d;
    return d * d;
}

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint size = gl_WorkGroupSize.x;
    uint n = valid_rows(stepvals[4], pc.rows);
    float divisor = mean_divisor(stepvals[5], n);
    float scale = 1.0 / (divisor * float(pc.cols));
    for (uint row = gl_WorkGroupID.x; row < pc.rows; row += gl_NumWorkGroups.x) {
        uint base = row * pc.cols;
        bool real = row < n;  // uniform in the workgroup: one row per group
        float sum = 0.0;
        for (uint c = lid; c < pc.cols; c += size) {
            float grad = 0.0;
            if (real) {
                sum += pointwise(Y[base + c], T[base + c], grad);
            }
            if (pc.write_grad != 0u) {
                dY[base + c] = scale * grad;
            }
        }
        sum = group_sum(sum);
        if (lid == 0u) {
            loss_rows[row] = sum * scale;
        }
    }
}
