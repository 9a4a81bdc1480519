// Fused attention backward on tensor cores, the key and value gradients:
// attention_backward_kv.comp's results (dv_j = sum_i P_ij dY_i, dk_j = scale * sum_i dS_ij q_i)
// with S^T = K Q^T, dP^T = V dY^T, dV += P^T dY and dK += dS^T Q as fp16 x fp16 -> fp32
// cooperative-matrix products. Workgroup (key block, h, n); subgroup w owns 16 key rows (their k
// and v as fp16 fragments, dk and dv as fp32 accumulators) and streams blocks of BC query rows
// (q and dY as fp16, L and Drow) through shared memory; causal: from the first query block that
// reaches its first key. P^T and dS^T are formed in fp32 in the subgroup's strips and multiplied
// as fp16. Writes the k and v columns of dqkv (the q kernel writes the rest).
#version 450
#extension GL_GOOGLE_include_directive : require

#include "attention_coopmat_head.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Qkv4Buf { vec4 qkv4[]; };
layout(std430, set = 0, binding = 1) readonly buffer DY4Buf { vec4 dY4[]; };
layout(std430, set = 0, binding = 2) readonly buffer LBuf { float L[]; };
layout(std430, set = 0, binding = 3) readonly buffer DrowBuf { float Drow[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DqkvBuf { float dqkv[]; };

shared uvec2 QD[2u * STAGED];  // the q block, then the dY block (first the K, then the V rows)
shared float Ss[BR * SS];      // per subgroup: S^T of the block
shared float Dps[BR * SS];     // per subgroup: dP^T of the block
shared uvec2 Ps[BR * PS];      // per subgroup: P^T as halves
shared uvec2 DSs[BR * PS];     // per subgroup: dS^T as halves
shared float Ls[BC];           // the block's L, base 2
shared float Ds[BC];           // the block's Drow

void main() {
    const uint w = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint row = lane / LPR;
    const uint part = lane % LPR;
    const uint r0 = gl_WorkGroupID.x * BR;  // the first key blocks see the most queries: first
    const uint h = gl_WorkGroupID.y;
    const uint n = gl_WorkGroupID.z;
    const uint j_key = r0 + 16u * w + row;  // this lane's key row; past T: computed, never written
    const bool causal = pc.causal != 0u;
    const float qscale = pc.scale * LOG2E;
    const uint strip = 16u * w * SS;
    const uint pstrip = 16u * w * PS;
    const uint head = (n * pc.H + h) * pc.T;

    MAT_A k[FD];
    MAT_A v[FD];
    vec4 rows[LOADS_BR];
    LOAD_ROWS(rows, LOADS_BR, qkv4, qkv_start(n, t, 1u, h), r0, BR)
    STORE_ROWS(QD, 0u, rows, LOADS_BR, BR)
    barrier();
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatLoad(k[f], QD, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
    }
    barrier();
    LOAD_ROWS(rows, LOADS_BR, qkv4, qkv_start(n, t, 2u, h), r0, BR)
    STORE_ROWS(QD, 0u, rows, LOADS_BR, BR)
    barrier();
    ACC dk[FD];
    ACC dv[FD];
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatLoad(v[f], QD, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
        dk[f] = ACC(0.0);
        dv[f] = ACC(0.0);
    }
    barrier();

    const uint query_begin = causal ? (r0 / BC) * BC : 0u;
    for (uint c0 = query_begin; c0 < pc.T; c0 += BC) {
        vec4 q_rows[LOADS_BC];
        vec4 dy_rows[LOADS_BC];
        LOAD_ROWS(q_rows, LOADS_BC, qkv4, qkv_start(n, t, 0u, h), c0, BC)
        LOAD_ROWS(dy_rows, LOADS_BC, dY4, row_start(n, t, h), c0, BC)
        STORE_ROWS(QD, 0u, q_rows, LOADS_BC, BC)
        STORE_ROWS(QD, STAGED, dy_rows, LOADS_BC, BC)
        for (uint c = gl_LocalInvocationID.x; c < BC; c += NT) {
            const bool real = c0 + c < pc.T;
            Ls[c] = real ? L[head + c0 + c] * LOG2E : 0.0;
            Ds[c] = real ? Drow[head + c0 + c] : 0.0;
        }
        barrier();
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            ACC s = ACC(0.0);
            ACC dp = ACC(0.0);
            [[unroll]] for (uint f = 0u; f < FD; f++) {
                MAT_B q;  // Q^T and dY^T: element (d, query) at query * HS + d
                MAT_B dy;
                coopMatLoad(q, QD, 16u * fc * HS + 4u * f, HS, COL_MAJOR);
                coopMatLoad(dy, QD, STAGED + 16u * fc * HS + 4u * f, HS, COL_MAJOR);
                s = coopMatMulAdd(k[f], q, s);
                dp = coopMatMulAdd(v[f], dy, dp);
            }
            coopMatStore(s, Ss, strip + 16u * fc, SS, ROW_MAJOR);
            coopMatStore(dp, Dps, strip + 16u * fc, SS, ROW_MAJOR);
        }
        subgroup_sync();
        [[unroll]] for (uint c = 0u; c < CPL; c += 4u) {
            vec4 p;
            vec4 ds;
            [[unroll]] for (uint e = 0u; e < 4u; e++) {
                const uint col = part * CPL + c + e;
                const uint query = c0 + col;
                const bool masked = query >= pc.T || (causal && query < j_key);
                p[e] = masked ? 0.0 : exp2(Ss[strip + row * SS + col] * qscale - Ls[col]);
                ds[e] = p[e] * (Dps[strip + row * SS + col] - Ds[col]);
            }
            Ps[pstrip + row * PS + (part * CPL + c) / 4u] = halves(p);
            DSs[pstrip + row * PS + (part * CPL + c) / 4u] = halves(ds);
        }
        subgroup_sync();
        MAT_A pt[FC];
        MAT_A dst[FC];
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            coopMatLoad(pt[fc], Ps, pstrip + 4u * fc, PS, ROW_MAJOR);
            coopMatLoad(dst[fc], DSs, pstrip + 4u * fc, PS, ROW_MAJOR);
        }
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
                MAT_B q;  // Q and dY: element (query, d) at query * HS + d
                MAT_B dy;
                coopMatLoad(q, QD, 16u * fc * HS + 4u * f, HS, ROW_MAJOR);
                coopMatLoad(dy, QD, STAGED + 16u * fc * HS + 4u * f, HS, ROW_MAJOR);
                dv[f] = coopMatMulAdd(pt[fc], dy, dv[f]);
                dk[f] = coopMatMulAdd(dst[fc], q, dk[f]);
            }
        }
        barrier();
    }

    const uint k_start = qkv_start(n, min(j_key, pc.T - 1u), 1u, h);
    const uint v_start = k_start + pc.H * DH;
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatStore(dk[f], Ss, strip, SS, ROW_MAJOR);
        coopMatStore(dv[f], Dps, strip, SS, ROW_MAJOR);
        subgroup_sync();
        if (j_key < pc.T) {
            [[unroll]] for (uint c = 0u; c < 16u / LPR; c++) {
                const uint col = part * (16u / LPR) + c;
                dqkv[k_start + 16u * f + col] = Ss[strip + row * SS + col] * pc.scale;
                dqkv[v_start + 16u * f + col] = Dps[strip + row * SS + col];
            }
        }
        subgroup_sync();
    }
}
