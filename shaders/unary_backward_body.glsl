// The body of unary_backward.comp and unary_backward_copy.comp.
// dX = dY * f'(S) for an ACT_* code fn (a = slope). S is the forward output for relu,
// leaky_relu, sigmoid and tanh, the forward input for gelu. Codes without a derivative write NaN.
// One invocation per pair of elements (2k, 2k + 1), grid-stride. With DX_HALF_COPY defined,
// also H = dX rounded to float16 as cast.comp rounds (half_bits.glsl), two halves a word, element
// 2k in the low half of word k (mixed precision: the gradient a Linear's GEMMs read as halves,
// with no cast launch after it); for odd n the high half of the last word keeps its contents.
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer SBuf { float S[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DXBuf { float dX[]; };
#ifdef DX_HALF_COPY
#include "half_bits.glsl"
layout(std430, set = 0, binding = 3) buffer HBuf { uint H[]; };
#endif

#include "elementwise_head.glsl"
#include "activations.glsl"

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint pairs = (pc.n + 1u) / 2u;
    for (uint w = gl_GlobalInvocationID.x; w < pairs; w += stride) {
        uint i = 2u * w;
        bool second = i + 1u < pc.n;
        float lo = dY[i] * activation_derivative(S[i], pc.fn, pc.a);
        dX[i] = lo;
        float hi = 0.0;
        if (second) {
            hi = dY[i + 1u] * activation_derivative(S[i + 1u], pc.fn, pc.a);
            dX[i + 1u] = hi;
        }
#ifdef DX_HALF_COPY
        uint high = second ? half_bits(floatBitsToUint(hi)) : (H[w] >> 16);
        H[w] = half_bits(floatBitsToUint(lo)) | (high << 16);
#endif
    }
}
