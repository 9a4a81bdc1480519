// The push block of the elementwise ops unary, unary_backward and binary (registry
// _ELEMENTWISE_PUSH), with the op codes their fn selects. The registry packs one block layout for
// all three, so one declaration keeps them from drifting apart. (cast, copy and fill take other
// fields and declare their own.)
//
// Each invocation walks the n elements grid-stride (i += gl_NumWorkGroups.x * gl_WorkGroupSize.x):
// the registry caps the group count (MAX_GROUPS), so one launch covers any n.
#ifndef VKFLOW_ELEMENTWISE_HEAD_GLSL
#define VKFLOW_ELEMENTWISE_HEAD_GLSL

#include "op_codes.glsl"

layout(push_constant) uniform Push {
    uint n;   // elements
    uint fn;  // ACT_* or UNARY_* (unary, unary_backward), BINARY_* (binary)
    float a;  // the leaky slope for activations; the scale of scale_shift and of binary's result
    float b;  // the shift of scale_shift
} pc;

#endif
