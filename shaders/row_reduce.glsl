// Workgroup reductions over rows, shared by argmax, softmax_xent, softmax_xent_totals and the
// batch normalisation statistics (batchnorm_stats, batchnorm_backward_reduce) and layer
// normalisation (layernorm, layernorm_backward_data, layernorm_backward_reduce).
// The including shader declares, before the #include:
//     shared float partial[gl_WorkGroupSize.x];
//     shared uint partial_index[gl_WorkGroupSize.x];
// Trees run in a fixed order, so results are the same on every run.
#ifndef VKFLOW_ROW_REDUCE_GLSL
#define VKFLOW_ROW_REDUCE_GLSL

const uint NO_INDEX = 0xffffffffu;

uint first_stride() {
    uint p = 1u;
    while (p < gl_WorkGroupSize.x) {
        p <<= 1;
    }
    return p >> 1;
}

// (value, index) b beats a: larger value, NaN above all (numpy argmax returns the first NaN),
// and on ties the smaller index, so the first maximum wins.
bool beats(float bv, uint bi, float av, uint ai) {
    if (bi == NO_INDEX) {
        return false;
    }
    if (ai == NO_INDEX) {
        return true;
    }
    bool bn = isnan(bv);
    bool an = isnan(av);
    if (bn || an) {
        return bn && (!an || bi < ai);
    }
    return bv > av || (bv == av && bi < ai);
}

// Workgroup-wide sum; every invocation gets the result.
float group_sum(float v) {
    uint lid = gl_LocalInvocationID.x;
    partial[lid] = v;
    barrier();
    for (uint s = first_stride(); s > 0u; s >>= 1) {
        if (lid < s && lid + s < gl_WorkGroupSize.x) {
            partial[lid] += partial[lid + s];
        }
        barrier();
    }
    float result = partial[0];
    barrier();
    return result;
}

// Workgroup-wide first argmax; every invocation gets the max value and its index.
void group_argmax(inout float v, inout uint index) {
    uint lid = gl_LocalInvocationID.x;
    partial[lid] = v;
    partial_index[lid] = index;
    barrier();
    for (uint s = first_stride(); s > 0u; s >>= 1) {
        if (lid < s && lid + s < gl_WorkGroupSize.x) {
            float ov = partial[lid + s];
            uint oi = partial_index[lid + s];
            if (beats(ov, oi, partial[lid], partial_index[lid])) {
                partial[lid] = ov;
                partial_index[lid] = oi;
            }
        }
        barrier();
    }
    v = partial[0];
    index = partial_index[0];
    barrier();
}

#endif
