// CAME (lpmm-optim rule/came.rs), the authors' order; `fmaf` where the CPU fuses.

// (the unclipped update g / sqrt(v), the new second moment v): given, or moved here.
fn came_unscaled(c: CameConsts, flags: u32, g: f32, v0: f32) -> vec2<f32> {
    var v = v0;
    if ((flags & F_GIVEN_V) == 0u) {
        v = fmaf(mulr(g, g) + c.eps1, c.one_minus_beta2, v0 * c.beta2);
    }
    return vec2<f32>(divf(g, sqrtf(v)), v);
}

// (the clipped update, the new first moment, the new second moment).
fn came_moments(c: CameConsts, flags: u32, g: f32, m0: f32, v0: f32) -> vec3<f32> {
    let r = came_unscaled(c, flags, g, v0);
    let u = divf(r.x, c.clip_div);
    return vec3<f32>(u, fmaf(u, c.one_minus_beta1, m0 * c.beta1), r.y);
}

fn rule_came_apply(c: CameConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    let r = came_moments(c, flags, g, m0, v0);
    u.m = r.y;
    u.v = r.z;
    // Factorized instability (given): exp_avg / sqrt(S); else exp_avg.
    var x = r.y;
    if ((flags & F_GIVEN_W) != 0u) {
        x = divf(r.y, sqrtf(w0));
    }
    // No decay while the parameter does not move (optimizer accumulation).
    var decay = 0.0;
    if ((flags & F_UPDATE_PARAM) != 0u) {
        decay = c.neg_lr_wd;
    }
    let step = mulr(x, c.lr);
    u.p = fmaf(p, decay, p) - step;
    u.d = fmaf(p, decay, -step);
    return u;
}

// State 2: the gradient; state 3: the instability of the clipped update against the new first
// moment.
fn rule_came_moment_input(c: CameConsts, flags: u32, s: u32, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
    if (s == S_STATE3) {
        let r = came_moments(c, flags, g, m, v);
        return r.x - r.y;
    }
    return g;
}

// The unclipped update.
fn rule_came_stat_input(c: CameConsts, flags: u32, k: u32, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
    return came_unscaled(c, flags, g, v).x;
}
