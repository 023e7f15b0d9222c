// SGD with momentum (lpmm-optim rule/sgd.rs), PyTorch's order; `fmaf` where the CPU fuses.

fn rule_sgd_apply(c: SgdConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
    var u = Update(p, 0.0, m0, v0, w0);
    // No penalty while the parameter does not move (optimizer accumulation).
    var wd = 0.0;
    if ((flags & F_UPDATE_PARAM) != 0u) {
        wd = c.wd;
    }
    var d = g;
    if (wd != 0.0) {
        d = fmaf(p, wd, g);
    }
    if ((c.options & 2u) != 0u) {
        if ((flags & F_FIRST) != 0u) {
            u.m = d;
        } else {
            u.m = fmaf(d, c.one_minus_dampening, m0 * c.momentum);
        }
        if ((c.options & 1u) != 0u) {
            d = fmaf(u.m, c.momentum, d);
        } else {
            d = u.m;
        }
    }
    u.p = fmaf(d, c.neg_lr, p);
    u.d = mulr(d, c.neg_lr);
    return u;
}
