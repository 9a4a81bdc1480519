// Embedding lookup: for ids [N * S] (S ids per sample, carried as float32) and the table W [V, D],
// Y[i, d] = W[id(i), d]. An id outside [0, V) (or not a number) is clamped into range, so the
// shader never reads outside the table (a fractional id truncates); the CPU backend raises for
// either instead (actors/cpu_ops.py). Every row, padding included (a row's result depends on
// nothing else). One invocation per output value, grid-stride.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer IdsBuf { float ids[]; };
layout(std430, set = 0, binding = 1) readonly buffer WBuf { float W[]; };
layout(std430, set = 0, binding = 2) readonly buffer StepBuf { float stepvals[]; };
layout(std430, set = 0, binding = 3) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint N;  // samples in the batch
    uint S;  // ids per sample
    uint V;  // rows of the table
    uint D;  // values per row
} pc;

#include "embedding_row.glsl"

void main() {
    const uint total = pc.N * pc.S * pc.D;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint at = gl_GlobalInvocationID.x; at < total; at += stride) {
        const uint i = at / pc.D;
        Y[at] = W[table_row(ids[i], pc.V) * pc.D + (at - i * pc.D)];
    }
}
