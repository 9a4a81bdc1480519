// conv2d's input gradient as an implicit GEMM: dX[n,c,h,w] = sum over (k, r, s) of
// dY[n,k,oh,ow] * Wt[k,c,r,s] where oh*stride + r - pad == h (likewise w). GEMM rows m = (n, h, w)
// (M = N*H*W), columns the input channels c, reduction kk = (k, r, s) (K*R*S): A gathers dY at
// ((h + pad - r) / stride, (w + pad - s) / stride), zero where that is not whole or is outside
// the output; B is Wt[k, c, r, s] read as [(k, r, s), c]. See conv_gemm_body.glsl for the tiles.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

#include "conv2d_gemm_backward_data.glsl"
#include "conv_gemm_body.glsl"
