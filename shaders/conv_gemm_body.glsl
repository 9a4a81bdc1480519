// The tiled main loop of the implicit-GEMM convolutions (conv2d_gemm.comp and its two backward
// shaders): C[M,N] = A[M,Kd] @ B[Kd,N] where A and B are never stored. The including shader
// defines the push block (through conv_gemm_head.glsl), the element gathers a_at(m, kk) and
// b_at(kk, n) (zero outside the convolution: that is the im2col index math, done on the fly) and
// store_c(m, n, z, value) (the epilogue and the NCHW scatter), and the constants A_MFAST and
// B_NFAST: whether consecutive threads load along m (n) or along k, whichever walks memory
// contiguously for that operand, so global loads coalesce.
//
// The tiles are gemm.comp's (see its header): one workgroup per BM x BN tile of C with
// (BM/TM)*(BN/TN) threads, each owning TM x TN outputs as 4 x 4 sub-blocks spread over the tile
// so the inner loop's vec4 reads of the k-major shared tiles are free of bank conflicts; the next
// K tile is gathered into registers while the current one is multiplied. Split-K (k_splits > 1):
// workgroup z sums only its slice of K and store_c receives z to write raw partial sums.
#ifndef VKFLOW_CONV_GEMM_BODY_GLSL
#define VKFLOW_CONV_GEMM_BODY_GLSL

const uint WM = BM / TM;  // threads along m
const uint WN = BN / TN;  // threads along n
const uint NT = WM * WN;  // threads per workgroup
const uint TM4 = uint(TM % 4u == 0u);
const uint SWM = TM4 * 4u + (1u - TM4) * TM;
const uint RGM = TM / SWM;
const uint RGN = TN / 4u;
const uint GSM = BM / RGM;
const uint GSN = BN / RGN;
const uint SA = BM + 4u;
const uint SB = BN + 4u;
const uint A_BUF = BK * SA / 4u;
const uint B_BUF = BK * SB / 4u;
const uint A_LOADS = (BM * BK + NT - 1u) / NT;
const uint B_LOADS = (BK * BN + NT - 1u) / NT;

shared vec4 As[A_BUF];
shared vec4 Bs[B_BUF];

// (row along m, k) within the A tile of element l.
uvec2 a_slot(uint l) {
    return A_MFAST ? uvec2(l % BM, l / BM) : uvec2(l / BK, l % BK);
}

// (column along n, k) within the B tile of element l.
uvec2 b_slot(uint l) {
    return B_NFAST ? uvec2(l % BN, l / BN) : uvec2(l / BK, l % BK);
}

float load_a(uint l, uint m0, uint kt, uint k_end) {
    uvec2 s = a_slot(l);
    uint gm = m0 + s.x;
    uint gk = kt + s.y;
    return (l < BM * BK && gm < pc_M() && gk < k_end) ? a_at(gm, gk) : 0.0;
}

float load_b(uint l, uint n0, uint kt, uint k_end) {
    uvec2 s = b_slot(l);
    uint gn = n0 + s.x;
    uint gk = kt + s.y;
    return (l < BK * BN && gn < pc_N() && gk < k_end) ? b_at(gk, gn) : 0.0;
}

void put_a(uint l, float v) {
    if (l < BM * BK) {
        uvec2 s = a_slot(l);
        uint w = s.y * SA + s.x;
        As[w >> 2u][w & 3u] = v;
    }
}

void put_b(uint l, float v) {
    if (l < BK * BN) {
        uvec2 s = b_slot(l);
        uint w = s.y * SB + s.x;
        Bs[w >> 2u][w & 3u] = v;
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint tx = tid % WN;
    const uint ty = tid / WN;
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint K = pc_K();
    const uint splits = max(pc.k_splits, 1u);
    const uint k_chunk = ((K + splits * BK - 1u) / (splits * BK)) * BK;
    const uint k_begin = gl_WorkGroupID.z * k_chunk;
    const uint k_end = min(K, k_begin + k_chunk);

    vec4 acc[TM * RGN];
    [[unroll]] for (uint i = 0u; i < TM * RGN; ++i) {
        acc[i] = vec4(0.0);
    }
    float ra[A_LOADS];
    float rb[B_LOADS];

    [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
        put_a(tid + i * NT, load_a(tid + i * NT, m0, k_begin, k_end));
    }
    [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
        put_b(tid + i * NT, load_b(tid + i * NT, n0, k_begin, k_end));
    }
    barrier();

    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        const uint k1 = k0 + BK;
        const bool more = k1 < k_end;
        if (more) {
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                ra[i] = load_a(tid + i * NT, m0, k1, k_end);
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                rb[i] = load_b(tid + i * NT, n0, k1, k_end);
            }
        }
        [[unroll]] for (uint kk = 0u; kk < BK; ++kk) {
            float a[TM];
            [[unroll]] for (uint g = 0u; g < RGM; ++g) {
                uint w = kk * SA + g * GSM + ty * SWM;
                if (SWM == 4u) {
                    vec4 v = As[w >> 2u];
                    a[4u * g] = v.x;
                    a[4u * g + 1u] = v.y;
                    a[4u * g + 2u] = v.z;
                    a[4u * g + 3u] = v.w;
                } else {
                    [[unroll]] for (uint r = 0u; r < SWM; ++r) {
                        a[g * SWM + r] = As[(w + r) >> 2u][(w + r) & 3u];
                    }
                }
            }
            vec4 b[RGN];
            [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                b[h] = Bs[(kk * SB + h * GSN + tx * 4u) >> 2u];
            }
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                [[unroll]] for (uint h = 0u; h < RGN; ++h) {
                    acc[i * RGN + h] = fma(vec4(a[i]), b[h], acc[i * RGN + h]);
                }
            }
        }
        barrier();  // one buffer: everyone has read it before it is overwritten
        if (more) {
            [[unroll]] for (uint i = 0u; i < A_LOADS; ++i) {
                put_a(tid + i * NT, ra[i]);
            }
            [[unroll]] for (uint i = 0u; i < B_LOADS; ++i) {
                put_b(tid + i * NT, rb[i]);
            }
        }
        barrier();
    }

    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        const uint m = m0 + (i / SWM) * GSM + ty * SWM + i % SWM;
        [[unroll]] for (uint h = 0u; h < RGN; ++h) {
            const uint nc = n0 + h * GSN + tx * 4u;
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                if (m < pc_M() && nc + c < pc_N()) {
                    store_c(m, nc + c, gl_WorkGroupID.z, acc[i * RGN + h][c]);
                }
            }
        }
    }
}

#endif
