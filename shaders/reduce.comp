// Y = alpha * reduce(X) with X [rows, cols]: axis 0 reduces over rows (Y has cols elements),
// axis 1 over cols (Y has rows elements). fn: a REDUCE_* code (sum, mean, max); others write NaN.
// One workgroup per output element, looping with stride gl_NumWorkGroups.x because the registry
// caps the group count. Each invocation keeps a compensated (Kahan) strided partial sum, then a
// shared-memory tree joins them: bias gradients sum over batches of 8192 and more.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "op_codes.glsl"

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint axis;
    uint fn;
    float alpha;
} pc;

shared float partial[gl_WorkGroupSize.x];

// max that keeps NaN, as numpy's: GLSL's max() is undefined for a NaN operand.
float max_nan(float a, float b) {
    return isnan(a) || a > b ? a : b;
}

// Smallest power of two >= the workgroup size, halved: the first stride of the tree.
uint first_stride() {
    uint p = 1u;
    while (p < gl_WorkGroupSize.x) {
        p <<= 1;
    }
    return p >> 1;
}

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint size = gl_WorkGroupSize.x;
    bool by_rows = pc.axis == 0u;
    uint outputs = by_rows ? pc.cols : pc.rows;
    uint len = by_rows ? pc.rows : pc.cols;
    uint step = by_rows ? pc.cols : 1u;
    bool is_max = pc.fn == REDUCE_MAX;
    uint top = first_stride();

    for (uint o = gl_WorkGroupID.x; o < outputs; o += gl_NumWorkGroups.x) {
        uint base = by_rows ? o : o * pc.cols;
        float acc;
        if (is_max) {
            acc = uintBitsToFloat(0xff800000u);  // -inf
            for (uint k = lid; k < len; k += size) {
                acc = max_nan(acc, X[base + k * step]);
            }
        } else {
            // precise keeps the compiler from folding the compensation away.
            precise float sum = 0.0;
            precise float comp = 0.0;
            for (uint k = lid; k < len; k += size) {
                precise float y = X[base + k * step] - comp;
                precise float t = sum + y;
                comp = (t - sum) - y;
                sum = t;
            }
            acc = sum;
        }
        partial[lid] = acc;
        barrier();
        for (uint s = top; s > 0u; s >>= 1) {
            if (lid < s && lid + s < size) {
                float other = partial[lid + s];
                partial[lid] = is_max ? max_nan(partial[lid], other) : partial[lid] + other;
            }
            barrier();
        }
        if (lid == 0u) {
            float result = partial[0];
            if (pc.fn == REDUCE_MEAN) {
                result /= float(len);
            } else if (pc.fn != REDUCE_SUM && pc.fn != REDUCE_MAX) {
                result = uintBitsToFloat(0x7fc00000u);
            }
            Y[o] = result * pc.alpha;
        }
        // The next output reuses partial[]; nobody may overwrite partial[0] before it is read.
        barrier();
    }
}
