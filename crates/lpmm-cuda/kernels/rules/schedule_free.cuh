// Schedule-free AdamW (lpmm-optim rule/schedule_free.rs), the schedulefree package's order;
// `__fmaf_rn` where the CPU fuses.

// torch's CPU lerp: fma(w, b - a, a) for |w| < 0.5, else fma(w - 1, b - a, b).
__device__ __forceinline__ float schedule_free_lerp(float a, float b, float w) {
    if (fabsf(w) < 0.5f) {
        return __fmaf_rn(w, b - a, a);
    }
    return __fmaf_rn(w - 1.0f, b - a, b);
}

__device__ __forceinline__ Update rule_schedule_free_apply(ScheduleFreeConsts c, uint32_t flags,
                                                           float p, float g, float m0, float v0,
                                                           float w0) {
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    if ((flags & F_TRANSFORM) != 0u) {
        // p.lerp_(z, weight): to x (eval) or back to y (train).
        float q = schedule_free_lerp(p, m0, c.ckp1);
        u.p = q;
        u.d = q - p;
        return u;
    }
    // z = clone(p) at the first step.
    float z = (flags & F_FIRST) != 0u ? p : m0;
    u.m = z;
    u.v = __fmaf_rn(c.one_minus_beta2 * g, g, v0 * c.beta2);
    float gn = g / (sqrtf(u.v / c.bias_correction2) + c.eps);
    if ((flags & F_UPDATE_PARAM) == 0u) {
        return u;
    }
    if (c.wd != 0.0f) {
        gn = __fmaf_rn(p, c.wd, gn);
    }
    float y = __fmaf_rn(gn, c.y_step, schedule_free_lerp(p, z, c.ckp1));
    u.m = __fmaf_rn(gn, c.neg_lr, z);
    u.p = y;
    u.d = y - p;
    return u;
}
