// Y[n,c,oh,ow] = max of the kernel x kernel window at (oh*stride, ow*stride), no padding;
// idx = flat h*W + w of that maximum within its channel plane. The window is scanned row-major
// with a strict '>', so the first maximum wins (as in cpu_ops.maxpool2d). NaN counts above every
// number, the first NaN winning (numpy's argmax), so a NaN input gives a NaN output: a plain '>'
// is false for NaN and would skip it.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 2) writeonly buffer IdxBuf { int idx[]; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint H;
    uint W;
    uint OH;
    uint OW;
    uint kernel;
    uint stride;
} p;

void main() {
    const uint total = p.N * p.C * p.OH * p.OW;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uint ow = i % p.OW;
        uint t = i / p.OW;
        uint oh = t % p.OH;
        uint nc = t / p.OH;
        uint base = nc * p.H * p.W;
        float best = uintBitsToFloat(0xff800000u);  // -inf
        uint best_idx = 0u;
        // A valid OH/OW keeps every window inside the plane; the clip only guards bad launches.
        uint h1 = min(oh * p.stride + p.kernel, p.H);
        uint w1 = min(ow * p.stride + p.kernel, p.W);
        for (uint h = oh * p.stride; h < h1; ++h) {
            for (uint w = ow * p.stride; w < w1; ++w) {
                float v = X[base + h * p.W + w];
                if (v > best || (isnan(v) && !isnan(best))) {
                    best = v;
                    best_idx = h * p.W + w;
                }
            }
        }
        Y[i] = best;
        idx[i] = int(best_idx);
    }
}
