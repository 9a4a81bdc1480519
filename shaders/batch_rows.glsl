// The rows of a batch that are real. Every program is recorded once for the plan's full batch;
// a partial batch (the end of an epoch or split, skipped samples, any row count to predict on)
// runs the same program with its row count in the slot's step values (stepvals[4]), and the loss
// kernels count, average and back-propagate over those rows only, leaving padding rows at 0.
#ifndef VKFLOW_BATCH_ROWS_GLSL
#define VKFLOW_BATCH_ROWS_GLSL

// Clamped to [1, capacity]: the engine always writes 1..capacity, and the clamp keeps a stray
// value from reading past the batch or dividing by zero.
uint valid_rows(float n, uint capacity) {
    return clamp(uint(n), 1u, capacity);
}

// The rows the loss averages over, stepvals[5]: the batch's own rows on one device, the global
// batch's under data parallelism (each member's shard then adds its share of the global mean).
float mean_divisor(float divisor, uint n) {
    return divisor >= 1.0 ? divisor : float(n);
}

#endif
