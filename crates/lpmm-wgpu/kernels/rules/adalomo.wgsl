// AdaLomo (lpmm-optim rule/adalomo.rs), lomo-optim's order; `fmaf` where the CPU fuses.

// The gradient, clamped where a clamp is set (a NaN stays NaN).
fn adalomo_clamped(c: AdaLomoConsts, g: f32) -> f32 {
    var x = g;
    if (c.clip_value > 0.0) {
        if (x < -c.clip_value) {
            x = -c.clip_value;
        }
        if (x > c.clip_value) {
            x = c.clip_value;
        }
    }
    return x;
}

// The new second moment (given when factorized) and the unclipped update rsqrt(v) * g.
fn adalomo_unscaled(c: AdaLomoConsts, flags: u32, g: f32, v0: f32) -> vec2<f32> {
    var v = v0;
    if ((flags & F_GIVEN_V) == 0u) {
        v = fmaf(mulr(g, g) + c.eps1, c.one_minus_beta2t, mulr(v0, c.beta2t));
    }
    return vec2<f32>(mulr(divf(1.0, sqrtf(v)), g), v);
}

fn rule_adalomo_apply(c: AdaLomoConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    let uv = adalomo_unscaled(c, flags, adalomo_clamped(c, g), v0);
    u.v = uv.y;
    if ((flags & F_UPDATE_PARAM) == 0u) {
        return u;
    }
    let x = divf(uv.x, c.clip_div);
    var decayed = p;
    var decay_delta = 0.0;
    if (c.wd != 0.0) {
        decayed = mulr(p, c.decay);
        decay_delta = mulr(p, c.neg_step_wd);
    }
    u.p = fmaf(x, c.neg_step, decayed);
    u.d = fmaf(x, c.neg_step, decay_delta);
    return u;
}

// The clamped gradient.
fn rule_adalomo_moment_input(c: AdaLomoConsts, flags: u32, s: u32, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
    return adalomo_clamped(c, g);
}

// Sum 0: the parameter; sum 1: the unclipped update.
fn rule_adalomo_stat_input(c: AdaLomoConsts, flags: u32, k: u32, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
    if (k == 0u) {
        return p;
    }
    return adalomo_unscaled(c, flags, adalomo_clamped(c, g), v).x;
}
