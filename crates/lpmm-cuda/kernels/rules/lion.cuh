// Lion (lpmm-optim rule/lion.rs), lion-pytorch's order; `__fmaf_rn` where the CPU fuses.

__device__ __forceinline__ Update rule_lion_apply(LionConsts c, uint32_t flags, float p, float g,
                                                  float m0, float v0, float w0) {
    // sass: rule
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    // No decay while the parameter does not move (optimizer accumulation).
    float decay = 1.0f;
    float neg_lr_wd = 0.0f;
    if ((flags & F_UPDATE_PARAM) != 0u) {
        decay = c.decay;
        neg_lr_wd = c.neg_lr_wd;
    }
    float decayed = p * decay;
    float x = __fmaf_rn(g, c.one_minus_beta1, m0 * c.beta1);
    float s = 0.0f;
    if (x > 0.0f) {
        s = 1.0f;
    } else if (x < 0.0f) {
        s = -1.0f;
    }
    u.m = __fmaf_rn(g, c.one_minus_beta2, m0 * c.beta2);
    u.p = __fmaf_rn(s, c.neg_lr, decayed);
    u.d = p * neg_lr_wd + s * c.neg_lr;
    return u;
}
