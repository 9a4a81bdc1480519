// dX[n,c,h,w] = sum over (k, r, s) of dY[n,k,oh,ow] * Wt[k,c,r,s] for every output position with
// oh*stride + r - pad == h (likewise w). One thread per input element gathers, so no atomics.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer WBuf { float Wt[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };

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

void main() {
    const uint total = p.N * p.C * p.H * p.W;
    const uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const int stride = int(p.stride);
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uint w = i % p.W;
        uint t = i / p.W;
        uint h = t % p.H;
        t /= p.H;
        uint c = t % p.C;
        uint n = t / p.C;
        int hp = int(h + p.pad);
        int wp = int(w + p.pad);
        float sum = 0.0;
        for (uint k = 0u; k < p.K; ++k) {
            uint ybase = (n * p.K + k) * p.OH;
            uint wbase = (k * p.C + c) * p.R;
            for (int r = 0; r < int(p.R); ++r) {
                int ohs = hp - r;
                if (ohs < 0 || ohs % stride != 0 || ohs / stride >= int(p.OH)) {
                    continue;
                }
                uint yrow = (ybase + uint(ohs / stride)) * p.OW;
                uint wrow = (wbase + uint(r)) * p.S;
                for (int s = 0; s < int(p.S); ++s) {
                    int ows = wp - s;
                    if (ows < 0 || ows % stride != 0 || ows / stride >= int(p.OW)) {
                        continue;
                    }
                    sum = fma(dY[yrow + uint(ows / stride)], Wt[wrow + uint(s)], sum);
                }
            }
        }
        dX[i] = sum;
    }
}
