// RMSprop (lpmm-optim rule/rmsprop.rs), PyTorch's order; `__fmaf_rn` where the CPU fuses.

__device__ __forceinline__ Update rule_rmsprop_apply(RmsPropConsts c, uint32_t flags, float p,
                                                     float g, float m0, float v0, float w0) {
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    // No penalty while the parameter does not move (optimizer accumulation).
    float wd = 0.0f;
    if ((flags & F_UPDATE_PARAM) != 0u) {
        wd = c.wd;
    }
    float gg = g;
    if (wd != 0.0f) {
        gg = __fmaf_rn(p, wd, g);
    }
    u.v = __fmaf_rn(c.one_minus_alpha * gg, gg, v0 * c.alpha);
    float avg;
    if ((c.options & 2u) != 0u) {
        if (c.one_minus_alpha < 0.5f) {
            u.w = __fmaf_rn(gg - w0, c.one_minus_alpha, w0);
        } else {
            u.w = __fmaf_rn(gg - w0, c.one_minus_alpha - 1.0f, gg);
        }
        avg = sqrtf(__fmaf_rn(-u.w, u.w, u.v));
    } else {
        avg = sqrtf(u.v);
    }
    avg = avg + c.eps;
    if ((c.options & 1u) != 0u) {
        u.m = m0 * c.momentum + gg / avg;
        u.p = __fmaf_rn(u.m, c.neg_lr, p);
        u.d = u.m * c.neg_lr;
    } else {
        float step = c.neg_lr * gg / avg;
        u.p = p + step;
        u.d = step;
    }
    return u;
}
