// C[M,N] = act(alpha * sum_s W[s,M,N] + (accumulate ? C : 0) + bias[N]): finishes a split-K gemm,
// whose launch left one slice of raw partial sums per K split in the workspace W. One invocation
// per four outputs: with N % 4 == 0 16-byte loads, and the slices summed two at a time into two
// running sums (even and odd slices, joined at the end), so that two loads are in flight (one
// scalar load a slice after another took 12 us a weight gradient on an H100); otherwise each of
// the four alone, in slice order.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer WBuf { float W[]; };
layout(std430, set = 0, binding = 0) readonly buffer WBuf4 { vec4 W4[]; };
layout(std430, set = 0, binding = 1) readonly buffer BiasBuf { float bias[]; };
layout(std430, set = 0, binding = 1) readonly buffer BiasBuf4 { vec4 bias4[]; };
layout(std430, set = 0, binding = 2) buffer CBuf { float C[]; };
layout(std430, set = 0, binding = 2) buffer CBuf4 { vec4 C4[]; };

layout(push_constant) uniform Push {
    uint M;
    uint N;
    uint splits;
    uint has_bias;
    uint act;
    uint accumulate;
    float alpha;
    float slope;
} pc;

#include "common_gemm_act.glsl"

// Same order as gemm's epilogue: scale, then the old C, then the bias, then act.
float finish(float sum, uint i) {
    float v = sum * pc.alpha;
    if (pc.accumulate != 0u) {
        v += C[i];
    }
    if (pc.has_bias != 0u) {
        v += bias[i % pc.N];
    }
    return vk_activate(v, pc.act, pc.slope);
}

void main() {
    const uint total = pc.M * pc.N;
    const uint quads = (total + 3u) / 4u;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    const bool vec = pc.N % 4u == 0u;
    for (uint q = gl_GlobalInvocationID.x; q < quads; q += stride) {
        if (vec) {
            const uint tq = total / 4u;
            vec4 even = vec4(0.0);
            vec4 odd = vec4(0.0);
            uint s = 0u;
            for (; s + 1u < pc.splits; s += 2u) {
                even += W4[s * tq + q];
                odd += W4[(s + 1u) * tq + q];
            }
            if (s < pc.splits) {
                even += W4[s * tq + q];
            }
            vec4 v = (even + odd) * pc.alpha;
            if (pc.accumulate != 0u) {
                v += C4[q];
            }
            if (pc.has_bias != 0u) {
                v += bias4[(4u * q) % pc.N / 4u];
            }
            C4[q] = vec4(vk_activate(v.x, pc.act, pc.slope), vk_activate(v.y, pc.act, pc.slope),
                         vk_activate(v.z, pc.act, pc.slope), vk_activate(v.w, pc.act, pc.slope));
            continue;
        }
        for (uint i = 4u * q; i < min(4u * q + 4u, total); ++i) {
            float sum = 0.0;
            for (uint s = 0u; s < pc.splits; ++s) {
                sum += W[s * total + i];
            }
            C[i] = finish(sum, i);
        }
    }
}
