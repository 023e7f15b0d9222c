// AdaLomo (lpmm-optim rule/adalomo.rs), lomo-optim's order; `__fmaf_rn` where the CPU fuses.

// The gradient, clamped where a clamp is set (a NaN stays NaN).
__device__ __forceinline__ float adalomo_clamped(const AdaLomoConsts& c, float g) {
    float x = g;
    if (c.clip_value > 0.0f) {
        if (x < -c.clip_value) {
            x = -c.clip_value;
        }
        if (x > c.clip_value) {
            x = c.clip_value;
        }
    }
    return x;
}

// The unclipped update rsqrt(v) * g, the new second moment into *v (given when factorized).
__device__ __forceinline__ float adalomo_unscaled(const AdaLomoConsts& c, uint32_t flags, float g,
                                                  float* v) {
    if ((flags & F_GIVEN_V) == 0u) {
        *v = __fmaf_rn(g * g + c.eps1, c.one_minus_beta2t, *v * c.beta2t);
    }
    return (1.0f / sqrtf(*v)) * g;
}

__device__ __forceinline__ Update rule_adalomo_apply(AdaLomoConsts c, uint32_t flags, float p,
                                                     float g, float m0, float v0, float w0) {
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    float x = adalomo_unscaled(c, flags, adalomo_clamped(c, g), &u.v);
    if ((flags & F_UPDATE_PARAM) == 0u) {
        return u;
    }
    x = x / c.clip_div;
    float decayed = c.wd != 0.0f ? p * c.decay : p;
    float decay_delta = c.wd != 0.0f ? p * c.neg_step_wd : 0.0f;
    u.p = __fmaf_rn(x, c.neg_step, decayed);
    u.d = __fmaf_rn(x, c.neg_step, decay_delta);
    return u;
}

// The clamped gradient.
__device__ __forceinline__ float rule_adalomo_moment_input(AdaLomoConsts c, uint32_t flags,
                                                           uint32_t s, float p, float g, float m,
                                                           float v, float w) {
    return adalomo_clamped(c, g);
}

// Sum 0: the parameter; sum 1: the unclipped update.
__device__ __forceinline__ float rule_adalomo_stat_input(AdaLomoConsts c, uint32_t flags,
                                                         uint32_t k, float p, float g, float m,
                                                         float v, float w) {
    if (k == 0u) {
        return p;
    }
    return adalomo_unscaled(c, flags, adalomo_clamped(c, g), &v);
}
