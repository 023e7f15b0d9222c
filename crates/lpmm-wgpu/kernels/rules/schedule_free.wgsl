// Schedule-free AdamW (lpmm-optim rule/schedule_free.rs), the schedulefree package's order;
// `fmaf` where the CPU fuses.

// torch's CPU lerp: fma(w, b - a, a) for |w| < 0.5, else fma(w - 1, b - a, b).
fn schedule_free_lerp(a: f32, b: f32, w: f32) -> f32 {
    if (abs(w) < 0.5) {
        return fmaf(w, b - a, a);
    }
    return fmaf(w - 1.0, b - a, b);
}

fn rule_schedule_free_apply(c: ScheduleFreeConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    if ((flags & F_TRANSFORM) != 0u) {
        // p.lerp_(z, weight): to x (eval) or back to y (train).
        let q = schedule_free_lerp(p, m0, c.ckp1);
        u.p = q;
        u.d = q - p;
        return u;
    }
    // z = clone(p) at the first step.
    var z = m0;
    if ((flags & F_FIRST) != 0u) {
        z = p;
    }
    u.m = z;
    u.v = fmaf(c.one_minus_beta2 * g, g, v0 * c.beta2);
    var gn = divf(g, sqrtf(divf(u.v, c.bias_correction2)) + c.eps);
    if ((flags & F_UPDATE_PARAM) == 0u) {
        return u;
    }
    if (c.wd != 0.0) {
        gn = fmaf(p, c.wd, gn);
    }
    let y = fmaf(gn, c.y_step, schedule_free_lerp(p, z, c.ckp1));
    u.m = fmaf(gn, c.neg_lr, z);
    u.p = y;
    u.d = y - p;
    return u;
}
