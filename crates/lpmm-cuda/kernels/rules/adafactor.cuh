// Adafactor (lpmm-optim rule/adafactor.rs), transformers' order; `__fmaf_rn` where the CPU
// fuses.

// The unclipped update g / sqrt(v) and, unless given, the second moment moved into `v`.
__device__ __forceinline__ float adafactor_unscaled(const AdafactorConsts& c, uint32_t flags,
                                                    float g, float* v) {
    if ((flags & F_GIVEN_V) == 0u) {
        *v = __fmaf_rn(g * g + c.eps1, c.one_minus_beta2t, *v * c.beta2t);
    }
    return g / sqrtf(*v);
}

__device__ __forceinline__ Update rule_adafactor_apply(AdafactorConsts c, uint32_t flags, float p,
                                                       float g, float m0, float v0, float w0) {
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    float x = adafactor_unscaled(c, flags, g, &u.v) / c.clip_div * c.step;
    if ((c.mode & 1u) != 0u) {
        u.m = __fmaf_rn(x, c.one_minus_beta1, m0 * c.beta1);
        x = u.m;
    }
    // No decay while the parameter does not move (optimizer accumulation).
    float decay = (flags & F_UPDATE_PARAM) != 0u ? c.neg_step_wd : 0.0f;
    u.p = __fmaf_rn(p, decay, p) - x;
    u.d = __fmaf_rn(p, decay, -x);
    return u;
}

// Sum 0: the parameter (with parameter scaling); then the unclipped update.
__device__ __forceinline__ float rule_adafactor_stat_input(AdafactorConsts c, uint32_t flags,
                                                           uint32_t k, float p, float g, float m,
                                                           float v, float w) {
    if (k == 0u && (c.mode & 2u) != 0u) {
        return p;
    }
    return adafactor_unscaled(c, flags, g, &v);
}
