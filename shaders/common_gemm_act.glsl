// Epilogue helpers of the GEMM and convolution shaders: the activation (vk_activate) and, for a
// gradient GEMM, the derivative of the previous layer's activation (activation_derivative), both
// from activations.glsl so every op shares one definition of each function.
#ifndef VKFLOW_COMMON_GEMM_ACT_GLSL
#define VKFLOW_COMMON_GEMM_ACT_GLSL

#include "activations.glsl"

float vk_activate(float x, uint code, float slope) {
    return code == ACT_NONE ? x : activate(x, code, slope);
}

#endif
