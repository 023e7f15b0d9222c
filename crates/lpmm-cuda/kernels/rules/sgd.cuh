// SGD with momentum (lpmm-optim rule/sgd.rs), PyTorch's order; `__fmaf_rn` where the CPU fuses.

__device__ __forceinline__ Update rule_sgd_apply(SgdConsts c, uint32_t flags, float p, float g,
                                                 float m0, float v0, float w0) {
    // sass: rule
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
    float d = g;
    if (wd != 0.0f) {
        d = __fmaf_rn(p, wd, g);
    }
    if ((c.options & 2u) != 0u) {
        if ((flags & F_FIRST) != 0u) {
            u.m = d;
        } else {
            u.m = __fmaf_rn(d, c.one_minus_dampening, m0 * c.momentum);
        }
        if ((c.options & 1u) != 0u) {
            d = __fmaf_rn(u.m, c.momentum, d);
        } else {
            d = u.m;
        }
    }
    u.p = __fmaf_rn(d, c.neg_lr, p);
    u.d = d * c.neg_lr;
    return u;
}
