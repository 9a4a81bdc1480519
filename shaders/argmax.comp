// out[r] = index of the FIRST maximum of row r of X [rows, cols] (int32), as numpy argmax: NaN
// counts above every number. One workgroup per row, looping rows with stride gl_NumWorkGroups.x;
// a shared-memory tree of (value, index) pairs.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer OutBuf { int indices[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

const uint NO_INDEX = 0xffffffffu;

uint first_stride() {
    uint p = 1u;
    while (p < gl_WorkGroupSize.x) {
        p <<= 1;
    }
    return p >> 1;
}

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

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint size = gl_WorkGroupSize.x;
    for (uint row = gl_WorkGroupID.x; row < pc.rows; row += gl_NumWorkGroups.x) {
        uint base = row * pc.cols;
        float m = uintBitsToFloat(0xff800000u);
        uint best = NO_INDEX;
        for (uint c = lid; c < pc.cols; c += size) {
            float x = X[base + c];
            if (beats(x, c, m, best)) {
                m = x;
                best = c;
            }
        }
        partial[lid] = m;
        partial_index[lid] = best;
        barrier();
        for (uint s = first_stride(); s > 0u; s >>= 1) {
            if (lid < s && lid + s < size) {
                float ov = partial[lid + s];
                uint oi = partial_index[lid + s];
                if (beats(ov, oi, partial[lid], partial_index[lid])) {
                    partial[lid] = ov;
                    partial_index[lid] = oi;
                }
            }
            barrier();
        }
        if (lid == 0u) {
            indices[row] = int(partial_index[0]);
        }
        barrier();
    }
}
