// Fused multi-head self-attention forward on tensor cores (mixed precision): attention.comp's
// results (Y and the log-sum-exp L) with S = Q K^T and O += P V as fp16 x fp16 -> fp32
// cooperative-matrix products. Workgroup (query block, h, n); subgroup w owns 16 query rows, holds
// their Q as fp16 fragments and their output as fp32 accumulators, and streams the key and value
// blocks through shared memory with an online softmax: each block's scores go to the subgroup's
// fp32 strip, LPR lanes per row take the running max and sum in fp32 and write P as fp16, and the
// accumulators are rescaled by the rows' exp2(m_old - m_new) (a component-wise product with a
// 16x16 tile of row scales, which has the accumulators' own layout). Causal: key blocks past the
// query block's last row are never loaded. See attention_coopmat_head.glsl. (The backward kernels
// keep their scores in the accumulators instead; here that was slower on an H100, 190 us against
// 152 for the char GPT's layer: the running maximum needs every element of a row, bench/RESULTS.md
// session 14.)
// The body of attention_coopmat.comp and attention_coopmat_half.comp (QKV_HALF defined).

#include "attention_coopmat_head.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Qkv4Buf { QKV_T qkv4[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };
layout(std430, set = 0, binding = 2) writeonly buffer LBuf { float L[]; };
#ifdef QKV_HALF
layout(std430, set = 0, binding = 3) writeonly buffer HBuf { uint H[]; };  // Y's float16 copy
#endif

const uint SW = BC + 4u;    // fp32 score strip row stride, floats
const uint CPL = BC / LPR;  // columns of a strip row per lane (a multiple of 4)

shared uvec2 KV[2u * STAGED];  // the K block, then the V block (first the Q rows: BR <= 2 BC)
shared float Ss[BR * SW];      // per subgroup: its 16 x BC scores, then a 16 x 16 tile of row scales
shared uvec2 Ps[BR * PS];      // per subgroup: P, 16 x BC halves

