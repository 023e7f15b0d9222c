// Adam / AdamW (lpmm-optim rule/adam.rs), PyTorch's order; `__fmaf_rn` where the CPU fuses.

__device__ __forceinline__ Update rule_adam_apply(AdamConsts c, uint32_t flags, float p, float g,
                                                  float m0, float v0, float w0) {
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    // Neither decay nor penalty while the parameter does not move (optimizer accumulation).
    bool decay_on = (flags & F_UPDATE_PARAM) != 0u;
    float gg = g;
    float decayed = p;
    float decay_delta = 0.0f;
    if (c.decoupled != 0u && decay_on) {
        decayed = p * c.decay;
        decay_delta = p * c.neg_lr_wd;
    } else if (c.decoupled == 0u && decay_on && c.wd != 0.0f) {
        gg = __fmaf_rn(p, c.wd, g);
    }
    if (c.one_minus_beta1 < 0.5f) {
        u.m = __fmaf_rn(gg - m0, c.one_minus_beta1, m0);
    } else {
        u.m = __fmaf_rn(gg - m0, c.one_minus_beta1 - 1.0f, gg);
    }
    if ((flags & F_GIVEN_V) == 0u) {
        u.v = __fmaf_rn(c.one_minus_beta2 * gg, gg, v0 * c.beta2);
    }
    float denom = sqrtf(u.v) / c.bias_correction2_sqrt + c.eps;
    float step = c.neg_step_size * u.m / denom;
    u.p = decayed + step;
    u.d = decay_delta + step;
    return u;
}

// The gradient the second moment sees: Adam's L2 penalty folded in.
__device__ __forceinline__ float rule_adam_moment_input(AdamConsts c, uint32_t flags, uint32_t s,
                                                        float p, float g, float m, float v,
                                                        float w) {
    if (c.decoupled == 0u && (flags & F_UPDATE_PARAM) != 0u && c.wd != 0.0f) {
        return __fmaf_rn(p, c.wd, g);
    }
    return g;
}
