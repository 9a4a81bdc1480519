// dW[k,c,r,s] = sum over (n, oh, ow) of X[n,c,ih,iw] * dY[n,k,oh,ow], ih = oh*stride + r - pad.
// One workgroup per weight element (grid-stride over elements, as the count is capped); its
// threads split the (n, oh, ow) sum and reduce it in shared memory.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DWBuf { float dW[]; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint H;
    uint W;
    uint K;
    uint R;
    uint S;
    uint stride;
    uint pad;
    uint OH;
    uint OW;
    uint has_bias;
    uint act;
    float slope;
} p;

shared float partial[gl_WorkGroupSize.x];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint elements = p.K * p.C * p.R * p.S;
    const uint plane = p.OH * p.OW;
    const uint positions = p.N * plane;
    for (uint e = gl_WorkGroupID.x; e < elements; e += gl_NumWorkGroups.x) {
        uint s = e % p.S;
        uint t = e / p.S;
        uint r = t % p.R;
        t /= p.R;
        uint c = t % p.C;
        uint k = t / p.C;
        float sum = 0.0;
        for (uint j = tid; j < positions; j += threads) {
            uint ow = j % p.OW;
            uint oh = (j / p.OW) % p.OH;
            uint n = j / plane;
            int ih = int(oh * p.stride + r) - int(p.pad);
            int iw = int(ow * p.stride + s) - int(p.pad);
            if (ih < 0 || ih >= int(p.H) || iw < 0 || iw >= int(p.W)) {
                continue;
            }
            float x = X[((n * p.C + c) * p.H + uint(ih)) * p.W + uint(iw)];
            sum = fma(x, dY[(n * p.K + k) * plane + oh * p.OW + ow], sum);
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
