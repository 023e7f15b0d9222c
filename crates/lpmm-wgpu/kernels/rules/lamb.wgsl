// LAMB (lpmm-optim rule/lamb.rs), torch_optimizer's order; `fmaf` where the CPU fuses.

// The update m / (sqrt(v) + eps) (+ wd * p) from the new moments (m, v).
fn lamb_update(c: LambConsts, p: f32, m: f32, v: f32) -> f32 {
    let u = divf(m, sqrtf(v) + c.eps);
    if (c.wd != 0.0) {
        return fmaf(p, c.wd, u);
    }
    return u;
}

// The new moments (m, v); v given when factorized.
fn lamb_moments(c: LambConsts, flags: u32, g: f32, m0: f32, v0: f32) -> vec2<f32> {
    let m = fmaf(g, c.one_minus_beta1, m0 * c.beta1);
    var v = v0;
    if ((flags & F_GIVEN_V) == 0u) {
        v = fmaf(c.one_minus_beta2 * g, g, v0 * c.beta2);
    }
    return vec2<f32>(m, v);
}

fn rule_lamb_apply(c: LambConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    let mv = lamb_moments(c, flags, g, m0, v0);
    u.m = mv.x;
    u.v = mv.y;
    // The parameter does not move in optimizer accumulation.
    if ((flags & F_UPDATE_PARAM) == 0u) {
        return u;
    }
    let x = lamb_update(c, p, mv.x, mv.y);
    u.p = fmaf(x, c.neg_step, p);
    u.d = mulr(x, c.neg_step);
    return u;
}

// Sum 0: the parameter; sum 1: the update.
fn rule_lamb_stat_input(c: LambConsts, flags: u32, k: u32, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
    if (k == 0u) {
        return p;
    }
    let mv = lamb_moments(c, flags, g, m, v);
    return lamb_update(c, p, mv.x, mv.y);
}
