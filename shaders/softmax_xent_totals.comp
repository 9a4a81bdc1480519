// softmax_xent for narrow logits (a classifier's few classes), with the batch totals fused in,
// over the first n = stepvals[4] * per_sample rows of the batch (the rest are padding of a partial
// batch; per_sample > 1 for a cross-entropy per position, such as a language model's per token):
//   loss[0] = (1 / n) * sum_{r<n} (log(sum_c exp(x_rc - max_r)) - (x_r,label - max_r))
//   correct[0] = number of rows r < n whose FIRST maximum is at the label (numpy argmax), divided
//   by per_sample (so correct / samples is the fraction of positions right)
//   dlogits = (softmax - onehot(label)) / n for r < n and 0 for padding rows, when write_grad != 0.
// Same per-row semantics as softmax_xent.comp (a label outside [0, cols) gives a NaN loss and
// counts as wrong), but one workgroup does it all: each invocation owns whole rows (its columns
// in a serial loop, which is cheap when cols is small) and the totals come from one shared-memory
// tree in a fixed order. That replaces three launches (the rows, then a sum of losses and a sum
// of correct flags) with one; the plan uses it only when the rows are narrow.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer LogitsBuf { float logits[]; };
layout(std430, set = 0, binding = 1) readonly buffer LabelsBuf { int labels[]; };
layout(std430, set = 0, binding = 2) writeonly buffer LossBuf { float loss[]; };
layout(std430, set = 0, binding = 3) writeonly buffer CorrectBuf { float correct[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DLogitsBuf { float dlogits[]; };
layout(std430, set = 0, binding = 5) readonly buffer StepBuf { float stepvals[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint write_grad;
    uint per_sample;  // rows a sample: one a position of its output's leading dims (1 for a flat one)
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "row_reduce.glsl"
#include "batch_rows.glsl"

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint per_sample = max(pc.per_sample, 1u);
    uint samples = valid_rows(stepvals[4], pc.rows / per_sample);
    uint n = samples * per_sample;
    float scale = 1.0 / (mean_divisor(stepvals[5], samples) * float(per_sample));
    float loss_sum = 0.0;
    float correct_sum = 0.0;
    for (uint row = lid; row < pc.rows; row += gl_WorkGroupSize.x) {
        uint base = row * pc.cols;
        if (row >= n) {
            // Padding: no loss, and a zero gradient so its rows add nothing to dW and db.
            if (pc.write_grad != 0u) {
                for (uint c = 0u; c < pc.cols; ++c) {
                    dlogits[base + c] = 0.0;
                }
            }
            continue;
        }
        float m = uintBitsToFloat(0xff800000u);  // -inf
        uint best = NO_INDEX;
        for (uint c = 0u; c < pc.cols; ++c) {
            float x = logits[base + c];
            if (beats(x, c, m, best)) {
                m = x;
                best = c;
            }
        }
        float sum = 0.0;
        for (uint c = 0u; c < pc.cols; ++c) {
            sum += exp(logits[base + c] - m);
        }
        int label = labels[row];
        bool valid = label >= 0 && uint(label) < pc.cols;
        loss_sum += valid ? log(sum) - (logits[base + uint(label)] - m) : uintBitsToFloat(0x7fc00000u);
        correct_sum += (valid && best == uint(label)) ? 1.0 : 0.0;
        if (pc.write_grad != 0u) {
            float inv = 1.0 / sum;
            for (uint c = 0u; c < pc.cols; ++c) {
                float p = exp(logits[base + c] - m) * inv;
                if (valid && c == uint(label)) {
                    p -= 1.0;
                }
                dlogits[base + c] = scale * p;
            }
        }
    }
    loss_sum = group_sum(loss_sum);
    correct_sum = group_sum(correct_sum);
    if (lid == 0u) {
        loss[0] = scale * loss_sum;
        correct[0] = correct_sum / float(per_sample);  // in samples: correct / rows is per position
    }
}