void main() {
    const uint w = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint row = lane / LPR;
    const uint part = lane % LPR;
    // Causal blocks further down have more keys: start those first so the short ones fill the tail.
    const uint r0 = (gl_NumWorkGroups.x - 1u - gl_WorkGroupID.x) * BR;
    const uint h = gl_WorkGroupID.y;
    const uint n = gl_WorkGroupID.z;
    const uint i = r0 + 16u * w + row;  // this lane's query row; past T it is computed, not written
    const bool causal = pc.causal != 0u;
    const float qscale = pc.scale * LOG2E;
    const uint strip = 16u * w * SW;
    const uint pstrip = 16u * w * PS;

    {
        QKV_T rows[LOADS_BR];
        LOAD_ROWS(rows, LOADS_BR, qkv4, qkv_start(n, t, 0u, h), r0, BR)
        STORE_ROWS(KV, 0u, rows, LOADS_BR, BR)
    }
    barrier();
    MAT_A q[FD];
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatLoad(q[f], KV, 16u * w * HS + 4u * f, HS, ROW_MAJOR);
    }
    ACC o[FD];
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        o[f] = ACC(0.0);
    }
    float m = MASKED;
    float l = 0.0;
    barrier();

    const uint key_end = causal ? min(pc.T, r0 + BR) : pc.T;
    for (uint c0 = 0u; c0 < key_end; c0 += BC) {
        QKV_T k_rows[LOADS_BC];
        QKV_T v_rows[LOADS_BC];
        LOAD_ROWS(k_rows, LOADS_BC, qkv4, qkv_start(n, t, 1u, h), c0, BC)
        LOAD_ROWS(v_rows, LOADS_BC, qkv4, qkv_start(n, t, 2u, h), c0, BC)
        STORE_ROWS(KV, 0u, k_rows, LOADS_BC, BC)
        STORE_ROWS(KV, STAGED, v_rows, LOADS_BC, BC)
        barrier();
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            ACC s = ACC(0.0);
            [[unroll]] for (uint f = 0u; f < FD; f++) {
                MAT_B k;  // K^T: element (d, key) at key * HS + d
                coopMatLoad(k, KV, 16u * fc * HS + 4u * f, HS, COL_MAJOR);
                s = coopMatMulAdd(q[f], k, s);
            }
            coopMatStore(s, Ss, strip + 16u * fc, SW, ROW_MAJOR);
        }
        subgroup_sync();
        // Every lane of a row ends with the same m and l (the shuffles combine the same values).
        float x[CPL];
        float block_max = MASKED;
        [[unroll]] for (uint c = 0u; c < CPL; c++) {
            const uint key = c0 + part * CPL + c;
            const bool masked = key >= pc.T || (causal && key > i);
            x[c] = masked ? MASKED : Ss[strip + row * SW + part * CPL + c] * qscale;
            block_max = max(block_max, x[c]);
        }
        [[unroll]] for (uint o_ = 1u; o_ < LPR; o_ *= 2u) {
            block_max = max(block_max, subgroupShuffleXor(block_max, o_));
        }
        const float m_new = max(m, block_max);
        const float alpha = exp2(m - m_new);
        float sum = 0.0;
        [[unroll]] for (uint c = 0u; c < CPL; c += 4u) {
            const vec4 p = exp2(vec4(x[c], x[c + 1u], x[c + 2u], x[c + 3u]) - m_new);
            sum += p.x + p.y + p.z + p.w;
            Ps[pstrip + row * PS + (part * CPL + c) / 4u] = halves(p);
        }
        [[unroll]] for (uint o_ = 1u; o_ < LPR; o_ *= 2u) {
            sum += subgroupShuffleXor(sum, o_);
        }
        l = l * alpha + sum;
        m = m_new;
        subgroup_sync();  // the strip's scores are read: it takes the row scales now
        [[unroll]] for (uint c = 0u; c < 16u / LPR; c++) {
            Ss[strip + row * SW + part * (16u / LPR) + c] = alpha;
        }
        subgroup_sync();
        ACC rescale;
        coopMatLoad(rescale, Ss, strip, SW, ROW_MAJOR);
        MAT_A p[FC];
        [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
            coopMatLoad(p[fc], Ps, pstrip + 4u * fc, PS, ROW_MAJOR);
        }
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            o[f] = o[f] * rescale;
            [[unroll]] for (uint fc = 0u; fc < FC; fc++) {
                MAT_B v;  // element (key, d) at key * HS + d
                coopMatLoad(v, KV, STAGED + 16u * fc * HS + 4u * f, HS, ROW_MAJOR);
                o[f] = coopMatMulAdd(p[fc], v, o[f]);
            }
        }
        barrier();
    }

    // Y = O / l, 16 columns at a time through the subgroup's strip (and its float16 copy).
    const float inv = 1.0 / l;
    const uint y_start = row_start(n, min(i, pc.T - 1u), h);
#ifdef QKV_HALF
    uint y_halves[FD * (8u / LPR)];  // Y's copy, written after the last barrier (which would wait for it)
#endif
    [[unroll]] for (uint f = 0u; f < FD; f++) {
        coopMatStore(o[f], Ss, strip, SW, ROW_MAJOR);
        subgroup_sync();
        if (i < pc.T) {
            [[unroll]] for (uint c = 0u; c < 16u / LPR; c += 2u) {
                const uint col = part * (16u / LPR) + c;
                const float lo = Ss[strip + row * SW + col] * inv;
                const float hi = Ss[strip + row * SW + col + 1u] * inv;
                Y[y_start + 16u * f + col] = lo;
                Y[y_start + 16u * f + col + 1u] = hi;
#ifdef QKV_HALF
                y_halves[f * (8u / LPR) + c / 2u] = half_pair(lo, hi);
#endif
            }
        }
        subgroup_sync();
    }
#ifdef QKV_HALF
    if (i < pc.T) {
        [[unroll]] for (uint f = 0u; f < FD; f++) {
            [[unroll]] for (uint c = 0u; c < 16u / LPR; c += 2u) {
                H[(y_start + 16u * f + part * (16u / LPR) + c) / 2u] = y_halves[f * (8u / LPR) + c / 2u];
            }
        }
    }
#endif
    if (i < pc.T && part == 0u) {
        L[(n * pc.H + h) * pc.T + i] = (m + log2(l)) / LOG2E;
    }
}
