// Y = fp16(f(X)) elementwise: f an ACT_* code (a = slope), the result rounded to float16 as cast.comp
// rounds it (half_bits.glsl: nearest even, bit for bit numpy's astype), two halves a word, element
// 2k in the low half of word k. What a unary launch and a cast would write, in one pass and with
// no fp32 f(X): mixed precision's GELU after a Linear, whose output the next Linear's GEMMs read as
// halves. One invocation per two words (four elements): with n % 4 == 0 a 16-byte load and an
// 8-byte store (one word a thread with scalar loads moved 1.5 TB/s on an H100); otherwise each
// word alone, and for odd n the high half of the last word keeps its contents.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 0) readonly buffer XBuf4 { vec4 X4[]; };
layout(std430, set = 0, binding = 1) buffer YBuf { uint Y[]; };
layout(std430, set = 0, binding = 1) buffer YBuf2 { uvec2 Y2[]; };

#include "elementwise_head.glsl"
#include "activations.glsl"
#include "half_bits.glsl"

uint half_of(float x) {
    return half_bits(floatBitsToUint(activate(x, pc.fn, pc.a)));
}

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint words = (pc.n + 1u) / 2u;
    uint pairs = (words + 1u) / 2u;
    bool vec = pc.n % 4u == 0u;
    for (uint q = gl_GlobalInvocationID.x; q < pairs; q += stride) {
        if (vec) {
            vec4 x = X4[q];
            Y2[q] = uvec2(half_of(x.x) | (half_of(x.y) << 16), half_of(x.z) | (half_of(x.w) << 16));
            continue;
        }
        for (uint w = 2u * q; w < min(2u * q + 2u, words); ++w) {
            uint lo = half_of(X[2u * w]);
            uint hi = (2u * w + 1u < pc.n) ? half_of(X[2u * w + 1u]) : (Y[w] >> 16);
            Y[w] = lo | (hi << 16);
        }
    }
}
