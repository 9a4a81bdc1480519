// The push block and index math of the NCHW convolution shaders: conv2d, conv2d_backward_data and
// conv2d_backward_weight. The registry gives all three one push layout (_CONV_PUSH) so a layer's
// forward and backward launches take the same parameters; has_bias, act and slope are read by the
// forward only. The implicit-GEMM convolutions take one field more (k_splits): they define
// CONV_PUSH_EXTRA to its declaration before including this header, so the shared fields stay in
// one place, in the registry's order.
#ifndef VKFLOW_CONV_HEAD_GLSL
#define VKFLOW_CONV_HEAD_GLSL

#ifndef CONV_PUSH_EXTRA
#define CONV_PUSH_EXTRA
#endif

layout(push_constant) uniform Push {
    uint N;  // batch
    uint C;  // input channels
    uint H;  // input height
    uint W;  // input width
    uint K;  // output channels
    uint R;  // kernel height
    uint S;  // kernel width
    uint stride;
    uint pad;
    uint OH;  // output height
    uint OW;  // output width
    uint has_bias;
    uint act;  // ACT_* code of the fused activation (the implicit GEMMs use their constant ACT)
    float slope;
    uint one_d;  // 1: a Conv1d's (C, L) input seen as (C, 1, L): padded along the width only
    CONV_PUSH_EXTRA
} pc;

// The zeros above and below the input: none for a 1-D convolution (its height is 1, R is 1).
uint pad_h() {
    return pc.one_d != 0u ? 0u : pc.pad;
}

// (n, c, h, w) of flat index i into a row-major [*, C, H, W] array: the output [N, K, OH, OW],
// the input [N, C, H, W] or the weights [K, C, R, S], whichever a shader's threads walk.
uvec4 nchw_coords(uint i, uint C, uint H, uint W) {
    uint w = i % W;
    uint t = i / W;
    uint h = t % H;
    t /= H;
    return uvec4(t / C, t % C, h, w);
}

#endif
