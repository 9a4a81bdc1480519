// Converts n elements by mode, a CAST_* code (registry CASTS): f32_to_f16, f16_to_f32, i32_to_f32
// or f32_to_i32.
// float16 is packed two per 32-bit word, element 2k in the low half of word k.
//
// The half conversions are done with integer arithmetic (half_bits.glsl), not packHalf2x16/
// unpackHalf2x16, whose rounding and denormal handling the specs leave to the driver: this way every
// device rounds to nearest-even and keeps subnormal halves, bit-identical to numpy's astype(float16).
// f32_to_f16 writes whole words (one invocation per word, so no two invocations share one); for
// odd n the high half of the last word keeps its old contents, as numpy's view assignment does.
// f32_to_i32 truncates toward zero (GLSL int()), as numpy does; out-of-range values are undefined.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "op_codes.glsl"
#include "half_bits.glsl"

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { uint X[]; };
layout(std430, set = 0, binding = 1) buffer YBuf { uint Y[]; };

layout(push_constant) uniform Push {
    uint n;
    uint mode;
} pc;

// float16 bits -> float32 bits, exact.
uint float_bits(uint h) {
    uint sign = (h & 0x8000u) << 16;
    uint e = (h >> 10) & 0x1fu;
    uint m = h & 0x3ffu;
    if (e == 0u) {
        return sign | floatBitsToUint(float(m) * 5.9604644775390625e-8);  // m * 2^-24, exact
    }
    if (e == 31u) {
        return sign | 0x7f800000u | (m << 13);
    }
    return sign | ((e + 112u) << 23) | (m << 13);
}

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint start = gl_GlobalInvocationID.x;
    if (pc.mode == CAST_F32_TO_F16) {
        uint words = (pc.n + 1u) / 2u;
        for (uint w = start; w < words; w += stride) {
            uint lo = half_bits(X[2u * w]);
            uint hi = (2u * w + 1u < pc.n) ? half_bits(X[2u * w + 1u]) : (Y[w] >> 16);
            Y[w] = lo | (hi << 16);
        }
    } else if (pc.mode == CAST_F16_TO_F32) {
        for (uint i = start; i < pc.n; i += stride) {
            uint h = (X[i >> 1] >> ((i & 1u) * 16u)) & 0xffffu;
            Y[i] = float_bits(h);
        }
    } else if (pc.mode == CAST_I32_TO_F32) {
        for (uint i = start; i < pc.n; i += stride) {
            Y[i] = floatBitsToUint(float(int(X[i])));
        }
    } else if (pc.mode == CAST_F32_TO_I32) {
        for (uint i = start; i < pc.n; i += stride) {
            Y[i] = uint(int(uintBitsToFloat(X[i])));
        }
    }
}
