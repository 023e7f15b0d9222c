// Adagrad (lpmm-optim rule/adagrad.rs), PyTorch's order; `__fmaf_rn` where the CPU fuses.

__device__ __forceinline__ Update rule_adagrad_apply(AdagradConsts c, uint32_t flags, float p,
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
    // The sum starts at the initial accumulator value.
    float sum = v0;
    if ((flags & F_FIRST) != 0u) {
        sum = c.init;
    }
    u.v = __fmaf_rn(gg, gg, sum);
    float denom = sqrtf(u.v) + c.eps;
    float step = c.neg_clr * gg / denom;
    u.p = p + step;
    u.d = step;
    return u;
}
