// float32 bits -> float16 bits, rounded to nearest even with integer arithmetic, not packHalf2x16,
// whose rounding and denormal handling the specs leave to the driver: every device gives numpy's
// astype(float16) bit for bit (subnormal halves kept, >= 65520 to inf, NaN kept quiet with the top
// of its payload). cast.comp and the GEMM epilogues that write a float16 copy of their output
// (gemm_coopmat_copy.comp) share it, so a copy is the same whichever kernel writes it.
#ifndef VKFLOW_HALF_BITS_GLSL
#define VKFLOW_HALF_BITS_GLSL

uint half_bits(uint x) {
    uint sign = (x >> 16) & 0x8000u;
    uint a = x & 0x7fffffffu;
    // The common cases first, each a single test, so that a warp whose values are all normal halves
    // or zeros takes one short path: a GEMM epilogue writing 25M halves took 176.8 us on an H100
    // with the cases tested in order of magnitude, 164.1 us so, and 134.4 us with packHalf2x16
    // (whose rounding is the driver's: bench/RESULTS.md, session 15).
    if (a - 0x38800000u < 0x477ff000u - 0x38800000u) {
        // Normal half (2^-14 <= |x| < 65520): add the rounding bias (ties to even), then rebias the
        // exponent 127 -> 15.
        uint r = a + 0xfffu + ((a >> 13) & 1u);
        return sign | ((r >> 13) - 0x1c000u);
    }
    if (a == 0u) {
        return sign;
    }
    if (a >= 0x7f800000u) {
        // inf stays inf; NaN stays a (quiet) NaN with the top of its payload, as numpy keeps it.
        return a == 0x7f800000u ? sign | 0x7c00u : sign | 0x7e00u | ((a >> 13) & 0x3ffu);
    }
    if (a >= 0x477ff000u) {
        return sign | 0x7c00u;  // >= 65520 rounds to inf
    }
    // Subnormal half: the value in units of 2^-24. The scaling is exact and roundEven rounds ties
    // to even; a result of 1024 is correctly the smallest normal half.
    float units = uintBitsToFloat(a) * 16777216.0;
    return sign | uint(roundEven(units));
}

// Two floats as one word of halves, the first in the low bits (the order numpy's view gives).
uint half_pair(float lo, float hi) {
    return half_bits(floatBitsToUint(lo)) | (half_bits(floatBitsToUint(hi)) << 16);
}

#endif
