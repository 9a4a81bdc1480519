// Top-k hits over logits [rows, cols] with int32 labels [rows], of which the first
// n = stepvals[4] * per_sample are real (the rest are padding of a partial batch; per_sample as
// softmax_xent's): hits[r] = 1.0 when fewer than k logits of row r are strictly greater than the
// label's (so a tie with the k-th largest counts as right), else 0.0. A label outside [0, cols) or
// a NaN label logit is a miss; padding rows get 0. One workgroup per row, looping rows with
// stride gl_NumWorkGroups.x; a shared-memory sum of each invocation's count.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer LogitsBuf { float logits[]; };
layout(std430, set = 0, binding = 1) readonly buffer LabelsBuf { int labels[]; };
layout(std430, set = 0, binding = 2) writeonly buffer HitsBuf { float hits[]; };
layout(std430, set = 0, binding = 3) readonly buffer StepBuf { float stepvals[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint per_sample;
    uint k;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "row_reduce.glsl"
#include "batch_rows.glsl"

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint per_sample = max(pc.per_sample, 1u);
    uint n = valid_rows(stepvals[4], pc.rows / per_sample) * per_sample;
    for (uint row = gl_WorkGroupID.x; row < pc.rows; row += gl_NumWorkGroups.x) {
        int label = labels[row];
        bool valid = row < n && label >= 0 && uint(label) < pc.cols;  // uniform in the workgroup
        float picked = valid ? logits[row * pc.cols + uint(label)] : 0.0;
        float greater = 0.0;
        for (uint c = lid; valid && c < pc.cols; c += gl_WorkGroupSize.x) {
            greater += logits[row * pc.cols + c] > picked ? 1.0 : 0.0;
        }
        greater = group_sum(greater);
        if (lid == 0u) {
            hits[row] = (valid && !isnan(picked) && greater < float(pc.k)) ? 1.0 : 0.0;
        }
    }
}
