// Fused attention backward on tensor cores, the query gradient: attention_backward_q.comp's result
// (dq_i = scale * sum_j dS_ij k_j, dS_ij = P_ij (dY_i . v_j - Drow_i), P from the forward's L)
// with S = Q K^T, dP = dY V^T and dQ += dS K as fp16 x fp16 -> fp32 cooperative-matrix products.
// Workgroup (query block, h, n); subgroup w owns 16 query rows (their q and dY as fp16 fragments,
// dq as fp32 accumulators) and streams the key and value blocks as attention_coopmat.comp does;
// dS is formed in fp32 in the subgroup's strips and multiplied as fp16. Writes the q columns of
// dqkv (attention_coopmat_backward_kv.comp writes the rest).
#version 450
#extension GL_GOOGLE_include_directive : require

#include "attention_coopmat_head.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Qkv4Buf { vec4 qkv4[]; };
layout(std430, set = 0, binding = 1) readonly buffer DY4Buf { vec4 dY4[]; };
layout(std430, set = 0, binding = 2) readonly buffer LBuf { float L[]; };
layout(std430, set = 0, binding = 3) readonly buffer DrowBuf { float Drow[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DqkvBuf { float dqkv[]; };

shared uvec2 KV[2u * STAGED];  // the K block, then the V block (first the Q, then the dY rows)
shared float Ss[BR * SS];      // per subgroup: S of the block
shared float Dps[BR * SS];     // per subgroup: dP of the block
shared uvec2 Ps[BR * PS];      // per subgroup: dS as halves

void main() {
    const uint w = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint row = lane / LPR;
    const uint part = lane % LPR;
    const uint r0 = (gl_NumWorkGroups.x - 1u - gl_WorkGroupID.x) * BR;  // longest causal rows first
    const uint h = gl_WorkGroupID.y;
    const uint n = gl_WorkGroupID.z;
    const uint i = r0 + 16u * w + row;  // past T: computed, never written
    const bool causal = pc.causal != 0u;
    const float qscale = pc.scale * LOG2E;
    const uint strip = 16u * w * SS;
    const uint pstrip = 16u * w * PS;
    const uint head = (n * pc.H + h) * pc.T + min(i, pc.T - 1u);
    const float lse = L[head] * LOG2E;
    const float drow = Drow[head];

    MAT_A q[FD];
    MAT_A dy[FD];
    vec4 rows[LOADS_BR];
    LOAD_ROWS(rows, LOADS_BR, qkv4, qkv_start(n, t, 0u, h), r0, BR)
    STORE_ROWS(KV, 0u, rows, LOADS_BR, BR)
    barrier();
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatLoad(q[f], KV, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
    }
    barrier();
    LOAD_ROWS(rows, LOADS_BR, dY4, row_start(n, t, h), r0, BR)
    STORE_ROWS(KV, 0u, rows, LOADS_BR, BR)
    barrier();
    ACC dq[FD];
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatLoad(dy[f], KV, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
        dq[f] = ACC(0.0);
    }
    barrier();

    const uint key_end = causal ? min(pc.T, r0 + BR) : pc.T;
    for (uint c0 = 0u; c0 < key_end; c0 += BC) {
        vec4 k_rows[LOADS_BC];
        vec4 v_rows[LOADS_BC];
        LOAD_ROWS(k_rows, LOADS_BC, qkv4, qkv_start(n, t, 1u, h), c0, BC)
        LOAD_ROWS(v_rows, LOADS_BC, qkv4, qkv_start(n, t, 2u, h), c0, BC)
        STORE_ROWS(KV, 0u, k_rows, LOADS_BC, BC)
        STORE_ROWS(KV, STAGED, v_rows, LOADS_BC, BC)
        barrier();
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            ACC s = ACC(0.0);
            ACC dp = ACC(0.0);
            [[unroll]] for (uint f = 0u; f < FD; f++) {
                MAT_B k;  // K^T and V^T: element (d, key) at key * HS + d
                MAT_B v;
                coopMatLoad(k, KV, 16u * fc * HS + 4u * f, HS, COL_MAJOR);
                coopMatLoad(v, KV, STAGED + 16u * fc * HS + 4u * f, HS, COL_MAJOR);
                s = coopMatMulAdd(q[f], k, s);
                dp = coopMatMulAdd(dy[f], v, dp);
            }
            coopMatStore(s, Ss, strip + 16u * fc, SS, ROW_MAJOR);
            coopMatStore(dp, Dps, strip + 16u * fc, SS, ROW_MAJOR);
        }
        subgroup_sync();
        [[unroll]] for (uint c = 0u; c < CPL; c += 4u) {
            vec4 ds;
            [[unroll]] for (uint e = 0u; e < 4u; e++) {
                const uint col = part * CPL + c + e;
                const uint key = c0 + col;
                const bool masked = key >= pc.T || (causal && key > i);
                const float p = exp2(Ss[strip + row * SS + col] * qscale - lse);
                ds[e] = masked ? 0.0 : p * (Dps[strip + row * SS + col] - drow);
            }
            Ps[pstrip + row * PS + (part * CPL + c) / 4u] = halves(ds);
        }
        subgroup_sync();
        MAT_A ds[FC];
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            coopMatLoad(ds[fc], Ps, pstrip + 4u * fc, PS, ROW_MAJOR);
        }
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
                MAT_B k;  // element (key, d) at key * HS + d
                coopMatLoad(k, KV, 16u * fc * HS + 4u * f, HS, ROW_MAJOR);
                dq[f] = coopMatMulAdd(ds[fc], k, dq[f]);
            }
        }
        barrier();
    }

    const uint q_start = qkv_start(n, min(i, pc.T - 1u), 0u, h);
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatStore(dq[f], Ss, strip, SS, ROW_MAJOR);
        subgroup_sync();
        if (i < pc.T) {
            [[unroll]] for (uint c = 0u; c < 16u / LPR; c++) {
                const uint col = part * (16u / LPR) + c;
                dqkv[q_start + 16u * f + col] = Ss[strip + row * SS + col] * pc.scale;
            }
        }
        subgroup_sync();
    }
}
