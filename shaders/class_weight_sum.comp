// The divisor of a class-weighted cross-entropy (PyTorch's mean): weight_sum[0] = the sum of
// weights[label] over the first n = stepvals[4] * per_sample rows' labels (a label outside
// [0, cols) adds 0), times divisor / stepvals[4] (1 on one device; under data parallelism it
// scales this shard's sum up to the global batch, stepvals[5] rows). One workgroup; the sum is a
// shared-memory tree in a fixed order.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer LabelsBuf { int labels[]; };
layout(std430, set = 0, binding = 1) readonly buffer WeightsBuf { float weights[]; };
layout(std430, set = 0, binding = 2) readonly buffer StepBuf { float stepvals[]; };
layout(std430, set = 0, binding = 3) writeonly buffer SumBuf { float weight_sum[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint per_sample;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "row_reduce.glsl"
#include "batch_rows.glsl"

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint per_sample = max(pc.per_sample, 1u);
    uint samples = valid_rows(stepvals[4], pc.rows / per_sample);
    float total = 0.0;
    for (uint row = lid; row < samples * per_sample; row += gl_WorkGroupSize.x) {
        int label = labels[row];
        if (label >= 0 && uint(label) < pc.cols) {
            total += weights[uint(label)];
        }
    }
    total = group_sum(total);
    if (lid == 0u) {
        weight_sum[0] = total * (mean_divisor(stepvals[5], samples) / float(samples));
    }
}
