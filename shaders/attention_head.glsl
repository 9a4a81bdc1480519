// What the fused attention kernels share (attention.comp, attention_backward_kv.comp,
// attention_backward_q.comp): tiles, the push block, and head-row loads and stores.
//
// Tensors: qkv [N, T, 3D] with D = H * dh, each row [q | k | v], head h at columns h*dh.. of each
// third; Y, dY [N, T, D]; L, Drow [N, H, T]. Scores are kept in base 2 (the query or key row is
// scaled by scale * log2(e) once), so every exponential is the hardware's exp2.
//
// A workgroup owns BR rows (queries; keys in the kv kernel), G adjacent threads per row, and
// streams BC rows of the other side at a time through shared memory, each row padded by one vec4
// so that the G rows read at once (rows g, g + G, ...) fall in different banks. Every thread of a
// row holds the whole padded row (DHP floats) in registers for the dot products and owns DC4
// vec4s of the row's accumulator; the scores go through shared memory.
// shaders/attention_tiles.py picks the tiles so that the shared memory fits the device.
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint BR = 64;   // rows owned per workgroup
layout(constant_id = 4) const uint BC = 32;   // rows per streamed block
layout(constant_id = 5) const uint G = 4;     // threads per owned row
layout(constant_id = 6) const uint DHP = 64;  // dh rounded up to a multiple of 4

const uint NT = BR * G;
const uint D4 = DHP / 4u;   // vec4s per padded head row
const uint DC4 = D4 / G;    // vec4s of a row's accumulator per thread
const uint RS4 = D4 + 1u;   // shared row stride, vec4s
// Score row stride, floats: padded by G, the G threads of a row write G neighbouring scores and
// the rows a warp reads at once begin G banks apart, so neither the writes nor the reads conflict.
const uint SS = BC + G;
const float LOG2E = 1.4426950408889634;
// The score of a masked pair: exp2 of it less any real score is 0. A finite value, so that a max
// or a difference with it never makes NaN.
const float MASKED = -3.0e38;

layout(push_constant) uniform Push {
    uint N;
    uint T;
    uint H;
    uint dh;
    float scale;
    uint causal;
} pc;

// vec4 j of a head row starting at element `start` of BUF (zeros past dh). With dh a multiple of
// 4 every head row starts 16-byte aligned and is read as vec4s through the BUF4 view.
#define HEAD_LOAD(NAME, BUF, BUF4)                                  \
    vec4 NAME(uint start, uint j) {                                 \
        if (pc.dh % 4u == 0u) {                                     \
            return BUF4[(start >> 2u) + j];                         \
        }                                                           \
        vec4 v = vec4(0.0);                                         \
        [[unroll]] for (uint c = 0u; c < 4u; c++) {                 \
            if (4u * j + c < pc.dh) {                               \
                v[c] = BUF[start + 4u * j + c];                     \
            }                                                       \
        }                                                           \
        return v;                                                   \
    }

#define HEAD_STORE(NAME, BUF, BUF4)                                 \
    void NAME(uint start, uint j, vec4 v) {                         \
        if (pc.dh % 4u == 0u) {                                     \
            BUF4[(start >> 2u) + j] = v;                            \
            return;                                                 \
        }                                                           \
        [[unroll]] for (uint c = 0u; c < 4u; c++) {                 \
            if (4u * j + c < pc.dh) {                               \
                BUF[start + 4u * j + c] = v[c];                     \
            }                                                       \
        }                                                           \
    }

// Element index of head h's first element in row t of sample n of qkv; part 0 q, 1 k, 2 v.
uint qkv_start(uint n, uint t, uint part, uint h) {
    const uint d = pc.H * pc.dh;
    return (n * pc.T + t) * 3u * d + part * d + h * pc.dh;
}

// The same in a [N, T, D] tensor (Y, dY).
uint row_start(uint n, uint t, uint h) {
    return (n * pc.T + t) * pc.H * pc.dh + h * pc.dh;
}
