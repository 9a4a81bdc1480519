// C[M,N] = act(alpha * sum_s W[s,M,N] + (accumulate ? C : 0) + bias[N]): finishes a split-K gemm,
// whose launch left one slice of raw partial sums per K split in the workspace W.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer WBuf { float W[]; };
layout(std430, set = 0, binding = 1) readonly buffer BiasBuf { float bias[]; };
layout(std430, set = 0, binding = 2) buffer CBuf { float C[]; };

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

void main() {
    const uint total = pc.M * pc.N;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += stride) {
        float sum = 0.0;
        for (uint s = 0u; s < pc.splits; ++s) {
            sum += W[s * total + i];
        }
        // Same order as gemm's epilogue: scale, then the old C, then the bias, then act.
        float v = sum * pc.alpha;
        if (pc.accumulate != 0u) {
            v += C[i];
        }
        if (pc.has_bias != 0u) {
            v += bias[i % pc.N];
        }
        C[i] = vk_activate(v, pc.act, pc.slope);
    }
}
