// Fused softmax + cross-entropy over logits [rows, cols] with int32 labels [rows], of which the
// first n = stepvals[4] * per_sample are real (the rest are padding of a partial batch; per_sample
// > 1 for a cross-entropy per position, such as a language model's per token, where n counts
// positions and the loss divides by the divisor stepvals[5] times per_sample):
//   loss_rows[r] = (log(sum_c exp(x_c - max)) - (x_label - max)) / n, so their sum is the mean
//   correct_rows[r] = 1.0 if the FIRST maximum of the row is at label, else 0.0 (numpy argmax)
//   dlogits = (softmax - onehot(label)) / n, only when write_grad != 0 (dlogits is not
//   touched otherwise, so any buffer may be bound there).
// Padding rows get 0 in all three.
// A label outside [0, cols) gives a NaN loss, correct 0 and a gradient without the one-hot term.
// One workgroup per row, looping rows with stride gl_NumWorkGroups.x; shared-memory trees.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer LogitsBuf { float logits[]; };
layout(std430, set = 0, binding = 1) readonly buffer LabelsBuf { int labels[]; };
layout(std430, set = 0, binding = 2) writeonly buffer LossBuf { float loss_rows[]; };
layout(std430, set = 0, binding = 3) writeonly buffer CorrectBuf { float correct_rows[]; };
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
    uint size = gl_WorkGroupSize.x;
    uint per_sample = max(pc.per_sample, 1u);
    uint samples = valid_rows(stepvals[4], pc.rows / per_sample);
    uint n = samples * per_sample;
    float scale = 1.0 / (mean_divisor(stepvals[5], samples) * float(per_sample));
    for (uint row = gl_WorkGroupID.x; row < pc.rows; row += gl_NumWorkGroups.x) {
        uint base = row * pc.cols;
        if (row >= n) {
            if (lid == 0u) {
                loss_rows[row] = 0.0;
                correct_rows[row] = 0.0;
            }
            if (pc.write_grad != 0u) {
                for (uint c = lid; c < pc.cols; c += size) {
                    dlogits[base + c] = 0.0;
                }
            }
            continue;
        }
        float m = uintBitsToFloat(0xff800000u);  // -inf
        uint best = NO_INDEX;
        // Ascending columns per invocation, so keeping strict winners keeps the first maximum.
        for (uint c = lid; c < pc.cols; c += size) {
            float x = logits[base + c];
            if (beats(x, c, m, best)) {
                m = x;
                best = c;
            }
        }
        group_argmax(m, best);
        float sum = 0.0;
        for (uint c = lid; c < pc.cols; c += size) {
            sum += exp(logits[base + c] - m);
        }
        sum = group_sum(sum);
        int label = labels[row];
        bool valid = label >= 0 && uint(label) < pc.cols;
        if (lid == 0u) {
            float log_sum = log(sum);
            loss_rows[row] = valid ? scale * (log_sum - (logits[base + uint(label)] - m)) : uintBitsToFloat(0x7fc00000u);
            correct_rows[row] = (valid && best == uint(label)) ? 1.0 : 0.0;
        }
        if (pc.write_grad != 0u) {
            float inv = 1.0 / sum;
            for (uint c = lid; c < pc.cols; c += size) {
                float p = exp(logits[base + c] - m) * inv;
                if (valid && c == uint(label)) {
                    p -= 1.0;
                }
                dlogits[base + c] = scale * p;
            }
        }
    }
}
