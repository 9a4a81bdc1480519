// Dynamic loss scaling's step (flow.optim.LOSS_SCALE), one workgroup: s = the sum of grad_norm's
// partials X[0..n) (squares of the scaled gradients, in grad_norm.comp's fixed order), then with
// scale = S[0]:
//   Y = [norm, factor / scale, skip]: norm = sqrt(s) / scale, the unscaled gradients' norm;
//       factor = min(1, max_norm / (norm + 1e-6)) (clip_grad_norm_'s; max_norm = inf: 1);
//       skip = 1 when s is not finite (the gradients overflowed), which sgd_clip / adam_clip obey.
//   S = [scale, good steps in a row, skipped steps]: a skip halves the scale and restarts the
//       streak; growth_interval good steps in a row double it (torch.amp.GradScaler's rule).
#version 450

layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { float X[]; };
layout(std430, set = 0, binding = 1) buffer SBuf { float S[]; };
layout(std430, set = 0, binding = 2) writeonly buffer YBuf { float Y[]; };

layout(push_constant) uniform Push {
    uint n;
    float max_norm;
    uint growth_interval;
} pc;

shared float partial[gl_WorkGroupSize.x];

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint size = gl_WorkGroupSize.x;
    float acc = 0.0;
    for (uint i = lid; i < pc.n; i += size) {
        acc += X[i];
    }
    partial[lid] = acc;
    barrier();
    for (uint s = size >> 1; s > 0u; s >>= 1) {
        if (lid < s) {
            partial[lid] += partial[lid + s];
        }
        barrier();
    }
    if (lid == 0u) {
        float total = partial[0];
        float scale = S[0];
        bool finite = !isinf(total) && !isnan(total);
        float norm = sqrt(total) / scale;
        float factor = pc.max_norm / (norm + 1e-6);
        Y[0] = norm;
        Y[1] = (factor < 1.0 ? factor : 1.0) / scale;
        Y[2] = finite ? 0.0 : 1.0;
        if (finite) {
            float streak = S[1] + 1.0;
            bool grow = streak >= float(pc.growth_interval);
            // Capped at 2^100 so that a float32 run that never overflows cannot reach infinity.
            S[0] = grow && scale < 1.2676506e30 ? scale * 2.0 : scale;
            S[1] = grow ? 0.0 : streak;
        } else {
            S[0] = scale * 0.5;
            S[1] = 0.0;
            S[2] = S[2] + 1.0;
        }
    }
}
