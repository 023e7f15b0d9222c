// AdEMAMix (lpmm-optim rule/ademamix.rs), bitsandbytes' order; `__fmaf_rn` where the CPU fuses.

__device__ __forceinline__ Update rule_ademamix_apply(AdEMAMixConsts c, uint32_t flags, float p,
                                                      float g, float m0, float v0, float w0) {
    Update u;
    u.m = __fmaf_rn(g, c.one_minus_beta1, m0 * c.beta1);
    u.w = __fmaf_rn(g, c.one_minus_beta3, w0 * c.beta3);
    u.v = __fmaf_rn(c.one_minus_beta2 * g, g, v0 * c.beta2);
    float denom = sqrtf(u.v) / c.bias_correction2_sqrt + c.eps;
    float update = (u.m / c.bias_correction1 + c.alpha * u.w) / denom;
    // No decay while the parameter does not move (optimizer accumulation).
    bool moves = (flags & F_UPDATE_PARAM) != 0u;
    float decay = moves ? c.decay : 1.0f;
    float neg_lr_wd = moves ? c.neg_lr_wd : 0.0f;
    u.p = __fmaf_rn(update, c.neg_lr, p * decay);
    u.d = __fmaf_rn(update, c.neg_lr, p * neg_lr_wd);
    return u;
}
