// Draws the next token from one row of logits (a language model's, at position cursor[0] of
// L [T, cols]) and writes its id to token[0]: the logits times 1/temperature, the top_k largest
// kept (ties: the lowest index first; top_k = cols keeps all), a softmax, and the first index whose
// running sum of weights passes u * total, u in [0, 1) from the counter hash of (seed, step =
// cursor[1]) that dropout.comp uses. Every float operation is one that Vulkan rounds correctly (add,
// subtract, multiply; `precise` forbids fusing them), exp is a polynomial of them, and the sums run
// in index order in one invocation, so actors/cpu_ops.py sample_token draws the same id to the bit.
// One workgroup: the maximum and the top-k threshold (a radix select over order-preserving keys)
// are shared-memory reductions; the sums are sequential, cheap for a vocabulary of characters.
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer LBuf { float L[]; };
layout(std430, set = 0, binding = 1) readonly buffer CursorBuf { uint cursor[]; };
layout(std430, set = 0, binding = 2) writeonly buffer TokenBuf { int token[]; };

layout(push_constant) uniform Push {
    uint cols;              // the vocabulary's size V
    uint top_k;             // 1..V
    uint seed;
    float inv_temperature;  // 1 / temperature, rounded to float32 on the host
} pc;

shared float part_max[gl_WorkGroupSize.x];
shared uint part_count[gl_WorkGroupSize.x];

uint pcg(uint v) {
    uint state = v * 747796405u + 2891336453u;
    uint word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

// Larger floats get larger keys (the sign flips the order of negative ones).
uint order_key(float x) {
    uint bits = floatBitsToUint(x);
    return (bits & 0x80000000u) != 0u ? ~bits : bits | 0x80000000u;
}

// exp(x) for x <= 0: 2^k * p(r), r = x - k ln 2 in [-ln2/2, ln2/2] (ln 2 in two parts), p the
// degree-6 Taylor polynomial (relative error ~1e-7); 0 below -87, where exp would be subnormal.
float exp_neg(float x) {
    if (x < -87.0) {
        return 0.0;
    }
    precise float k = floor(x * uintBitsToFloat(0x3fb8aa3bu) + 0.5);
    precise float r = (x - k * uintBitsToFloat(0x3f317200u)) - k * uintBitsToFloat(0x35bfbe8eu);
    precise float p = uintBitsToFloat(0x3ab60b61u);
    p = p * r + uintBitsToFloat(0x3c088889u);
    p = p * r + uintBitsToFloat(0x3d2aaaabu);
    p = p * r + uintBitsToFloat(0x3e2aaaabu);
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    return ldexp(p, int(k));
}

uint group_count(uint count) {
    const uint lid = gl_LocalInvocationID.x;
    part_count[lid] = count;
    barrier();
    for (uint half_size = gl_WorkGroupSize.x / 2u; half_size > 0u; half_size /= 2u) {
        if (lid < half_size) {
            part_count[lid] += part_count[lid + half_size];
        }
        barrier();
    }
    const uint total = part_count[0];
    barrier();
    return total;
}

void main() {
    const uint lid = gl_LocalInvocationID.x;
    const uint size = gl_WorkGroupSize.x;
    const uint base = cursor[0] * pc.cols;
    float m = uintBitsToFloat(0xff800000u);
    for (uint c = lid; c < pc.cols; c += size) {
        m = max(m, L[base + c]);
    }
    part_max[lid] = m;
    barrier();
    for (uint half_size = size / 2u; half_size > 0u; half_size /= 2u) {
        if (lid < half_size) {
            part_max[lid] = max(part_max[lid], part_max[lid + half_size]);
        }
        barrier();
    }
    m = part_max[0];
    // The k-th largest key: the largest t with at least top_k keys >= t, found bit by bit.
    uint threshold = 0u;
    if (pc.top_k < pc.cols) {
        for (int bit = 31; bit >= 0; --bit) {
            const uint candidate = threshold | (1u << uint(bit));
            uint count = 0u;
            for (uint c = lid; c < pc.cols; c += size) {
                count += order_key(L[base + c]) >= candidate ? 1u : 0u;
            }
            if (group_count(count) >= pc.top_k) {
                threshold = candidate;
            }
        }
    }
    if (lid != 0u) {
        return;
    }
    uint above = 0u;  // keys above the threshold; ties fill the rest of top_k in index order
    for (uint c = 0u; c < pc.cols; ++c) {
        above += order_key(L[base + c]) > threshold ? 1u : 0u;
    }
    precise float total = 0.0;
    uint ties = pc.top_k - above;
    for (uint c = 0u; c < pc.cols; ++c) {
        const uint key = order_key(L[base + c]);
        const bool tie = key == threshold && ties > 0u;
        ties -= tie ? 1u : 0u;
        if (key > threshold || tie) {
            precise float x = (L[base + c] - m) * pc.inv_temperature;
            total += exp_neg(x);
        }
    }
    const uint draw = pcg(pcg(0u) ^ pcg(pcg(pc.seed) ^ cursor[1]));
    precise float target = float(draw >> 8u) * uintBitsToFloat(0x33800000u) * total;  // u * total
    precise float running = 0.0;
    int chosen = -1;
    ties = pc.top_k - above;
    for (uint c = 0u; c < pc.cols; ++c) {
        const uint key = order_key(L[base + c]);
        const bool tie = key == threshold && ties > 0u;
        ties -= tie ? 1u : 0u;
        if (key > threshold || tie) {
            precise float x = (L[base + c] - m) * pc.inv_temperature;
            const float w = exp_neg(x);
            running += w;
            // u * total can round up to total: the last token of nonzero weight takes that case.
            if (w > 0.0) {
                chosen = int(c);
            }
            if (running > target) {
                break;
            }
        }
    }
    token[0] = chosen;
}
