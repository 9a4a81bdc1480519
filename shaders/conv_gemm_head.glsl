// The push block and tile constants of the implicit-GEMM convolutions (conv2d_gemm.comp,
// conv2d_gemm_backward_data.comp, conv2d_gemm_backward_weight.comp): the direct convolutions'
// fields (conv_head.glsl, in the same order, so a layer's launches take the same parameters)
// plus k_splits, read by the weight gradient only. The tile constants are gemm.comp's (tune_conv
// in shaders/tiles.py chooses them); ACT is the forward's activation, compiled in alone.
#ifndef VKFLOW_CONV_GEMM_HEAD_GLSL
#define VKFLOW_CONV_GEMM_HEAD_GLSL

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint BM = 64;
layout(constant_id = 4) const uint BN = 64;
layout(constant_id = 5) const uint BK = 16;
#ifdef CONV_COOPMAT
// The tensor-core variants (conv_gemm_coopmat_body.glsl): a WM x WN warp tile per subgroup of SG.
layout(constant_id = 6) const uint WM = 32;
layout(constant_id = 7) const uint WN = 32;
layout(constant_id = 9) const uint SG = 32;
#else
layout(constant_id = 6) const uint TM = 4;
layout(constant_id = 7) const uint TN = 4;
#endif
layout(constant_id = 8) const uint ACT = 0;

#define CONV_PUSH_EXTRA uint k_splits;
#include "conv_head.glsl"

#endif
