// out[r] = index of the FIRST maximum of row r of X [rows, cols] (int32), as numpy argmax: NaN
// counts above every number. One workgroup per row, looping rows with stride gl_NumWorkGroups.x;
// a shared-memory tree of (value, index) pairs.
#version 450
#extension GL_GOOGLE_include_directive : require

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) writeonly buffer OutBuf { int indices[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
} pc;

shared float partial[gl_WorkGroupSize.x];
shared uint partial_index[gl_WorkGroupSize.x];

#include "row_reduce.glsl"

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
        group_argmax(m, best);
        if (lid == 0u) {
            indices[row] = int(best);
        }
    }
}
