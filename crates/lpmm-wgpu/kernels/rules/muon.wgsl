// Muon (lpmm-optim rule/muon.rs), torch.optim.Muon's order; `fmaf` where the CPU fuses. The
// matrix phase (the Newton-Schulz iterations) has no kernel here: a device backend refuses a rule
// that takes one (docs/BACKENDS.md), so `v0` (the phase's result) is read only by the CPU today;
// the element-wise parts are the CPU's, for a backend that adds the phase.

// torch's CPU lerp: fma(w, b - a, a) for |w| < 0.5, else fma(w - 1, b - a, b).
fn muon_lerp(a: f32, b: f32, w: f32) -> f32 {
    if (abs(w) < 0.5) {
        return fmaf(w, b - a, a);
    }
    return fmaf(w - 1.0, b - a, b);
}

// The update the matrix phase orthogonalises, from the new momentum; 0 where the gradient, the
// momentum or the update is not finite.
fn muon_update(c: MuonConsts, g: f32, m0: f32) -> f32 {
    let m = muon_lerp(m0, g, c.w_momentum);
    var u = m;
    if (c.nesterov != 0u) {
        u = muon_lerp(g, m, c.w_nesterov);
    }
    if (fits(g, LIMIT_F32) && fits(m, LIMIT_F32) && fits(u, LIMIT_F32)) {
        return u;
    }
    return 0.0;
}

fn rule_muon_apply(c: MuonConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    u.m = muon_lerp(m0, g, c.w_momentum);
    if ((flags & F_UPDATE_PARAM) == 0u) {
        return u;
    }
    // v0: the matrix phase's result. param.mul_(1 - lr*wd); param.add_(update, alpha=-lr').
    u.p = fmaf(v0, c.neg_step, mulr(p, c.decay));
    u.d = fmaf(v0, c.neg_step, mulr(p, c.neg_lr_wd));
    return u;
}

// Sum 0: the update (its Frobenius norm).
fn rule_muon_stat_input(c: MuonConsts, flags: u32, k: u32, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
    return muon_update(c, g, m);
}
