// An Embedding table's gradient: dW[v, d] = the sum of dY[i, d] over the ids i of the batch's real
// samples (the first n = stepvals[4]) that name row v; rows no id names get 0. A scatter-add
// written as a gather, so it needs no float atomics and is deterministic: one workgroup per
// (table row, chunk of ids) (grid-stride). The workgroup first lists, in order, the positions of
// a window of its chunk's ids that name its row (each thread checks IDS_A_THREAD ids, a prefix
// sum places them), then each thread owning columns d adds dY over the listed positions only.
// Every sum runs in id order, as when each thread walked every id itself (318 us for the char
// GPT's 84 x 384 table over 16384 ids on an H100: most of a row's ids name other rows).
// With chunks > 1 (a small vocabulary: one workgroup a row would scan every id) dW is a
// [chunks, V, D] workspace of partial sums that embedding_chunk_sum adds in chunk order; chunks
// 0 or 1 writes the table's gradient itself. Ids are clamped as the forward's.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer IdsBuf { float ids[]; };
layout(std430, set = 0, binding = 1) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 2) readonly buffer StepBuf { float stepvals[]; };
// Read back across windows by the thread that wrote it, so not writeonly.
layout(std430, set = 0, binding = 3) buffer DWBuf { float dW[]; };

layout(push_constant) uniform Push {
    uint N;
    uint S;
    uint V;
    uint D;
    uint chunks;
} pc;

#include "batch_rows.glsl"
#include "embedding_row.glsl"

const uint IDS_A_THREAD = 4u;
shared uint listed[gl_WorkGroupSize.x * IDS_A_THREAD];
shared uint counts[gl_WorkGroupSize.x];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint window = threads * IDS_A_THREAD;
    const uint real = valid_rows(stepvals[4], pc.N) * pc.S;
    const uint chunks = max(pc.chunks, 1u);
    const uint span = (pc.N * pc.S + chunks - 1u) / chunks;
    // Every loop bound below is the workgroup's alone, so every thread meets every barrier.
    for (uint w = gl_WorkGroupID.x; w < pc.V * chunks; w += gl_NumWorkGroups.x) {
        const uint v = w % pc.V;
        const uint chunk = w / pc.V;
        const uint first = chunk * span;
        const uint last = min(first + span, real);
        uint base = first;
        do {  // at least once: a chunk with no ids still writes its zeros
            uint found[IDS_A_THREAD];
            uint mine = 0u;
            for (uint k = 0u; k < IDS_A_THREAD; ++k) {
                uint i = base + tid * IDS_A_THREAD + k;
                if (i < last && table_row(ids[i], pc.V) == v) {
                    found[mine++] = i;
                }
            }
            counts[tid] = mine;
            barrier();
            for (uint step = 1u; step < threads; step <<= 1) {  // inclusive prefix sum
                uint add = tid >= step ? counts[tid - step] : 0u;
                barrier();
                counts[tid] += add;
                barrier();
            }
            const uint at = counts[tid] - mine;
            for (uint k = 0u; k < mine; ++k) {
                listed[at + k] = found[k];
            }
            const uint total = counts[threads - 1u];
            barrier();
            for (uint d = tid; d < pc.D; d += threads) {
                float sum = base == first ? 0.0 : dW[w * pc.D + d];
                for (uint j = 0u; j < total; ++j) {
                    sum += dY[listed[j] * pc.D + d];
                }
                dW[w * pc.D + d] = sum;
            }
            barrier();  // listed and counts are reused by the next window
            base += window;
        } while (base < last);
    }
}
