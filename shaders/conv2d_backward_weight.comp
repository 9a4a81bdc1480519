// dW[k,c,r,s] = sum over (n, oh, ow) of X[n,c,ih,iw] * dY[n,k,oh,ow], ih = oh*stride + r - pad.
// One workgroup per weight element (grid-stride over elements, as the count is capped); its
// threads split the (n, oh, ow) sum and reduce it in shared memory.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DWBuf { float dW[]; };

#include "conv_head.glsl"

shared float partial[gl_WorkGroupSize.x];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint elements = pc.K * pc.C * pc.R * pc.S;
    const uint plane = pc.OH * pc.OW;
    const uint positions = pc.N * plane;
    for (uint e = gl_WorkGroupID.x; e < elements; e += gl_NumWorkGroups.x) {
        uvec4 at = nchw_coords(e, pc.C, pc.R, pc.S);
        uint k = at.x;
        uint c = at.y;
        uint r = at.z;
        uint s = at.w;
        float sum = 0.0;
        for (uint j = tid; j < positions; j += threads) {
            uint ow = j % pc.OW;
            uint oh = (j / pc.OW) % pc.OH;
            uint n = j / plane;
            int ih = int(oh * pc.stride + r) - int(pad_h());
            int iw = int(ow * pc.stride + s) - int(pc.pad);
            if (ih < 0 || ih >= int(pc.H) || iw < 0 || iw >= int(pc.W)) {
                continue;
            }
            float x = X[((n * pc.C + c) * pc.H + uint(ih)) * pc.W + uint(iw)];
            sum = fma(x, dY[(n * pc.K + k) * plane + oh * pc.OW + ow], sum);
        }
        partial[tid] = sum;
        barrier();
        // Halving tree that also works when the workgroup size is not a power of two.
        for (uint width = threads; width > 1u;) {
            uint upper = (width + 1u) / 2u;
            if (tid < width - upper) {
                partial[tid] += partial[tid + upper];
            }
            barrier();
            width = upper;
        }
        if (tid == 0u) {
            dW[e] = partial[0];
        }
        // partial[0] must be read before the next element overwrites it.
        barrier();
    }
}
