// Batch normalisation's per-channel statistics, for X viewed as [N, C, HW], over the batch's
// first n = stepvals[4] rows (the real ones, batch_rows.glsl). One workgroup per channel.
//
// training = 1: the mean and the biased variance of the channel's m = n * HW values, in two passes
// (the mean, then the squared deviations from it, which cannot cancel as a sum of squares minus
// the squared sum can), written as stats[c] = mean and stats[C + c] = 1 / sqrt(var + eps); and the
// running statistics moved toward them, running = (1 - momentum) * running + momentum * batch,
// with the variance unbiased (times m / (m - 1), where m > 1), as PyTorch does.
// training = 0 (evaluation, prediction): the same two rows from the running statistics.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) buffer MeanBuf { float running_mean[]; };
layout(std430, set = 0, binding = 2) buffer VarBuf { float running_var[]; };
layout(std430, set = 0, binding = 3) writeonly buffer StatsBuf { float stats[]; };
layout(std430, set = 0, binding = 4) readonly buffer StepBuf { float stepvals[]; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint HW;
    uint training;
    float momentum;
    float eps;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "batch_rows.glsl"
#include "row_reduce.glsl"

// The j-th of channel c's values: row j / HW, pixel j % HW.
float value(uint c, uint j) {
    uint row = j / pc.HW;
    return X[(row * pc.C + c) * pc.HW + (j - row * pc.HW)];
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint m = valid_rows(stepvals[4], pc.N) * pc.HW;
    for (uint c = gl_WorkGroupID.x; c < pc.C; c += gl_NumWorkGroups.x) {
        if (pc.training == 0u) {  // uniform: no barrier is skipped by part of the group
            if (tid == 0u) {
                stats[c] = running_mean[c];
                stats[pc.C + c] = 1.0 / sqrt(running_var[c] + pc.eps);
            }
            continue;
        }
        float sum = 0.0;
        for (uint j = tid; j < m; j += threads) {
            sum += value(c, j);
        }
        float mean = group_sum(sum) / float(m);
        float squares = 0.0;
        for (uint j = tid; j < m; j += threads) {
            float d = value(c, j) - mean;
            squares += d * d;
        }
        float variance = group_sum(squares) / float(m);
        if (tid == 0u) {
            stats[c] = mean;
            stats[pc.C + c] = 1.0 / sqrt(variance + pc.eps);
            float unbiased = m > 1u ? variance * (float(m) / float(m - 1u)) : variance;
            running_mean[c] = (1.0 - pc.momentum) * running_mean[c] + pc.momentum * mean;
            running_var[c] = (1.0 - pc.momentum) * running_var[c] + pc.momentum * unbiased;
        }
    }
}
