// The push block and index math of the pooling shaders, maxpool2d, avgpool2d and their backwards
// (registry _POOL_PUSH): square windows of kernel x kernel at a square stride; average pooling adds
// pad zeros on each side, max pooling none (its launches leave pad at 0).
#ifndef VKFLOW_POOL_HEAD_GLSL
#define VKFLOW_POOL_HEAD_GLSL

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint H;  // input height
    uint W;  // input width
    uint OH;  // output height
    uint OW;  // output width
    uint kernel;
    uint stride;
    uint pad;
} pc;

// (plane, y, x) of flat index i into a row-major [planes, H, W] array: pooling never mixes
// channels, so each n * C + c plane is pooled on its own and only its index is needed.
uvec3 plane_coords(uint i, uint H, uint W) {
    uint x = i % W;
    uint t = i / W;
    return uvec3(t / H, t % H, x);
}

#endif
