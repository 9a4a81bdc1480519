// Fused attention backward on tensor cores, the query gradient: attention_backward_q.comp's result
// (dq_i = scale * sum_j dS_ij k_j, dS_ij = P_ij (dY_i . v_j - Drow_i), P from the forward's L)
// with S = Q K^T, dP = dY V^T and dQ += dS K as fp16 x fp16 -> fp32 cooperative-matrix products.
// Workgroup (query block, h, n); subgroup w owns 16 query rows (their q and dY as fp16 fragments,
// dq as fp32 accumulators) and streams the key and value blocks as attention_coopmat.comp does;
// dS is formed element by element in the accumulators (the rows' L and Drow gathered once into
// accumulators of their own) and multiplied as fp16. Writes the q columns of dqkv
// (attention_coopmat_backward_kv.comp writes the rest).
// The body of attention_coopmat_backward_q.comp and attention_coopmat_backward_q_half.comp (QKV_HALF defined).

#include "attention_coopmat_head.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Qkv4Buf { QKV_T qkv4[]; };
layout(std430, set = 0, binding = 1) readonly buffer DY4Buf { vec4 dY4[]; };
layout(std430, set = 0, binding = 2) readonly buffer LBuf { float L[]; };
layout(std430, set = 0, binding = 3) readonly buffer DrowBuf { float Drow[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DqkvBuf { float dqkv[]; };

shared uvec2 KV[2u * STAGED];  // the K block, then the V block (first the Q, then the dY rows)
shared float Ss[BR * SS];      // per subgroup: a 16 x 16 fp32 tile
shared uvec2 Ps[BR * PS];      // per subgroup: dS as halves
shared float Rows[2u * BR];    // per subgroup: its rows' L (base 2), then their Drow

void main() {
    const uint w = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint row = lane / LPR;
    const uint part = lane % LPR;
    const uint r0 = (gl_NumWorkGroups.x - 1u - gl_WorkGroupID.x) * BR;  // longest causal rows first
    const uint h = gl_WorkGroupID.y;
    const uint n = gl_WorkGroupID.z;
    const uint rw = r0 + 16u * w;  // the subgroup's first row
    const uint i = rw + row;       // past T: computed, never written
    const bool causal = pc.causal != 0u;
    const float qscale = pc.scale * LOG2E;
    const uint tile = 16u * w * SS;
    const uint pstrip = 16u * w * PS;
    const uint rows = 32u * w;
    const uint head = (n * pc.H + h) * pc.T + min(i, pc.T - 1u);

    ACC rid;
    ACC cid;
    FRAGMENT_COORDS(rid, cid, Ss, tile)
    if (part == 0u) {
        Rows[rows + row] = L[head] * LOG2E;
        Rows[rows + 16u + row] = Drow[head];
    }
    subgroup_sync();
    ACC lse;
    ACC drow;
    [[unroll]] for (int e = 0; e < lse.length(); e++) {
        lse[e] = Rows[rows + uint(rid[e])];
        drow[e] = Rows[rows + 16u + uint(rid[e])];
    }

    MAT_A q[FD];
    MAT_A dy[FD];
    {
        QKV_T q_rows[LOADS_BR];
        LOAD_ROWS(q_rows, LOADS_BR, qkv4, qkv_start(n, t, 0u, h), r0, BR)
        STORE_ROWS(KV, 0u, q_rows, LOADS_BR, BR)
        barrier();
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            coopMatLoad(q[f], KV, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
        }
        barrier();
        vec4 dy_rows[LOADS_BR];
        LOAD_ROWS(dy_rows, LOADS_BR, dY4, row_start(n, t, h), r0, BR)
        STORE_ROWS(KV, 0u, dy_rows, LOADS_BR, BR)
        barrier();
    }
    ACC dq[FD];
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatLoad(dy[f], KV, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
        dq[f] = ACC(0.0);
    }
    barrier();

    const uint key_end = causal ? min(pc.T, r0 + BR) : pc.T;
    QKV_T k_rows[LOADS_BC];
    QKV_T v_rows[LOADS_BC];
    LOAD_ROWS(k_rows, LOADS_BC, qkv4, qkv_start(n, t, 1u, h), 0u, BC)
    LOAD_ROWS(v_rows, LOADS_BC, qkv4, qkv_start(n, t, 2u, h), 0u, BC)
    for (uint c0 = 0u; c0 < key_end; c0 += BC) {
        STORE_ROWS(KV, 0u, k_rows, LOADS_BC, BC)
        STORE_ROWS(KV, STAGED, v_rows, LOADS_BC, BC)
        barrier();
        if (PREFETCH != 0u && c0 + BC < key_end) {
            LOAD_ROWS(k_rows, LOADS_BC, qkv4, qkv_start(n, t, 1u, h), c0 + BC, BC)
            LOAD_ROWS(v_rows, LOADS_BC, qkv4, qkv_start(n, t, 2u, h), c0 + BC, BC)
        }
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            const uint k0 = c0 + 16u * fc;
            if (k0 < pc.T && !(causal && k0 > rw + 15u)) {  // uniform in the subgroup
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
                // Masked (dS = 0): key >= T, i.e. column >= T - k0, or (causal) key > row, i.e.
                // column - row > rw - k0.
                const float past = float(pc.T - k0);
                const float ahead = causal ? float(int(rw) - int(k0)) : 1.0e9;
                [[unroll]] for (int e = 0; e < s.length(); e++) {
                    const bool masked = cid[e] >= past || cid[e] - rid[e] > ahead;
                    const float p = exp2(s[e] * qscale - lse[e]);
                    s[e] = masked ? 0.0 : p * (dp[e] - drow[e]);
                }
                ACC16 ds = ACC16(s);
                coopMatStore(ds, Ps, pstrip + 4u * fc, PS, ROW_MAJOR);
            }
        }
        subgroup_sync();
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            const uint k0 = c0 + 16u * fc;
            if (k0 < pc.T && !(causal && k0 > rw + 15u)) {
                MAT_A ds;
                coopMatLoad(ds, Ps, pstrip + 4u * fc, PS, ROW_MAJOR);
                [[unroll]] for (uint f = 0u; f < FD; f++) {
                    MAT_B k;  // element (key, d) at key * HS + d
                    coopMatLoad(k, KV, 16u * fc * HS + 4u * f, HS, ROW_MAJOR);
                    dq[f] = coopMatMulAdd(ds, k, dq[f]);
                }
            }
        }
        barrier();
        if (PREFETCH == 0u && c0 + BC < key_end) {
            LOAD_ROWS(k_rows, LOADS_BC, qkv4, qkv_start(n, t, 1u, h), c0 + BC, BC)
            LOAD_ROWS(v_rows, LOADS_BC, qkv4, qkv_start(n, t, 2u, h), c0 + BC, BC)
        }
    }

    // Straight from the accumulators to dqkv where all 16 rows are real, else row by row.
    if (rw + 16u <= pc.T) {
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            const ACC dq_f = dq[f] * pc.scale;
            coopMatStore(dq_f, dqkv, qkv_start(n, rw, 0u, h) + 16u * f, 3u * pc.H * DH, ROW_MAJOR);
        }
    } else {
        const uint q_start = qkv_start(n, min(i, pc.T - 1u), 0u, h);
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            coopMatStore(dq[f], Ss, tile, SS, ROW_MAJOR);
            subgroup_sync();
            if (i < pc.T) {
                [[unroll]] for (uint c = 0u; c < RP; c++) {
                    dqkv[q_start + 16u * f + part * RP + c] = Ss[tile + row * SS + part * RP + c] * pc.scale;
                }
            }
            subgroup_sync();
        }
    }
}
