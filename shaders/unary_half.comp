// Y = fp16(f(X)) elementwise: f an ACT_* code (a = slope), the result rounded to float16 as cast.comp
// rounds it (half_bits.glsl: nearest even, bit for bit numpy's astype), two halves a word, element
// 2k in the low half of word k. What a unary launch and a cast would write, in one pass and with
// no fp32 f(X): mixed precision's GELU after a Linear, whose output the next Linear's GEMMs read as
// halves. One invocation per word; for odd n the high half of the last word keeps its contents.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) buffer YBuf { uint Y[]; };

#include "elementwise_head.glsl"
#include "activations.glsl"
#include "half_bits.glsl"

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint words = (pc.n + 1u) / 2u;
    for (uint w = gl_GlobalInvocationID.x; w < words; w += stride) {
        uint lo = half_bits(floatBitsToUint(activate(X[2u * w], pc.fn, pc.a)));
        uint hi = (2u * w + 1u < pc.n) ? half_bits(floatBitsToUint(activate(X[2u * w + 1u], pc.fn, pc.a)))
                                       : (Y[w] >> 16);
        Y[w] = lo | (hi << 16);
    }
}
