// softmax_xent with PyTorch's label smoothing and class weights (CrossEntropyLoss(weight, label_
// smoothing), mean reduction), over the first n = stepvals[4] * per_sample rows of logits
// [rows, cols] with int32 labels [rows] (the rest are padding of a partial batch). With
// s = smoothing, w_c the class weights (all 1 unless weighted), y a row's label and
// L_c = -log softmax_c:
//   row loss = (1 - s) w_y L_y + (s / cols) sum_c w_c L_c
//   loss_rows[r] = row loss * scale, scale = 1 / weight_sum[0] when weighted (class_weight_sum's
//     sum of the real rows' w_y), else 1 / (stepvals[5] * per_sample) as softmax_xent
//   dlogits[c] = scale * (((1 - s) w_y + (s / cols) sum_k w_k) p_c - (1 - s) w_y [c == y] - (s / cols) w_c)
//   correct_rows[r] = 1.0 if the FIRST maximum of the row is at its label
// Padding rows get 0 in all three; a label outside [0, cols) gives a NaN loss, correct 0, w_y = 1
// and no one-hot term. weights and weight_sum are only read when weighted (bind anything else).
// One workgroup per row, looping rows with stride gl_NumWorkGroups.x; shared-memory trees.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer LogitsBuf { float logits[]; };
layout(std430, set = 0, binding = 1) readonly buffer LabelsBuf { int labels[]; };
layout(std430, set = 0, binding = 2) readonly buffer WeightsBuf { float weights[]; };
layout(std430, set = 0, binding = 3) readonly buffer WeightSumBuf { float weight_sum[]; };
layout(std430, set = 0, binding = 4) writeonly buffer LossBuf { float loss_rows[]; };
layout(std430, set = 0, binding = 5) writeonly buffer CorrectBuf { float correct_rows[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DLogitsBuf { float dlogits[]; };
layout(std430, set = 0, binding = 7) readonly buffer StepBuf { float stepvals[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint write_grad;
    uint per_sample;
    uint weighted;
    float smoothing;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "row_reduce.glsl"
#include "batch_rows.glsl"

float class_weight(uint c) {
    return pc.weighted != 0u ? weights[c] : 1.0;
}

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint size = gl_WorkGroupSize.x;
    uint per_sample = max(pc.per_sample, 1u);
    uint samples = valid_rows(stepvals[4], pc.rows / per_sample);
    uint n = samples * per_sample;
    float scale = pc.weighted != 0u ? 1.0 / weight_sum[0]
                                    : 1.0 / (mean_divisor(stepvals[5], samples) * float(per_sample));
    float s = pc.smoothing;
    float spread = s / float(pc.cols);
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
        for (uint c = lid; c < pc.cols; c += size) {
            float x = logits[base + c];
            if (beats(x, c, m, best)) {
                m = x;
                best = c;
            }
        }
        group_argmax(m, best);
        float sum = 0.0;
        float weighted_shift = 0.0;  // sum_c w_c (x_c - m)
        float weight_total = 0.0;    // sum_c w_c
        for (uint c = lid; c < pc.cols; c += size) {
            float shifted = logits[base + c] - m;
            sum += exp(shifted);
            float w = class_weight(c);
            weighted_shift += w * shifted;
            weight_total += w;
        }
        sum = group_sum(sum);
        weighted_shift = group_sum(weighted_shift);
        weight_total = group_sum(weight_total);
        int label = labels[row];
        bool valid = label >= 0 && uint(label) < pc.cols;
        float wy = valid ? class_weight(uint(label)) : 1.0;
        if (lid == 0u) {
            float log_sum = log(sum);
            float picked = valid ? log_sum - (logits[base + uint(label)] - m) : 0.0;
            float row_loss = (1.0 - s) * wy * picked + spread * (weight_total * log_sum - weighted_shift);
            loss_rows[row] = valid ? scale * row_loss : uintBitsToFloat(0x7fc00000u);
            correct_rows[row] = (valid && best == uint(label)) ? 1.0 : 0.0;
        }
        if (pc.write_grad != 0u) {
            float inv = 1.0 / sum;
            float mass = (1.0 - s) * wy + spread * weight_total;
            for (uint c = lid; c < pc.cols; c += size) {
                float g = mass * exp(logits[base + c] - m) * inv - spread * class_weight(c);
                if (valid && c == uint(label)) {
                    g -= (1.0 - s) * wy;
                }
                dlogits[base + c] = scale * g;
            }
        }
    }
}
