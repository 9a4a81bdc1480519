// The main of the in-place update kernels (sgd.glsl, adam.glsl and so their .comp variants). The
// including shader declares stepvals (lr first), P, and with CLIP clip, with HALVES H (and includes
// half_bits.glsl), then defines
//     float updated(uint i, float lr, float scale)
// which updates parameter i in place (its gradient times scale) and returns its new value.
// With CLIP a step whose clip[2] is set (loss scaling found an overflow) changes nothing; with
// HALVES each invocation updates the two parameters of a word of H and writes their float16
// copies (for odd n the high half of the last word keeps its contents, as cast.comp's does).
#ifndef VKFLOW_UPDATE_LOOP_GLSL
#define VKFLOW_UPDATE_LOOP_GLSL

void main() {
    float lr = stepvals[0];
    float scale = 1.0;
#ifdef CLIP
    if (clip[2] != 0.0) {
        return;  // loss scaling found the gradients overflowed: this step changes nothing
    }
    scale = clip[1];
#endif
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
#ifdef HALVES
    for (uint w = gl_GlobalInvocationID.x; w < (pc.n + 1u) / 2u; w += stride) {
        uint lo = half_bits(floatBitsToUint(updated(2u * w, lr, scale)));
        uint hi = 2u * w + 1u < pc.n ? half_bits(floatBitsToUint(updated(2u * w + 1u, lr, scale))) : H[w] >> 16;
        H[w] = lo | (hi << 16);
    }
#else
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        updated(i, lr, scale);
    }
#endif
}

#endif
