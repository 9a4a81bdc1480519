// The first launch of a step on a dataset kept on the device: the batch's rows, picked by the
// slot's sample indices, converted to float32 and put through the spec's preprocessing.
//   X[r, e] = float(D[idx[r], e]) * affine[2c] + affine[2c + 1],  c = e / channel_elems
//   Y[r]    = labels[idx[r]]
// for r < rows, e < row_elems. Scale and Normalize compose to one affine map per channel (and
// 8-bit data's 1/255 folds into it), so preprocessing costs one FMA an element. D is read as
// 32-bit words: with BYTES = 1 each element is one byte of them (uint8 data stays uint8 on the
// device, a quarter of float32's memory, without the 8-bit storage extension); with BYTES = 0 the
// words are float32 bits.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint BYTES = 0u;

layout(std430, set = 0, binding = 0) readonly buffer DataBuf { uint D[]; };
layout(std430, set = 0, binding = 1) readonly buffer LabelsBuf { int labels[]; };
layout(std430, set = 0, binding = 2) readonly buffer IndexBuf { int idx[]; };
layout(std430, set = 0, binding = 3) readonly buffer AffineBuf { float affine[]; };
layout(std430, set = 0, binding = 4) writeonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 5) writeonly buffer YBuf { int Y[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint row_elems;
    uint channel_elems;
} pc;

float element(uint i) {
    if (BYTES != 0u) {
        return float((D[i >> 2] >> ((i & 3u) * 8u)) & 0xffu);
    }
    return uintBitsToFloat(D[i]);
}

void main() {
    uint total = pc.rows * pc.row_elems;
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += stride) {
        uint r = i / pc.row_elems;
        uint e = i - r * pc.row_elems;
        uint picked = uint(idx[r]);
        uint c = e / pc.channel_elems;
        X[i] = fma(element(picked * pc.row_elems + e), affine[2u * c], affine[2u * c + 1u]);
        if (e == 0u) {
            Y[r] = labels[picked];
        }
    }
}
