// Fused attention backward, the key and value gradients (flash-attention-2 style): dv_j = sum_i
// P_ij dY_i and dk_j = scale * sum_i dS_ij q_i, with P_ij recomputed from the forward's L and
// dS_ij = P_ij (dY_i . v_j - Drow_i), written into the k and v columns of dqkv (the q kernel
// writes the q columns). Workgroup (key block, h, n) owns BR key rows and streams blocks of BC
// query rows (q, dY, L, Drow) through shared memory; causal: from the first query block that
// reaches its first key. No T x T buffer, no atomics.
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

shared vec4 Qs[BC * RS4];
shared vec4 DYs[BC * RS4];
shared float Ps[BR * SS];
shared float DSs[BR * SS];
shared float Ls[BC];  // the block's L, base 2
shared float Ds[BC];  // the block's Drow

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint r = tid / G;
    const uint g = tid % G;
    const uint r0 = gl_WorkGroupID.x * BR;  // the first key blocks see the most queries: first
    const uint h = gl_WorkGroupID.y;
    const uint n = gl_WorkGroupID.z;
    const uint j_key = min(r0 + r, pc.T - 1u);  // rows past T: a copy of the last, never written
    const bool causal = pc.causal != 0u;
    const uint head = (n * pc.H + h) * pc.T;

    vec4 k[D4];
    vec4 v[D4];
    const uint k_start = qkv_start(n, j_key, 1u, h);
    const uint v_start = k_start + pc.H * pc.dh;
    [[unroll]] for (uint j = 0u; j < D4; j++) {
        k[j] = load_qkv(k_start, j) * (pc.scale * LOG2E);
        v[j] = load_qkv(v_start, j);
    }
    vec4 dk[DC4];
    vec4 dv[DC4];
    [[unroll]] for (uint j = 0u; j < DC4; j++) {
        dk[j] = vec4(0.0);
        dv[j] = vec4(0.0);
    }

    const uint query_begin = causal ? (r0 / BC) * BC : 0u;
    for (uint c0 = query_begin; c0 < pc.T; c0 += BC) {
        for (uint e = tid; e < BC * D4; e += NT) {
            const uint c = e / D4;
            const uint j = e % D4;
            const bool real = c0 + c < pc.T;  // zeros past T: 0 * garbage could be NaN
            const uint t = min(c0 + c, pc.T - 1u);
            Qs[c * RS4 + j] = real ? load_qkv(qkv_start(n, t, 0u, h), j) : vec4(0.0);
            DYs[c * RS4 + j] = real ? load_dy(row_start(n, t, h), j) : vec4(0.0);
        }
        for (uint c = tid; c < BC; c += NT) {
            const bool real = c0 + c < pc.T;
            Ls[c] = real ? L[head + c0 + c] * LOG2E : 0.0;
            Ds[c] = real ? Drow[head + c0 + c] : 0.0;
        }
        barrier();
        [[unroll]] for (uint cg = 0u; cg < BC / G; cg++) {
            const uint c = g + cg * G;
            float s = 0.0;
            float dp = 0.0;
            [[unroll]] for (uint j = 0u; j < D4; j++) {
                s += dot(k[j], Qs[c * RS4 + j]);
                dp += dot(v[j], DYs[c * RS4 + j]);
            }
            const uint query = c0 + c;
            const bool masked = query >= pc.T || (causal && query < j_key);
            const float p = masked ? 0.0 : exp2(s - Ls[c]);
            Ps[r * SS + c] = p;
            DSs[r * SS + c] = masked ? 0.0 : p * (dp - Ds[c]);
        }
        barrier();
        for (uint c = 0u; c < BC; c++) {
            const float p = Ps[r * SS + c];
            const float ds = DSs[r * SS + c];
            [[unroll]] for (uint j = 0u; j < DC4; j++) {
                dv[j] += p * DYs[c * RS4 + g * DC4 + j];
                dk[j] += ds * Qs[c * RS4 + g * DC4 + j];
            }
        }
        barrier();
    }

    if (r0 + r < pc.T) {
        [[unroll]] for (uint j = 0u; j < DC4; j++) {
            store_dqkv(k_start, g * DC4 + j, dk[j] * pc.scale);
            store_dqkv(v_start, g * DC4 + j, dv[j]);
        }
    }
}
