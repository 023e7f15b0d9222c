// Lion (lpmm-optim rule/lion.rs), lion-pytorch's order; `fmaf` where the CPU fuses.

fn rule_lion_apply(c: LionConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    // No decay while the parameter does not move (optimizer accumulation).
    var decay = 1.0;
    var neg_lr_wd = 0.0;
    if ((flags & F_UPDATE_PARAM) != 0u) {
        decay = c.decay;
        neg_lr_wd = c.neg_lr_wd;
    }
    let decayed = p * decay;
    let x = fmaf(g, c.one_minus_beta1, m0 * c.beta1);
    var s = 0.0;
    if (x > 0.0) {
        s = 1.0;
    } else if (x < 0.0) {
        s = -1.0;
    }
    u.m = fmaf(g, c.one_minus_beta2, m0 * c.beta2);
    u.p = fmaf(s, c.neg_lr, decayed);
    u.d = mulr(p, neg_lr_wd) + mulr(s, c.neg_lr);
    return u;
}
