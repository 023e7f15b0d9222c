// Muon (lpmm-optim rule/muon.rs), torch.optim.Muon's order; `__fmaf_rn` where the CPU fuses. The
// matrix phase (the Newton-Schulz iterations) has no kernel here: a device backend refuses a rule
// that takes one (docs/BACKENDS.md), so `v0` (the phase's result) is read only by the CPU today;
// the element-wise parts are the CPU's, for a backend that adds the phase.

// torch's CPU lerp: fma(w, b - a, a) for |w| < 0.5, else fma(w - 1, b - a, b).
__device__ __forceinline__ float muon_lerp(float a, float b, float w) {
    if (fabsf(w) < 0.5f) {
        return __fmaf_rn(w, b - a, a);
    }
    return __fmaf_rn(w - 1.0f, b - a, b);
}

// The update the matrix phase orthogonalises, from the new momentum; 0 where the gradient, the
// momentum or the update is not finite.
__device__ __forceinline__ float muon_update(const MuonConsts& c, float g, float m0) {
    float m = muon_lerp(m0, g, c.w_momentum);
    float u = c.nesterov != 0u ? muon_lerp(g, m, c.w_nesterov) : m;
    bool ok = fits(g, LIMIT_F32) && fits(m, LIMIT_F32) && fits(u, LIMIT_F32);
    return ok ? u : 0.0f;
}

__device__ __forceinline__ Update rule_muon_apply(MuonConsts c, uint32_t flags, float p, float g,
                                                  float m0, float v0, float w0) {
    Update u;
    u.p = p;
    u.d = 0.0f;
    u.m = muon_lerp(m0, g, c.w_momentum);
    u.v = v0;
    u.w = w0;
    if ((flags & F_UPDATE_PARAM) == 0u) {
        return u;
    }
    // v0: the matrix phase's result. param.mul_(1 - lr*wd); param.add_(update, alpha=-lr').
    u.p = __fmaf_rn(v0, c.neg_step, p * c.decay);
    u.d = __fmaf_rn(v0, c.neg_step, p * c.neg_lr_wd);
    return u;
}

// Sum 0: the update (its Frobenius norm).
__device__ __forceinline__ float rule_muon_stat_input(MuonConsts c, uint32_t flags, uint32_t k,
                                                      float p, float g, float m, float v,
                                                      float w) {
    return muon_update(c, g, m);
}
