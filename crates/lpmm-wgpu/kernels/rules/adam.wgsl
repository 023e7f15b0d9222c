// Adam / AdamW (lpmm-optim rule/adam.rs), PyTorch's order; `fmaf` where the CPU fuses.

fn rule_adam_apply(c: AdamConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    // Neither decay nor penalty while the parameter does not move (optimizer accumulation).
    let decay_on = (flags & F_UPDATE_PARAM) != 0u;
    var gg = g;
    var decayed = p;
    var decay_delta = 0.0;
    if (c.decoupled != 0u && decay_on) {
        decayed = mulr(p, c.decay);
        decay_delta = mulr(p, c.neg_lr_wd);
    } else if (c.decoupled == 0u && decay_on && c.wd != 0.0) {
        gg = fmaf(p, c.wd, g);
    }
    if (c.one_minus_beta1 < 0.5) {
        u.m = fmaf(gg - m0, c.one_minus_beta1, m0);
    } else {
        u.m = fmaf(gg - m0, c.one_minus_beta1 - 1.0, gg);
    }
    if ((flags & F_GIVEN_V) == 0u) {
        u.v = fmaf(c.one_minus_beta2 * gg, gg, v0 * c.beta2);
    }
    let denom = divf(sqrtf(u.v), c.bias_correction2_sqrt) + c.eps;
    let step = divf(c.neg_step_size * u.m, denom);
    u.p = decayed + step;
    u.d = decay_delta + step;
    return u;
}

// The gradient the second moment sees: Adam's L2 penalty folded in.
fn rule_adam_moment_input(c: AdamConsts, flags: u32, s: u32, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
    if (c.decoupled == 0u && (flags & F_UPDATE_PARAM) != 0u && c.wd != 0.0) {
        return fmaf(p, c.wd, g);
    }
    return g;
}
