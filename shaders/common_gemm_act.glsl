// Activation epilogue shared by gemm.comp and conv2d.comp; codes follow registry.ACTIVATIONS.
// tanh and erf are written out rather than taken from the built-ins: the Vulkan precision rules
// for tanh are loose (drivers may cancel catastrophically near 0 or return NaN for large |x|),
// and GLSL has no erf at all.

const uint ACT_NONE = 0u;
const uint ACT_RELU = 1u;
const uint ACT_LEAKY_RELU = 2u;
const uint ACT_SIGMOID = 3u;
const uint ACT_TANH = 4u;
const uint ACT_GELU = 5u;

// tanh to ~2.5e-7 relative: an odd Taylor polynomial near 0, where (1-t)/(1+t) would cancel.
float vk_tanh(float x) {
    float a = abs(x);
    if (a < 0.3) {
        float x2 = x * x;
        return x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0
                 + x2 * (62.0 / 2835.0 + x2 * (-1382.0 / 155925.0))))));
    }
    float t = exp(-2.0 * a);
    float r = (1.0 - t) / (1.0 + t);
    return x < 0.0 ? -r : r;
}

// erfc with fractional error below 1.2e-7 in exact arithmetic (Numerical Recipes' Chebyshev
// fit), so the tail 1 + erf(x) = erfc(-x) keeps its relative accuracy for negative x.
float vk_erfc(float z) {
    float a = abs(z);
    float t = 1.0 / (1.0 + 0.5 * a);
    float poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418
               + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587
               + t * (-0.82215223 + t * 0.17087277))))))));
    float r = t * exp(-a * a + poly);
    return z >= 0.0 ? r : 2.0 - r;
}

float vk_activate(float x, uint code, float slope) {
    if (code == ACT_RELU) {
        return max(x, 0.0);
    } else if (code == ACT_LEAKY_RELU) {
        return x > 0.0 ? x : x * slope;
    } else if (code == ACT_SIGMOID) {
        return 1.0 / (1.0 + exp(-x));
    } else if (code == ACT_TANH) {
        return vk_tanh(x);
    } else if (code == ACT_GELU) {
        // 0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2)
        return 0.5 * x * vk_erfc(-x * 0.70710678118654752);
    }
    return x;
}
