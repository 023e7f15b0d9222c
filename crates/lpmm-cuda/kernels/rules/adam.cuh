// Adam / AdamW (lpmm-optim rule/adam.rs), PyTorch's order; `__fmaf_rn` where the CPU fuses.

// The update, with sqrt(v) / bias_correction2_sqrt divided in IEEE arithmetic (`fast` false) or
// as exact.cuh's exact_quotient from `inv`, RN(1 / bias_correction2_sqrt) (`fast`: the same bits
// where rule_adam_prepare allows it).
__device__ __forceinline__ Update rule_adam_update(AdamConsts c, bool fast, float inv,
                                                   uint32_t flags, float p, float g, float m0,
                                                   float v0, float w0) {
    // sass: rule
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = m0;
    u.v = v0;
    u.w = w0;
    // Neither decay nor penalty while the parameter does not move (optimizer accumulation).
    bool decay_on = (flags & F_UPDATE_PARAM) != 0u;
    float gg = g;
    float decayed = p;
    float decay_delta = 0.0f;
    if (c.decoupled != 0u && decay_on) {
        decayed = p * c.decay;
        decay_delta = p * c.neg_lr_wd;
    } else if (c.decoupled == 0u && decay_on && c.wd != 0.0f) {
        gg = __fmaf_rn(p, c.wd, g);
    }
    if (c.one_minus_beta1 < 0.5f) {
        u.m = __fmaf_rn(gg - m0, c.one_minus_beta1, m0);
    } else {
        u.m = __fmaf_rn(gg - m0, c.one_minus_beta1 - 1.0f, gg);
    }
    if ((flags & F_GIVEN_V) == 0u) {
        u.v = __fmaf_rn(c.one_minus_beta2 * gg, gg, v0 * c.beta2);
    }
    float root = sqrtf(u.v);
    float scaled = fast ? exact_quotient(root, c.bias_correction2_sqrt, inv)
                        : root / c.bias_correction2_sqrt;
    float denom = scaled + c.eps;
    float step = c.neg_step_size * u.m / denom;
    u.p = decayed + step;
    u.d = decay_delta + step;
    return u;
}

__device__ __forceinline__ Update rule_adam_apply(AdamConsts c, uint32_t flags, float p, float g,
                                                  float m0, float v0, float w0) {
    return rule_adam_update(c, false, 0.0f, flags, p, g, m0, v0, w0);
}

// The specialized steps' fast path (kernels/plan.cuh): RN(1 / bias_correction2_sqrt), or 0 (no
// fast path) where exact_quotient would not give the IEEE quotient. Its numerators are square
// roots: +0, or at least 2^-75 (the root of the least subnormal), at most 2^64; with a divisor
// in [2^-40, 2^40] every quotient is then exact, but for a root of -0 (v = -0), whose quotient
// comes out +0: the same denominator but with eps = -0, which is left to the IEEE path.
__device__ __forceinline__ float rule_adam_prepare(AdamConsts c) {
    // sass: rule
    float b = c.bias_correction2_sqrt;
    if (!(b >= 0x1p-40f && b <= 0x1p40f) || f2u(c.eps) == 0x80000000u) {
        return 0.0f;
    }
    return 1.0f / b;
}

__device__ __forceinline__ Update rule_adam_fast(AdamConsts c, float inv, uint32_t flags, float p,
                                                 float g, float m0, float v0, float w0) {
    return rule_adam_update(c, true, inv, flags, p, g, m0, v0, w0);
}

// The gradient the second moment sees: Adam's L2 penalty folded in.
__device__ __forceinline__ float rule_adam_moment_input(AdamConsts c, uint32_t flags, uint32_t s,
                                                        float p, float g, float m, float v,
                                                        float w) {
    if (c.decoupled == 0u && (flags & F_UPDATE_PARAM) != 0u && c.wd != 0.0f) {
        return __fmaf_rn(p, c.wd, g);
    }
    return g;
}
