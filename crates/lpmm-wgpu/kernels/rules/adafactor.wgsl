// Adafactor (lpmm-optim rule/adafactor.rs), transformers' order; `fmaf` where the CPU fuses.

// (the unclipped update g / sqrt(v), the new second moment v): given, or moved here.
fn adafactor_unscaled(c: AdafactorConsts, flags: u32, g: f32, v0: f32) -> vec2<f32> {
    var v = v0;
    if ((flags & F_GIVEN_V) == 0u) {
        v = fmaf(mulr(g, g) + c.eps1, c.one_minus_beta2t, v0 * c.beta2t);
    }
    return vec2<f32>(divf(g, sqrtf(v)), v);
}

fn rule_adafactor_apply(c: AdafactorConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    let r = adafactor_unscaled(c, flags, g, v0);
    u.v = r.y;
    var x = mulr(divf(r.x, c.clip_div), c.step);
    if ((c.mode & 1u) != 0u) {
        u.m = fmaf(x, c.one_minus_beta1, m0 * c.beta1);
        x = u.m;
    }
    // No decay while the parameter does not move (optimizer accumulation).
    var decay = 0.0;
    if ((flags & F_UPDATE_PARAM) != 0u) {
        decay = c.neg_step_wd;
    }
    u.p = fmaf(p, decay, p) - x;
    u.d = fmaf(p, decay, -x);
    return u;
}

// Sum 0: the parameter (with parameter scaling); then the unclipped update.
fn rule_adafactor_stat_input(c: AdafactorConsts, flags: u32, k: u32, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
    if (k == 0u && (c.mode & 2u) != 0u) {
        return p;
    }
    return adafactor_unscaled(c, flags, g, v).x;
}
