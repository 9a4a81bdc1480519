// Fused multi-head self-attention, forward (flash-attention style): Y = softmax(scale * Q K^T,
// causal or not) V per (sample, head), and L [N, H, T], each query row's log-sum-exp of its scaled
// scores, for the backward. No T x T buffer: workgroup (query block, h, n) streams the key and
// value blocks through shared memory keeping a running max and sum per row (online softmax), and
// rescales its accumulator when the max grows. Causal: key blocks past the query block's last
// row are never loaded. See attention_head.glsl for the tiles.
#version 450
#extension GL_GOOGLE_include_directive : require

#include "attention_head.glsl"

layout(std430, set = 0, binding = 0) readonly buffer QkvBuf { float qkv[]; };
layout(std430, set = 0, binding = 0) readonly buffer Qkv4Buf { vec4 qkv4[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Y4Buf { vec4 Y4[]; };
layout(std430, set = 0, binding = 2) writeonly buffer LBuf { float L[]; };

HEAD_LOAD(load_qkv, qkv, qkv4)
HEAD_STORE(store_y, Y, Y4)

shared vec4 Ks[BC * RS4];
shared vec4 Vs[BC * RS4];
shared float S[BR * SS];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint r = tid / G;
    const uint g = tid % G;
    // Causal blocks further down have more keys: start those first so the short ones fill the tail.
    const uint r0 = (gl_NumWorkGroups.x - 1u - gl_WorkGroupID.x) * BR;
    const uint h = gl_WorkGroupID.y;
    const uint n = gl_WorkGroupID.z;
    // Rows past T compute a copy of the last row (keeping every thread in the barriers) and write
    // nothing.
    const uint i = min(r0 + r, pc.T - 1u);
    const bool causal = pc.causal != 0u;

    vec4 q[D4];
    const uint q_start = qkv_start(n, i, 0u, h);
    [[unroll]] for (uint j = 0u; j < D4; j++) {
        q[j] = load_qkv(q_start, j) * (pc.scale * LOG2E);
    }
    vec4 acc[DC4];
    [[unroll]] for (uint j = 0u; j < DC4; j++) {
        acc[j] = vec4(0.0);
    }
    float m = MASKED;
    float l = 0.0;

    const uint key_end = causal ? min(pc.T, r0 + BR) : pc.T;
    for (uint c0 = 0u; c0 < key_end; c0 += BC) {
        for (uint e = tid; e < BC * D4; e += NT) {
            const uint c = e / D4;
            const uint j = e % D4;
            const bool real = c0 + c < pc.T;  // zeros past T: 0 * garbage could be NaN
            const uint k_start = qkv_start(n, min(c0 + c, pc.T - 1u), 1u, h);
            Ks[c * RS4 + j] = real ? load_qkv(k_start, j) : vec4(0.0);
            Vs[c * RS4 + j] = real ? load_qkv(k_start + pc.H * pc.dh, j) : vec4(0.0);
        }
        barrier();
        [[unroll]] for (uint cg = 0u; cg < BC / G; cg++) {
            const uint c = g + cg * G;
            float s = 0.0;
            [[unroll]] for (uint j = 0u; j < D4; j++) {
                s += dot(q[j], Ks[c * RS4 + j]);
            }
            const uint key = c0 + c;
            S[r * SS + c] = key >= pc.T || (causal && key > i) ? MASKED : s;
        }
        barrier();
        // Every thread of a row runs the same float operations on the same scores, so all of them
        // hold the same m and l.
        float block_max = MASKED;
        for (uint c = 0u; c < BC; c++) {
            block_max = max(block_max, S[r * SS + c]);
        }
        const float m_new = max(m, block_max);
        const float alpha = exp2(m - m_new);
        l *= alpha;
        [[unroll]] for (uint j = 0u; j < DC4; j++) {
            acc[j] *= alpha;
        }
        for (uint c = 0u; c < BC; c++) {
            const float p = exp2(S[r * SS + c] - m_new);
            l += p;
            [[unroll]] for (uint j = 0u; j < DC4; j++) {
                acc[j] += p * Vs[c * RS4 + g * DC4 + j];
            }
        }
        m = m_new;
        barrier();
    }

    if (r0 + r < pc.T) {
        const float inv = 1.0 / l;
        const uint y_start = row_start(n, i, h);
        [[unroll]] for (uint j = 0u; j < DC4; j++) {
            store_y(y_start, g * DC4 + j, acc[j] * inv);
        }
        if (g == 0u) {
            L[(n * pc.H + h) * pc.T + i] = (m + log2(l)) / LOG2E;
        }
    }
}
