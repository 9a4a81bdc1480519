// conv2d's weight gradient as an implicit GEMM: dW[k,c,r,s] = sum over (n, oh, ow) of
// dY[n,k,oh,ow] * X[n,c,ih,iw], ih = oh*stride + r - pad. GEMM rows the output channels k
// (M = K), columns (c, r, s) (N = C*R*S), reduction kk = (n, oh, ow) (N*OH*OW): A is dY viewed as
// [K, (n, oh, ow)], B the im2col matrix of X gathered on the fly. The reduction is long and the
// output small, so it is split over k_splits workgroups along z: each writes raw partial sums
// into slice z of dW viewed as [k_splits, K, C*R*S], and a splitk_epilogue launch adds them;
// with k_splits = 1 the result goes straight into dW. See conv_gemm_body.glsl for the tiles.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

#include "conv2d_gemm_backward_weight.glsl"
#include "conv_gemm_body.glsl"
