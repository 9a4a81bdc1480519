// C[M,N] = act(alpha * op(A) @ op(B) + (accumulate ? C : 0) + bias[N]), fp32, row-major.
// trans_a: A is stored [K,M]; trans_b: B is stored [N,K]. Any M, N, K (tiles are bounds-checked).
//
// One workgroup computes a BM x BN tile of C. Its (BM/TM)*(BN/TN) threads (local_size_x must
// equal that) each own TM x TN outputs strided by BM/TM rows and BN/TN columns, so neighbouring
// threads read neighbouring shared words (no bank conflicts) and write neighbouring C words.
// A and B stream through shared memory BK at a time, both stored k-major; the next K tile is
// prefetched into registers while the current one is multiplied, hiding global latency.
#version 450
#extension GL_GOOGLE_include_directive : require
// [[unroll]]: the register tiles must stay in registers; a loop the driver leaves rolled indexes
// them dynamically and spills them to local memory (3x slower in the cooperative-matrix GEMM).
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(constant_id = 3) const uint BM = 64;
layout(constant_id = 4) const uint BN = 64;
layout(constant_id = 5) const uint BK = 16;
layout(constant_id = 6) const uint TM = 4;
layout(constant_id = 7) const uint TN = 4;

layout(std430, set = 0, binding = 0) readonly buffer ABuf { float A[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBuf { float B[]; };
layout(std430, set = 0, binding = 2) readonly buffer BiasBuf { float bias[]; };
layout(std430, set = 0, binding = 3) buffer CBuf { float C[]; };

layout(push_constant) uniform Push {
    uint M;
    uint N;
    uint K;
    uint trans_a;
    uint trans_b;
    uint has_bias;
    uint act;
    uint accumulate;
    float alpha;
    float slope;
    uint k_splits;
} p;

#include "common_gemm_act.glsl"

const uint WM = BM / TM;  // threads along m
const uint WN = BN / TN;  // threads along n
const uint NT = WM * WN;  // threads per workgroup
// One word of padding per k row: the non-transposed loads write down a column of As (and the
// transposed ones down a column of Bs), and an odd stride spreads those writes over the banks.
const uint SA = BM + 1;
const uint SB = BN + 1;
const uint A_TILE = BM * BK;
const uint B_TILE = BK * BN;
const uint A_LOADS = (A_TILE + NT - 1) / NT;
const uint B_LOADS = (B_TILE + NT - 1) / NT;

shared float As[BK * SA];
shared float Bs[BK * SB];

// Position (row within the tile along m or n, k within the tile) of load slot l. The fastest
// index follows the contiguous dimension in global memory, so loads coalesce.
uvec2 a_slot(uint l) {
    return p.trans_a == 0u ? uvec2(l / BK, l % BK) : uvec2(l % BM, l / BM);
}

uvec2 b_slot(uint l) {
    return p.trans_b == 0u ? uvec2(l % BN, l / BN) : uvec2(l / BK, l % BK);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint tx = tid % WN;
    const uint ty = tid / WN;
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint M = p.M;
    const uint N = p.N;
    const uint K = p.K;
    // Split-K: workgroup z sums only its slice of K and writes raw partial sums into slice z of
    // C viewed as [splits, M, N]; a splitk_epilogue launch then adds the slices and applies the
    // epilogue. It keeps a GPU busy when M x N has too few tiles (e.g. the logits of a classifier).
    const uint splits = max(p.k_splits, 1u);
    const uint k_chunk = ((K + splits * BK - 1u) / (splits * BK)) * BK;
    const uint k_begin = gl_WorkGroupID.z * k_chunk;
    const uint k_end = min(K, k_begin + k_chunk);

    float acc[TM * TN];
    [[unroll]] for (uint i = 0u; i < TM * TN; ++i) {
        acc[i] = 0.0;
    }
    float ra[A_LOADS];
    float rb[B_LOADS];

    // Prefetch the first K tile.
    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        uint l = tid + i * NT;
        uvec2 s = a_slot(l);
        uint gm = m0 + s.x;
        uint gk = k_begin + s.y;
        float v = 0.0;
        if (l < A_TILE && gm < M && gk < k_end) {
            v = p.trans_a == 0u ? A[gm * K + gk] : A[gk * M + gm];
        }
        ra[i] = v;
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        uint l = tid + i * NT;
        uvec2 s = b_slot(l);
        uint gn = n0 + s.x;
        uint gk = k_begin + s.y;
        float v = 0.0;
        if (l < B_TILE && gn < N && gk < k_end) {
            v = p.trans_b == 0u ? B[gk * N + gn] : B[gn * K + gk];
        }
        rb[i] = v;
    }

    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
            uint l = tid + i * NT;
            if (l < A_TILE) {
                uvec2 s = a_slot(l);
                As[s.y * SA + s.x] = ra[i];
            }
        }
        [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
            uint l = tid + i * NT;
            if (l < B_TILE) {
                uvec2 s = b_slot(l);
                Bs[s.y * SB + s.x] = rb[i];
            }
        }
        barrier();

        uint k1 = k0 + BK;
        if (k1 < k_end) {
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                uint l = tid + i * NT;
                uvec2 s = a_slot(l);
                uint gm = m0 + s.x;
                uint gk = k1 + s.y;
                float v = 0.0;
                if (l < A_TILE && gm < M && gk < k_end) {
                    v = p.trans_a == 0u ? A[gm * K + gk] : A[gk * M + gm];
                }
                ra[i] = v;
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                uint l = tid + i * NT;
                uvec2 s = b_slot(l);
                uint gn = n0 + s.x;
                uint gk = k1 + s.y;
                float v = 0.0;
                if (l < B_TILE && gn < N && gk < k_end) {
                    v = p.trans_b == 0u ? B[gk * N + gn] : B[gn * K + gk];
                }
                rb[i] = v;
            }
        }

        [[unroll]] for (uint kk = 0u; kk < BK; ++kk) {
            float a[TM];
            float b[TN];
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                a[i] = As[kk * SA + ty + i * WM];
            }
            [[unroll]] for (uint j = 0u; j < TN; ++j) {
                b[j] = Bs[kk * SB + tx + j * WN];
            }
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                [[unroll]] for (uint j = 0u; j < TN; ++j) {
                    acc[i * TN + j] = fma(a[i], b[j], acc[i * TN + j]);
                }
            }
        }
        barrier();
    }

    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        uint m = m0 + ty + i * WM;
        if (m >= M) {
            continue;
        }
        [[unroll]] for (uint j = 0u; j < TN; ++j) {
            uint n = n0 + tx + j * WN;
            if (n >= N) {
                continue;
            }
            // Same order as cpu_ops.gemm: scale, then the old C, then the bias, then act.
            if (splits > 1u) {
                C[(gl_WorkGroupID.z * M + m) * N + n] = acc[i * TN + j];
                continue;
            }
            float v = acc[i * TN + j] * p.alpha;
            if (p.accumulate != 0u) {
                v += C[m * N + n];
            }
            if (p.has_bias != 0u) {
                v += bias[n];
            }
            C[m * N + n] = vk_activate(v, p.act, p.slope);
        }
    }
}
