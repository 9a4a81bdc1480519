// Activation functions and their derivatives, shared by the unary ops and the GEMM/conv epilogues.
// Include with:
//     #extension GL_GOOGLE_include_directive : require
//     #include "activations.glsl"
// Codes are the ACT_* names that the compiler generates from shaders/registry.py ACTIVATIONS
// (none, relu, leaky_relu, sigmoid, tanh and gelu, exact and erf-based). Semantics match
// actors/cpu_ops.py activate / activation_derivative.
//
// NaN in gives NaN out, forward and backward, as in numpy: GLSL leaves max() undefined for a NaN
// operand (lavapipe's max(NaN, 0.0) is 0) and a comparison with NaN is false, so each function
// tests isnan first. Without it a NaN input row came out of a relu model as finite probabilities
// on Vulkan but NaN on the CPU backend.
//
// GLSL has no erf, and drivers implement tanh from exp with cancellation near zero, so both are
// written here to about 1 ulp in fp32 (erf: max abs error 6e-8 over the reals; tanh: relative
// error < 1.5e-7), the same on every driver.

#ifndef VKFLOW_ACTIVATIONS_GLSL
#define VKFLOW_ACTIVATIONS_GLSL

#include "op_codes.glsl"

// Not ACT_*: that prefix belongs to the generated codes.
const float GELU_SQRT_HALF = 0.70710678118654752;
const float GELU_INV_SQRT_2PI = 0.39894228040143268;

// Unknown codes give NaN, the shader's way of raising: a wrong code is loud, never silently zero.
float act_nan() {
    return uintBitsToFloat(0x7fc00000u);
}

// erfc(t) for t > 0.927734375, as exp(poly(t)): accurate where 1 - erf(t) would cancel.
float erfc_tail(float t) {
    float s = t * t;
    float r = fma(-1.72853470e-5, t, 3.83197126e-4);
    float u = fma(-3.88396438e-3, t, 2.42546219e-2);
    r = fma(r, s, u);
    r = fma(r, t, -1.06777877e-1);
    r = fma(r, t, -6.34846687e-1);
    r = fma(r, t, -1.28717512e-1);
    r = fma(r, t, -t);
    return exp(r);
}

// erf(x), max abs error about 6e-8 (minimax fits after N. Juffa; two ranges).
float erf_approx(float x) {
    float t = abs(x);
    if (t > 0.927734375) {
        return sign(x) * (1.0 - erfc_tail(t));
    }
    float s = x * x;
    float r = -5.96761703e-4;
    r = fma(r, s, 4.99119423e-3);
    r = fma(r, s, -2.67681349e-2);
    r = fma(r, s, 1.12819925e-1);
    r = fma(r, s, -3.76125336e-1);
    r = fma(r, s, 1.28379166e-1);
    return fma(r, x, x);
}

// Phi(x) = 0.5 * (1 + erf(x / sqrt(2))), computed from erfc in the lower tail so it keeps
// relative accuracy there.
float normal_cdf(float x) {
    float z = x * GELU_SQRT_HALF;
    if (z < -0.927734375) {
        return 0.5 * erfc_tail(-z);
    }
    return 0.5 * (1.0 + erf_approx(z));
}

// tanh with relative error < 1.5e-7: an odd polynomial near zero, 1 - 2 / (e^2t + 1) beyond.
float tanh_accurate(float x) {
    float t = abs(x);
    if (t >= 0.6) {
        // exp overflows to inf for t > 44, which gives exactly 1.
        return sign(x) * (1.0 - 2.0 / (exp(2.0 * t) + 1.0));
    }
    float s = x * x;
    float r = 0.002232965547591448;
    r = fma(r, s, -0.008269392885267735);
    r = fma(r, s, 0.021735496819019318);
    r = fma(r, s, -0.05395270138978958);
    r = fma(r, s, 0.1333325058221817);
    r = fma(r, s, -0.3333333134651184);
    r = r * s;
    return fma(r, x, x);
}

float activate(float x, uint code, float slope) {
    if (isnan(x)) {
        return x;
    }
    switch (code) {
        case ACT_NONE:
            return x;
        case ACT_RELU:
            return max(x, 0.0);  // x is not NaN here
        case ACT_LEAKY_RELU:
            return x > 0.0 ? x : x * slope;
        case ACT_SIGMOID:
            return 1.0 / (1.0 + exp(-x));
        case ACT_TANH:
            return tanh_accurate(x);
        case ACT_GELU:
            return x * normal_cdf(x);
        default:
            return act_nan();
    }
}

// f'(.) from the saved tensor: the forward OUTPUT for relu, leaky_relu, sigmoid and tanh, the
// forward INPUT for gelu (its derivative cannot be recovered from the output).
float activation_derivative(float saved, uint code, float slope) {
    // f' at NaN is NaN (relu's and leaky_relu's comparisons would say 0 or slope); none's stays 1.
    if (isnan(saved) && code != ACT_NONE) {
        return saved;
    }
    switch (code) {
        case ACT_NONE:
            return 1.0;
        case ACT_RELU:
            return saved > 0.0 ? 1.0 : 0.0;
        case ACT_LEAKY_RELU:
            return saved > 0.0 ? 1.0 : slope;
        case ACT_SIGMOID:
            return saved * (1.0 - saved);
        case ACT_TANH:
            // Factored, so it keeps relative accuracy where tanh saturates (1 - s is exact there).
            return (1.0 - saved) * (1.0 + saved);
        case ACT_GELU:
            return normal_cdf(saved) + saved * exp(-0.5 * saved * saved) * GELU_INV_SQRT_2PI;
        default:
            return act_nan();
    }
}

#endif
