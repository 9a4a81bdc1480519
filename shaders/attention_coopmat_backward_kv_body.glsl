// Fused attention backward on tensor cores, the key and value gradients:
// attention_backward_kv.comp's results (dv_j = sum_i P_ij dY_i, dk_j = scale * sum_i dS_ij q_i)
// with S^T = K Q^T, dP^T = V dY^T, dV += P^T dY and dK += dS^T Q as fp16 x fp16 -> fp32
// cooperative-matrix products. Workgroup (key block, h, n); subgroup w owns 16 key rows (their k
// and v as fp16 fragments, dk and dv as fp32 accumulators) and streams blocks of BC query rows
// (q and dY as fp16, L and Drow) through shared memory, the next block's loads in flight during
// this one's products; causal: from the first query block that reaches its first key, and a
// subgroup skips the query fragments before its own first key. P^T and dS^T are formed element by
// element in the accumulators (the queries' L and Drow gathered by column) and multiplied as fp16.
// Writes the k and v columns of dqkv (the q kernel writes the rest).
// The body of attention_coopmat_backward_kv.comp and attention_coopmat_backward_kv_half.comp (QKV_HALF defined).

#include "attention_coopmat_head.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Qkv4Buf { QKV_T qkv4[]; };
layout(std430, set = 0, binding = 1) readonly buffer DY4Buf { vec4 dY4[]; };
layout(std430, set = 0, binding = 2) readonly buffer LBuf { float L[]; };
layout(std430, set = 0, binding = 3) readonly buffer DrowBuf { float Drow[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DqkvBuf { float dqkv[]; };

shared uvec2 QD[2u * STAGED];  // the q block, then the dY block (first the K, then the V rows)
shared float Ss[BR * SS];      // per subgroup: a 16 x 16 fp32 tile
shared uvec2 Ps[BR * PS];      // per subgroup: P^T as halves
shared uvec2 DSs[BR * PS];     // per subgroup: dS^T as halves
shared float Ls[BC];           // the block's L, base 2
shared float Ds[BC];           // the block's Drow

const uint LD = (BC + NT - 1u) / NT;  // queries of a block's L and Drow an invocation loads

// The L (base 2) and Drow of the block of queries from C0 into l_next and d_next (0 past T).
#define LOAD_LD(C0)                                                          \
    [[unroll]] for (uint x = 0u; x < LD; x++) {                               \
        const uint c = (C0) + gl_LocalInvocationID.x + x * NT;                \
        const bool real = c < pc.T && gl_LocalInvocationID.x + x * NT < BC;   \
        l_next[x] = real ? L[head + min(c, pc.T - 1u)] * LOG2E : 0.0;         \
        d_next[x] = real ? Drow[head + min(c, pc.T - 1u)] : 0.0;              \
    }

void main() {
    const uint w = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint row = lane / LPR;
    const uint part = lane % LPR;
    const uint r0 = gl_WorkGroupID.x * BR;  // the first key blocks see the most queries: first
    const uint h = gl_WorkGroupID.y;
    const uint n = gl_WorkGroupID.z;
    const uint rw = r0 + 16u * w;  // the subgroup's first key
    const uint j_key = rw + row;   // this lane's key row; past T: computed, never written
    const bool causal = pc.causal != 0u;
    const float qscale = pc.scale * LOG2E;
    const uint tile = 16u * w * SS;
    const uint pstrip = 16u * w * PS;
    const uint head = (n * pc.H + h) * pc.T;

    ACC rid;
    ACC cid;
    FRAGMENT_COORDS(rid, cid, Ss, tile)
    MAT_A k[FD];
    MAT_A v[FD];
    {
        QKV_T rows_[LOADS_BR];
        LOAD_ROWS(rows_, LOADS_BR, qkv4, qkv_start(n, t, 1u, h), r0, BR)
        STORE_ROWS(QD, 0u, rows_, LOADS_BR, BR)
        barrier();
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            coopMatLoad(k[f], QD, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
        }
        barrier();
        LOAD_ROWS(rows_, LOADS_BR, qkv4, qkv_start(n, t, 2u, h), r0, BR)
        STORE_ROWS(QD, 0u, rows_, LOADS_BR, BR)
        barrier();
    }
    ACC dk[FD];
    ACC dv[FD];
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatLoad(v[f], QD, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
        dk[f] = ACC(0.0);
        dv[f] = ACC(0.0);
    }
    barrier();

    const uint query_begin = causal ? (r0 / BC) * BC : 0u;
    QKV_T q_rows[LOADS_BC];
    vec4 dy_rows[LOADS_BC];
    float l_next[LD];  // the next block's L (base 2) and Drow (LOAD_LD)
    float d_next[LD];
    LOAD_ROWS(q_rows, LOADS_BC, qkv4, qkv_start(n, t, 0u, h), query_begin, BC)
    LOAD_ROWS(dy_rows, LOADS_BC, dY4, row_start(n, t, h), query_begin, BC)
    LOAD_LD(query_begin)
    for (uint c0 = query_begin; c0 < pc.T; c0 += BC) {
        STORE_ROWS(QD, 0u, q_rows, LOADS_BC, BC)
        STORE_ROWS(QD, STAGED, dy_rows, LOADS_BC, BC)
        [[unroll]] for (uint x = 0u; x < LD; x++) {
            const uint c = gl_LocalInvocationID.x + x * NT;
            if (c < BC) {
                Ls[c] = l_next[x];
                Ds[c] = d_next[x];
            }
        }
        barrier();
        const uint next = c0 + BC;
        if (PREFETCH != 0u && next < pc.T) {
            LOAD_ROWS(q_rows, LOADS_BC, qkv4, qkv_start(n, t, 0u, h), next, BC)
            LOAD_ROWS(dy_rows, LOADS_BC, dY4, row_start(n, t, h), next, BC)
            LOAD_LD(next)
        }
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            const uint q0 = c0 + 16u * fc;
            if (q0 < pc.T && !(causal && q0 + 15u < rw)) {  // uniform in the subgroup
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
                // Masked (P = dS = 0): query >= T, i.e. column >= T - q0, or (causal) query < key,
                // i.e. column - row < rw - q0.
                const float past = float(pc.T - q0);
                const float behind = causal ? float(int(rw) - int(q0)) : -1.0e9;
                [[unroll]] for (int e = 0; e < s.length(); e++) {
                    const uint col = 16u * fc + uint(cid[e]);
                    const bool masked = cid[e] >= past || cid[e] - rid[e] < behind;
                    const float p = masked ? 0.0 : exp2(s[e] * qscale - Ls[col]);
                    s[e] = p;
                    dp[e] = p * (dp[e] - Ds[col]);
                }
                ACC16 pt = ACC16(s);
                ACC16 dst = ACC16(dp);
                coopMatStore(pt, Ps, pstrip + 4u * fc, PS, ROW_MAJOR);
                coopMatStore(dst, DSs, pstrip + 4u * fc, PS, ROW_MAJOR);
            }
        }
        subgroup_sync();
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            const uint q0 = c0 + 16u * fc;
            if (q0 < pc.T && !(causal && q0 + 15u < rw)) {
                MAT_A pt;
                MAT_A dst;
                coopMatLoad(pt, Ps, pstrip + 4u * fc, PS, ROW_MAJOR);
                coopMatLoad(dst, DSs, pstrip + 4u * fc, PS, ROW_MAJOR);
                [[unroll]] for (uint f = 0u; f < FD; f++) {
                    MAT_B q;  // Q and dY: element (query, d) at query * HS + d
                    MAT_B dy;
                    coopMatLoad(q, QD, 16u * fc * HS + 4u * f, HS, ROW_MAJOR);
                    coopMatLoad(dy, QD, STAGED + 16u * fc * HS + 4u * f, HS, ROW_MAJOR);
                    dv[f] = coopMatMulAdd(pt, dy, dv[f]);
                    dk[f] = coopMatMulAdd(dst, q, dk[f]);
                }
            }
        }
        barrier();
        if (PREFETCH == 0u && next < pc.T) {
            LOAD_ROWS(q_rows, LOADS_BC, qkv4, qkv_start(n, t, 0u, h), next, BC)
            LOAD_ROWS(dy_rows, LOADS_BC, dY4, row_start(n, t, h), next, BC)
            LOAD_LD(next)
        }
    }

    // Straight from the accumulators to dqkv where all 16 keys are real, else row by row.
    if (rw + 16u <= pc.T) {
        const uint k_start = qkv_start(n, rw, 1u, h);
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            const ACC dk_f = dk[f] * pc.scale;
            coopMatStore(dk_f, dqkv, k_start + 16u * f, 3u * pc.H * DH, ROW_MAJOR);
            coopMatStore(dv[f], dqkv, k_start + pc.H * DH + 16u * f, 3u * pc.H * DH, ROW_MAJOR);
        }
    } else {
        const uint k_start = qkv_start(n, min(j_key, pc.T - 1u), 1u, h);
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            coopMatStore(dk[f] * pc.scale, Ss, tile, SS, ROW_MAJOR);
            subgroup_sync();
            if (j_key < pc.T) {
                [[unroll]] for (uint c = 0u; c < RP; c++) {
                    dqkv[k_start + 16u * f + part * RP + c] = Ss[tile + row * SS + part * RP + c];
                }
            }
            subgroup_sync();
            coopMatStore(dv[f], Ss, tile, SS, ROW_MAJOR);
            subgroup_sync();
            if (j_key < pc.T) {
                [[unroll]] for (uint c = 0u; c < RP; c++) {
                    dqkv[k_start + pc.H * DH + 16u * f + part * RP + c] = Ss[tile + row * SS + part * RP + c];
                }
            }
            subgroup_sync();
        }
    }
}
