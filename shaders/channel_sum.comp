// db[k] = sum over n and the HW spatial positions of dY[n,k,:] (dY viewed as [N, K, HW]).
// One workgroup per channel (grid-stride over channels, as the count is capped); its threads
// split the sum and reduce it in shared memory.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) writeonly buffer DBBuf { float db[]; };

layout(push_constant) uniform Push {
    uint N;
    uint K;
    uint HW;
} pc;

shared float partial[gl_WorkGroupSize.x];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint count = pc.N * pc.HW;
    for (uint k = gl_WorkGroupID.x; k < pc.K; k += gl_NumWorkGroups.x) {
        float sum = 0.0;
        for (uint j = tid; j < count; j += threads) {
            uint n = j / pc.HW;
            uint q = j - n * pc.HW;
            sum += dY[(n * pc.K + k) * pc.HW + q];
        }
        partial[tid] = sum;
        barrier();
        for (uint width = threads; width > 1u;) {
            uint upper = (width + 1u) / 2u;
            if (tid < width - upper) {
                partial[tid] += partial[tid + upper];
            }
            barrier();
            width = upper;
        }
        if (tid == 0u) {
            db[k] = partial[0];
        }
        barrier();
    }
}
