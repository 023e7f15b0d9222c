// AdEMAMix (lpmm-optim rule/ademamix.rs), bitsandbytes' order; `fmaf` where the CPU fuses.

fn rule_ademamix_apply(c: AdEMAMixConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    u.m = fmaf(g, c.one_minus_beta1, m0 * c.beta1);
    u.w = fmaf(g, c.one_minus_beta3, w0 * c.beta3);
    u.v = fmaf(c.one_minus_beta2 * g, g, v0 * c.beta2);
    let denom = divf(sqrtf(u.v), c.bias_correction2_sqrt) + c.eps;
    let update = divf(divf(u.m, c.bias_correction1) + mulr(c.alpha, u.w), denom);
    // No decay while the parameter does not move (optimizer accumulation).
    var decay = 1.0;
    var neg_lr_wd = 0.0;
    if ((flags & F_UPDATE_PARAM) != 0u) {
        decay = c.decay;
        neg_lr_wd = c.neg_lr_wd;
    }
    u.p = fmaf(update, c.neg_lr, p * decay);
    u.d = fmaf(update, c.neg_lr, p * neg_lr_wd);
    return u;
}
