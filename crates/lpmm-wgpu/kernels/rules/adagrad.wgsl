// Adagrad (lpmm-optim rule/adagrad.rs), PyTorch's order; `fmaf` where the CPU fuses.

fn rule_adagrad_apply(c: AdagradConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    // No penalty while the parameter does not move (optimizer accumulation).
    var wd = 0.0;
    if ((flags & F_UPDATE_PARAM) != 0u) {
        wd = c.wd;
    }
    var gg = g;
    if (wd != 0.0) {
        gg = fmaf(p, wd, g);
    }
    // The sum starts at the initial accumulator value.
    var sum = v0;
    if ((flags & F_FIRST) != 0u) {
        sum = c.init;
    }
    u.v = fmaf(gg, gg, sum);
    let denom = sqrtf(u.v) + c.eps;
    let step = divf(c.neg_clr * gg, denom);
    u.p = p + step;
    u.d = step;
    return u;
}
