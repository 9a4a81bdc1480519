// An Embedding table's gradient: dW[v, d] = the sum of dY[i, d] over the ids i of the batch's real
// samples (the first n = stepvals[4]) that name row v; rows no id names get 0. A scatter-add
// written as a gather, so it needs no float atomics and is deterministic: one workgroup per
// (table row, chunk of ids) (grid-stride), each thread owning columns d and walking its chunk's
// ids in order (all threads read the same id, a broadcast), adding dY only where the id matches.
// With chunks > 1 (a small vocabulary: one workgroup a row would scan every id) dW is a
// [chunks, V, D] workspace of partial sums that embedding_chunk_sum adds in chunk order; chunks
// 0 or 1 writes the table's gradient itself. Ids are clamped as the forward's.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer IdsBuf { float ids[]; };
layout(std430, set = 0, binding = 1) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 2) readonly buffer StepBuf { float stepvals[]; };
layout(std430, set = 0, binding = 3) writeonly buffer DWBuf { float dW[]; };

layout(push_constant) uniform Push {
    uint N;
    uint S;
    uint V;
    uint D;
    uint chunks;
} pc;

#include "batch_rows.glsl"
#include "embedding_row.glsl"

void main() {
    const uint real = valid_rows(stepvals[4], pc.N) * pc.S;
    const uint chunks = max(pc.chunks, 1u);
    const uint span = (pc.N * pc.S + chunks - 1u) / chunks;
    for (uint w = gl_WorkGroupID.x; w < pc.V * chunks; w += gl_NumWorkGroups.x) {
        const uint v = w % pc.V;
        const uint chunk = w / pc.V;
        const uint last = min(chunk * span + span, real);
        for (uint d = gl_LocalInvocationID.x; d < pc.D; d += gl_WorkGroupSize.x) {
            float sum = 0.0;
            for (uint i = chunk * span; i < last; ++i) {
                if (table_row(ids[i], pc.V) == v) {
                    sum += dY[i * pc.D + d];
                }
            }
            dW[w * pc.D + d] = sum;
        }
    }
}
