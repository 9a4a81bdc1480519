// conv2d as an implicit GEMM: Y[n,k,oh,ow] = act(sum_{c,r,s} X[n,c,ih,iw] * Wt[k,c,r,s] + bias[k]),
// ih = oh*stride + r - pad (likewise iw), zero outside the input. GEMM rows m = (n, oh, ow)
// (M = N*OH*OW), columns the output channels k, reduction kk = (c, r, s) (C*R*S): A is the
// im2col matrix of X, gathered on the fly, and B is Wt viewed as [K, C*R*S]. See
// conv_gemm_body.glsl for the tiles.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

#include "conv2d_gemm.glsl"
#include "conv_gemm_body.glsl"
