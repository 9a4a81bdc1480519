// A batch of matrix products: C[z] = op(A[z]) @ op(B[z]) for z < batch, every matrix row-major and
// packed one after another: op(A[z]) is M x K (A[z] stored [K, M] when trans_a), op(B[z]) K x N
// (stored [N, K] when trans_b), C[z] M x N. A MatMul layer's forward and both its gradients.
// One 16 x 16 workgroup per 16 x 16 tile of C, walking K in 16-deep tiles through shared memory;
// workgroups along z step through the batch (grid-stride, so any batch fits MAX_GROUPS). A tile's
// zero padding past K meets zeros in the other operand's padding only, so NaN never leaks into a
// real output from outside the matrices.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer ABuf { float A[]; };
layout(std430, set = 0, binding = 1) readonly buffer BBuf { float B[]; };
layout(std430, set = 0, binding = 2) writeonly buffer CBuf { float C[]; };

layout(push_constant) uniform Push {
    uint batch;
    uint M;
    uint N;
    uint K;
    uint trans_a;
    uint trans_b;
} pc;

const uint T = 16u;  // the registry launches T x T workgroups
shared float As[T][T + 1u];
shared float Bs[T][T + 1u];

void main() {
    const uint tx = gl_LocalInvocationID.x;
    const uint ty = gl_LocalInvocationID.y;
    const uint m = gl_WorkGroupID.y * T + ty;
    const uint n = gl_WorkGroupID.x * T + tx;
    const uint M = pc.M, N = pc.N, K = pc.K;
    for (uint z = gl_WorkGroupID.z; z < pc.batch; z += gl_NumWorkGroups.z) {
        const uint a0 = z * M * K;
        const uint b0 = z * K * N;
        float acc = 0.0;
        for (uint k0 = 0u; k0 < K; k0 += T) {
            // As[ty][tx] = op(A)[m, k0 + tx]; Bs[ty][tx] = op(B)[k0 + ty, n]
            const uint ak = k0 + tx;
            float a = 0.0;
            if (m < M && ak < K) {
                a = pc.trans_a != 0u ? A[a0 + ak * M + m] : A[a0 + m * K + ak];
            }
            const uint bk = k0 + ty;
            float b = 0.0;
            if (bk < K && n < N) {
                b = pc.trans_b != 0u ? B[b0 + n * K + bk] : B[b0 + bk * N + n];
            }
            As[ty][tx] = a;
            Bs[ty][tx] = b;
            barrier();
            for (uint kk = 0u; kk < T; ++kk) {
                acc += As[ty][kk] * Bs[kk][tx];
            }
            barrier();
        }
        if (m < M && n < N) {
            C[z * M * N + m * N + n] = acc;
        }
    }
}
