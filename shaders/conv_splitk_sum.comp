// dW[i] = sum over s of W[s * total + i]: finishes a convolution's split weight gradient
// (conv2d_gemm_backward_weight with k_splits > 1 left one slice of raw partial sums per split in
// the workspace W). splitk_epilogue sums a GEMM's slices in one thread per output, a serial chain
// of `splits` loads: with a convolution's small output (conv1's 32 x 9) and many slices (256)
// that chain was a third of the gradient's time. Here a workgroup takes OUTS consecutive outputs
// and LANES threads per output: lane l sums slices l, l + LANES, ... in order (loads coalesced
// along the outputs), then lane 0 adds the LANES partial sums in lane order. The order of every
// addition is fixed by (splits, LANES), so the result is deterministic (no atomics).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint OUTS = 32;
layout(constant_id = 4) const uint LANES = 8;

layout(std430, set = 0, binding = 0) readonly buffer WBuf { float W[]; };
layout(std430, set = 0, binding = 1) writeonly buffer DWBuf { float dW[]; };

layout(push_constant) uniform Push {
    uint total;  // K * C * R * S
    uint splits;
} pc;

shared float partial[OUTS * LANES];

void main() {
    const uint x = gl_LocalInvocationID.x;
    const uint lane = gl_LocalInvocationID.y;
    const uint i = gl_WorkGroupID.x * OUTS + x;
    float sum = 0.0;
    if (i < pc.total) {
        for (uint s = lane; s < pc.splits; s += LANES) {
            sum += W[s * pc.total + i];
        }
    }
    partial[lane * OUTS + x] = sum;
    barrier();
    if (lane == 0u && i < pc.total) {
        for (uint l = 1u; l < LANES; ++l) {
            sum += partial[l * OUTS + x];
        }
        dW[i] = sum;
    }
}
