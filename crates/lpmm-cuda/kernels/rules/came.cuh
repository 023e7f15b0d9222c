// CAME (lpmm-optim rule/came.rs), the authors' order; `__fmaf_rn` where the CPU fuses.

// The unclipped update g / sqrt(v) and, unless given, the second moment moved into `v`.
__device__ __forceinline__ float came_unscaled(const CameConsts& c, uint32_t flags, float g,
                                               float* v) {
    if ((flags & F_GIVEN_V) == 0u) {
        *v = __fmaf_rn(g * g + c.eps1, c.one_minus_beta2, *v * c.beta2);
    }
    return g / sqrtf(*v);
}

// The clipped update into `u`, the new first moment into `m1`, the second moment into `v`.
__device__ __forceinline__ void came_moments(const CameConsts& c, uint32_t flags, float g,
                                             float m0, float* v, float* u, float* m1) {
    *u = came_unscaled(c, flags, g, v) / c.clip_div;
    *m1 = __fmaf_rn(*u, c.one_minus_beta1, m0 * c.beta1);
}

__device__ __forceinline__ Update rule_came_apply(CameConsts c, uint32_t flags, float p, float g,
                                                  float m0, float v0, float w0) {
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    float clipped;
    came_moments(c, flags, g, m0, &u.v, &clipped, &u.m);
    // Factorized instability (given): exp_avg / sqrt(S); else exp_avg.
    float x = (flags & F_GIVEN_W) != 0u ? u.m / sqrtf(w0) : u.m;
    // No decay while the parameter does not move (optimizer accumulation).
    float decay = (flags & F_UPDATE_PARAM) != 0u ? c.neg_lr_wd : 0.0f;
    float step = x * c.lr;
    u.p = __fmaf_rn(p, decay, p) - step;
    u.d = __fmaf_rn(p, decay, -step);
    return u;
}

// State 2: the gradient; state 3: the instability of the clipped update against the new first
// moment.
__device__ __forceinline__ float rule_came_moment_input(CameConsts c, uint32_t flags, uint32_t s,
                                                        float p, float g, float m, float v,
                                                        float w) {
    if (s == S_STATE3) {
        float clipped;
        float m1;
        came_moments(c, flags, g, m, &v, &clipped, &m1);
        return clipped - m1;
    }
    return g;
}

// The unclipped update.
__device__ __forceinline__ float rule_came_stat_input(CameConsts c, uint32_t flags, uint32_t k,
                                                      float p, float g, float m, float v,
                                                      float w) {
    return came_unscaled(c, flags, g, &v);
}
