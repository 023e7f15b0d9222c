// RMSprop (lpmm-optim rule/rmsprop.rs), PyTorch's order; `fmaf` where the CPU fuses.

fn rule_rmsprop_apply(c: RmsPropConsts, flags: u32, p: f32, g: f32, m0: f32, v0: f32, w0: f32) -> Update {
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
    u.v = fmaf(c.one_minus_alpha * gg, gg, v0 * c.alpha);
    var avg: f32;
    if ((c.options & 2u) != 0u) {
        if (c.one_minus_alpha < 0.5) {
            u.w = fmaf(gg - w0, c.one_minus_alpha, w0);
        } else {
            u.w = fmaf(gg - w0, c.one_minus_alpha - 1.0, gg);
        }
        avg = sqrtf(fmaf(-u.w, u.w, u.v));
    } else {
        avg = sqrtf(u.v);
    }
    avg = avg + c.eps;
    if ((c.options & 1u) != 0u) {
        u.m = mulr(m0, c.momentum) + divf(gg, avg);
        u.p = fmaf(u.m, c.neg_lr, p);
        u.d = mulr(u.m, c.neg_lr);
    } else {
        let step = divf(c.neg_lr * gg, avg);
        u.p = p + step;
        u.d = step;
    }
    return u;
}
