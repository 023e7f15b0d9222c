// LAMB (lpmm-optim rule/lamb.rs), torch_optimizer's order; `__fmaf_rn` where the CPU fuses.

// The update m / (sqrt(v) + eps) (+ wd * p) from the new moments.
__device__ __forceinline__ float lamb_update(const LambConsts& c, float p, float m, float v) {
    float u = m / (sqrtf(v) + c.eps);
    return c.wd != 0.0f ? __fmaf_rn(p, c.wd, u) : u;
}

// The new moments into *m and *v (v given when factorized).
__device__ __forceinline__ void lamb_moments(const LambConsts& c, uint32_t flags, float g,
                                             float* m, float* v) {
    *m = __fmaf_rn(g, c.one_minus_beta1, *m * c.beta1);
    if ((flags & F_GIVEN_V) == 0u) {
        *v = __fmaf_rn(c.one_minus_beta2 * g, g, *v * c.beta2);
    }
}

__device__ __forceinline__ Update rule_lamb_apply(LambConsts c, uint32_t flags, float p, float g,
                                                  float m0, float v0, float w0) {
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    lamb_moments(c, flags, g, &u.m, &u.v);
    // The parameter does not move in optimizer accumulation.
    if ((flags & F_UPDATE_PARAM) == 0u) {
        return u;
    }
    float x = lamb_update(c, p, u.m, u.v);
    u.p = __fmaf_rn(x, c.neg_step, p);
    u.d = x * c.neg_step;
    return u;
}

// Sum 0: the parameter; sum 1: the update.
__device__ __forceinline__ float rule_lamb_stat_input(LambConsts c, uint32_t flags, uint32_t k,
                                                      float p, float g, float m, float v,
                                                      float w) {
    if (k == 0u) {
        return p;
    }
    lamb_moments(c, flags, g, &m, &v);
    return lamb_update(c, p, m, v);
}
