// Dropout's mask applied to X: Y[i] = X[i] * (keep(i) ? scale : 0), scale = 1 / (1 - p). The same
// launch is the forward (X the input) and the backward (X the output's gradient): the mask is a
// counter-based hash, recomputed rather than stored, of (seed, training step t = stepvals[3],
// flat element index i), in uint32 arithmetic that actors/cpu_ops.py dropout_keep copies to the
// bit, so every backend drops the same elements. keep(i) is hash >= threshold = ceil(p * 2^32),
// i.e. a uniform draw in [0, 1) >= p. A dropped NaN stays NaN (NaN * 0), as in PyTorch.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer StepBuf { float stepvals[]; };
layout(std430, set = 0, binding = 2) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint n;          // elements
    uint seed;       // the run's seed mixed with the layer's index (flow.autodiff)
    uint threshold;  // ceil(p * 2^32): hashes below it drop their element
    float scale;     // 1 / (1 - p)
} pc;

// The PCG hash (Jarzynski and Olano, "Hash Functions for GPU Rendering", 2020): a bijection of
// uint32 whose output passes statistical tests for consecutive inputs.
uint pcg(uint v) {
    uint state = v * 747796405u + 2891336453u;
    uint word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

void main() {
    // Hashed before they meet, so no two (seed, step) pairs give keys that are simple shifts of
    // each other; the step arrives as a float, exact up to 2^24 steps.
    const uint key = pcg(pcg(pc.seed) ^ uint(stepvals[3]));
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        const bool keep = pcg(pcg(i) ^ key) >= pc.threshold;
        Y[i] = X[i] * (keep ? pc.scale : 0.0);
    }
}
