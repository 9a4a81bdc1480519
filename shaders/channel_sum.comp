// A convolution's bias gradient: db[k] = sum over n and the HW spatial positions of dY[n,k,:]
// (dY viewed as [N, K, HW]). With a few channels over many positions (conv1: 32 channels, each a
// sum of 256 x 784 values) one workgroup per channel leaves most of a GPU idle and each thread
// with a long serial chain of loads, so the samples are split into `parts` slices: workgroup
// (k, p) sums channel k over its slice of samples, with ACCS independent running sums a thread (so
// several loads are in flight), into out[p * K + k]. parts = 1 writes db itself; otherwise
// conv_splitk_sum adds the slices in order. Every addition's order is fixed by (N, HW, parts, the
// workgroup size), so the result is deterministic (no atomics).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) writeonly buffer OutBuf { float outs[]; };

layout(push_constant) uniform Push {
    uint N;
    uint K;
    uint HW;
    uint parts;
} pc;

const uint ACCS = 4u;

shared float partial[gl_WorkGroupSize.x];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint p = gl_WorkGroupID.y;
    const uint per_part = (pc.N + pc.parts - 1u) / pc.parts;
    const uint n0 = p * per_part;
    const uint n1 = min(pc.N, n0 + per_part);
    const uint count = n1 > n0 ? (n1 - n0) * pc.HW : 0u;
    // Grid-stride over the channels: their count may pass the workgroup limit.
    for (uint k = gl_WorkGroupID.x; k < pc.K; k += gl_NumWorkGroups.x) {
        float sums[ACCS];
        for (uint a = 0u; a < ACCS; ++a) {
            sums[a] = 0.0;
        }
        // Element j of the slice is (n0 + j / HW, j % HW); ACCS elements a thread per round.
        for (uint base = 0u; base < count; base += threads * ACCS) {
            for (uint a = 0u; a < ACCS; ++a) {
                uint j = base + a * threads + tid;
                if (j < count) {
                    uint n = n0 + j / pc.HW;
                    uint q = j - (n - n0) * pc.HW;
                    sums[a] += dY[(n * pc.K + k) * pc.HW + q];
                }
            }
        }
        float sum = sums[0];
        for (uint a = 1u; a < ACCS; ++a) {
            sum += sums[a];
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
            outs[p * pc.K + k] = partial[0];
        }
        barrier();  // partial is reused by the next channel
    }
}
