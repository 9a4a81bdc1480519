// Fused attention backward, the query gradient (flash-attention-2 style): dq_i = scale * sum_j
// dS_ij k_j with dS_ij = P_ij (dY_i . v_j - Drow_i), P recomputed from the forward's L, and
// written into the q columns of dqkv (the kv kernel writes the rest). Workgroup (query block, h,
// n) streams the key and value blocks as attention.comp does; no T x T buffer, no atomics.
#version 450
#extension GL_GOOGLE_include_directive : require

#include "attention_head.glsl"

layout(std430, set = 0, binding = 0) readonly buffer QkvBuf { float qkv[]; };
layout(std430, set = 0, binding = 0) readonly buffer Qkv4Buf { vec4 qkv4[]; };
layout(std430, set = 0, binding = 1) readonly buffer DYBuf { float dY[]; };
layout(std430, set = 0, binding = 1) readonly buffer DY4Buf { vec4 dY4[]; };
layout(std430, set = 0, binding = 2) readonly buffer LBuf { float L[]; };
layout(std430, set = 0, binding = 3) readonly buffer DrowBuf { float Drow[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DqkvBuf { float dqkv[]; };
layout(std430, set = 0, binding = 4) writeonly buffer Dqkv4Buf { vec4 dqkv4[]; };

HEAD_LOAD(load_qkv, qkv, qkv4)
HEAD_LOAD(load_dy, dY, dY4)
HEAD_STORE(store_dqkv, dqkv, dqkv4)

shared vec4 Ks[BC * RS4];
shared vec4 Vs[BC * RS4];
shared float S[BR * SS];  // dS of the block

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint r = tid / G;
    const uint g = tid % G;
    const uint r0 = (gl_NumWorkGroups.x - 1u - gl_WorkGroupID.x) * BR;  // longest causal rows first
    const uint h = gl_WorkGroupID.y;
    const uint n = gl_WorkGroupID.z;
    const uint i = min(r0 + r, pc.T - 1u);  // rows past T: a copy of the last, never written
    const bool causal = pc.causal != 0u;

    vec4 q[D4];
    vec4 dy[D4];
    const uint q_start = qkv_start(n, i, 0u, h);
    const uint dy_start = row_start(n, i, h);
    [[unroll]] for (uint j = 0u; j < D4; j++) {
        q[j] = load_qkv(q_start, j) * (pc.scale * LOG2E);
        dy[j] = load_dy(dy_start, j);
    }
    const float lse = L[(n * pc.H + h) * pc.T + i] * LOG2E;
    const float drow = Drow[(n * pc.H + h) * pc.T + i];
    vec4 dq[DC4];
    [[unroll]] for (uint j = 0u; j < DC4; j++) {
        dq[j] = vec4(0.0);
    }

    const uint key_end = causal ? min(pc.T, r0 + BR) : pc.T;
    for (uint c0 = 0u; c0 < key_end; c0 += BC) {
        for (uint e = tid; e < BC * D4; e += NT) {
            const uint c = e / D4;
            const uint j = e % D4;
            const bool real = c0 + c < pc.T;
            const uint k_start = qkv_start(n, min(c0 + c, pc.T - 1u), 1u, h);
            Ks[c * RS4 + j] = real ? load_qkv(k_start, j) : vec4(0.0);
            Vs[c * RS4 + j] = real ? load_qkv(k_start + pc.H * pc.dh, j) : vec4(0.0);
        }
        barrier();
        [[unroll]] for (uint cg = 0u; cg < BC / G; cg++) {
            const uint c = g + cg * G;
            float s = 0.0;
            float dp = 0.0;
            [[unroll]] for (uint j = 0u; j < D4; j++) {
                s += dot(q[j], Ks[c * RS4 + j]);
                dp += dot(dy[j], Vs[c * RS4 + j]);
            }
            const uint key = c0 + c;
            const bool masked = key >= pc.T || (causal && key > i);
            S[r * SS + c] = masked ? 0.0 : exp2(s - lse) * (dp - drow);
        }
        barrier();
        for (uint c = 0u; c < BC; c++) {
            const float ds = S[r * SS + c];
            [[unroll]] for (uint j = 0u; j < DC4; j++) {
                dq[j] += ds * Ks[c * RS4 + g * DC4 + j];
            }
        }
        barrier();
    }

    if (r0 + r < pc.T) {
        [[unroll]] for (uint j = 0u; j < DC4; j++) {
            store_dqkv(q_start, g * DC4 + j, dq[j] * pc.scale);
        }
    }
}
