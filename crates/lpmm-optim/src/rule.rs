//! The update rules, element by element, in f32, with PyTorch's order of operations (each rule is
//! written out in docs/OPTIMIZERS.md). Factors derived from hyperparameters (`1 - beta1`,
//! `lr / (1 - beta1^t)`, ...) are computed in f64 and rounded to f32 once, as PyTorch does with
//! its Python-float hyperparameters; `fma` marks where PyTorch's CPU kernels fuse a multiply-add
//! (`add(..., alpha)`, `lerp`).

use crate::config::Hyper;

/// The per-step constants of one parameter's rule.
/// One parameter's update rule for one step: the f32 constants every backend uses, derived
/// from the hyperparameters in f64 (docs/OPTIMIZERS.md).
#[derive(Debug, Clone, Copy, PartialEq)]
#[allow(missing_docs)]
pub enum Rule {
    Sgd {
        neg_lr: f32,
        wd: f32,
        momentum: f32,
        one_minus_dampening: f32,
        nesterov: bool,
        has_momentum: bool,
    },
    Adam {
        decoupled: bool,
        decay: f32,
        neg_lr_wd: f32,
        wd: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        bias_correction2_sqrt: f32,
        eps: f32,
        neg_step_size: f32,
        /// The second moment is supplied by the caller (factorized storage) and not updated.
        given_v: bool,
    },
    Lion {
        decay: f32,
        neg_lr_wd: f32,
        neg_lr: f32,
        beta1: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
    },
}

/// What one element's update produced.
/// What one element's update produced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Updated {
    /// The new parameter, rounded as PyTorch rounds it.
    pub param: f32,
    /// The same update as one increment (decay folded in), for Kahan-compensated storage, which
    /// must not lose the increment to the rounding of `param`.
    pub delta: f32,
}

impl Rule {
    /// The rule of `hyper` at 1-based step `t`.
    pub fn new(hyper: &Hyper, t: u64) -> Self {
        let t = t as f64;
        match *hyper {
            Hyper::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => Rule::Sgd {
                neg_lr: -lr as f32,
                wd: weight_decay as f32,
                momentum: momentum as f32,
                one_minus_dampening: (1.0 - dampening) as f32,
                nesterov,
                has_momentum: momentum != 0.0,
            },
            Hyper::Adam {
                lr,
                betas,
                eps,
                weight_decay,
                decoupled,
            } => {
                let bias_correction1 = 1.0 - betas.0.powf(t);
                let bias_correction2 = 1.0 - betas.1.powf(t);
                Rule::Adam {
                    decoupled,
                    decay: (1.0 - lr * weight_decay) as f32,
                    neg_lr_wd: (-lr * weight_decay) as f32,
                    wd: weight_decay as f32,
                    one_minus_beta1: (1.0 - betas.0) as f32,
                    beta2: betas.1 as f32,
                    one_minus_beta2: (1.0 - betas.1) as f32,
                    bias_correction2_sqrt: bias_correction2.sqrt() as f32,
                    eps: eps as f32,
                    neg_step_size: (-(lr / bias_correction1)) as f32,
                    given_v: false,
                }
            }
            Hyper::Lion {
                lr,
                betas,
                weight_decay,
            } => Rule::Lion {
                decay: (1.0 - lr * weight_decay) as f32,
                neg_lr_wd: (-lr * weight_decay) as f32,
                neg_lr: -lr as f32,
                beta1: betas.0 as f32,
                one_minus_beta1: (1.0 - betas.0) as f32,
                beta2: betas.1 as f32,
                one_minus_beta2: (1.0 - betas.1) as f32,
            },
        }
    }

    /// The same rule without weight decay: optimizer accumulation updates the states with a
    /// micro-batch gradient but neither decays nor moves the parameter (optimi's
    /// `update_parameters=False`).
    pub fn without_decay(self) -> Self {
        match self {
            Rule::Sgd {
                neg_lr,
                momentum,
                one_minus_dampening,
                nesterov,
                has_momentum,
                ..
            } => Rule::Sgd {
                neg_lr,
                wd: 0.0,
                momentum,
                one_minus_dampening,
                nesterov,
                has_momentum,
            },
            Rule::Adam {
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                bias_correction2_sqrt,
                eps,
                neg_step_size,
                given_v,
                ..
            } => Rule::Adam {
                decoupled: false,
                decay: 1.0,
                neg_lr_wd: 0.0,
                wd: 0.0,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                bias_correction2_sqrt,
                eps,
                neg_step_size,
                given_v,
            },
            Rule::Lion {
                neg_lr,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                ..
            } => Rule::Lion {
                decay: 1.0,
                neg_lr_wd: 0.0,
                neg_lr,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
            },
        }
    }

    /// The same rule with the second moment supplied by the caller (a factorized second moment:
    /// `v` is the reconstructed estimate and is not updated element-wise). Only Adam has one.
    pub fn with_given_second_moment(mut self) -> Self {
        if let Rule::Adam { given_v, .. } = &mut self {
            *given_v = true;
        }
        self
    }

    /// The gradient the moments see: Adam with L2 decay folds `wd * p` in first.
    #[inline]
    pub fn moment_gradient(&self, p: f32, g: f32) -> f32 {
        match *self {
            Rule::Adam {
                decoupled: false,
                wd,
                ..
            } if wd != 0.0 => p.mul_add(wd, g),
            _ => g,
        }
    }

    /// `(beta2, 1 - beta2)` of Adam's second moment, as f32.
    pub fn second_moment_betas(&self) -> Option<(f32, f32)> {
        match *self {
            Rule::Adam {
                beta2,
                one_minus_beta2,
                ..
            } => Some((beta2, one_minus_beta2)),
            _ => None,
        }
    }

    /// Updates one element: parameter `p`, gradient `g`, states `m` and `v` (unused ones are
    /// ignored). `first` is true on the parameter's first step (SGD initialises its momentum
    /// buffer with the gradient then, as PyTorch does).
    #[inline(always)]
    pub fn apply(&self, p: f32, g: f32, m: &mut f32, v: &mut f32, first: bool) -> Updated {
        match *self {
            Rule::Sgd {
                neg_lr,
                wd,
                momentum,
                one_minus_dampening,
                nesterov,
                has_momentum,
            } => {
                // grad.add(param, alpha=wd)
                let mut d = if wd != 0.0 { p.mul_add(wd, g) } else { g };
                if has_momentum {
                    // buf = grad (first step) / buf.mul_(momentum).add_(grad, alpha=1-dampening)
                    *m = if first {
                        d
                    } else {
                        d.mul_add(one_minus_dampening, *m * momentum)
                    };
                    // grad.add(buf, alpha=momentum) / grad = buf
                    d = if nesterov { m.mul_add(momentum, d) } else { *m };
                }
                // param.add_(grad, alpha=-lr)
                Updated {
                    param: d.mul_add(neg_lr, p),
                    delta: d * neg_lr,
                }
            }
            Rule::Adam {
                decoupled,
                decay,
                neg_lr_wd,
                wd,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                bias_correction2_sqrt,
                eps,
                neg_step_size,
                given_v,
            } => {
                let (g, decayed, decay_delta) = if decoupled {
                    // param.mul_(1 - lr*wd)
                    (g, p * decay, p * neg_lr_wd)
                } else if wd != 0.0 {
                    // grad.add(param, alpha=wd)
                    (p.mul_add(wd, g), p, 0.0)
                } else {
                    (g, p, 0.0)
                };
                // exp_avg.lerp_(grad, w = 1-beta1): torch's kernel is fma(w, g - m, m) for
                // |w| < 0.5 and fma(w - 1, g - m, g) otherwise (w - 1 in f32).
                *m = if one_minus_beta1 < 0.5 {
                    (g - *m).mul_add(one_minus_beta1, *m)
                } else {
                    (g - *m).mul_add(one_minus_beta1 - 1.0, g)
                };
                // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2): torch's kernel is
                // fma(value * grad, grad, self)
                if !given_v {
                    *v = (one_minus_beta2 * g).mul_add(g, *v * beta2);
                }
                // denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps. IEEE sqrt: torch 2.15's
                // CPU sqrt is off by one ulp on ~18% of inputs, the one difference from torch here.
                let denom = v.sqrt() / bias_correction2_sqrt + eps;
                // param.addcdiv_(exp_avg, denom, value=-step_size)
                let step = neg_step_size * *m / denom;
                Updated {
                    param: decayed + step,
                    delta: decay_delta + step,
                }
            }
            Rule::Lion {
                decay,
                neg_lr_wd,
                neg_lr,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
            } => {
                // p.mul_(1 - lr*wd)
                let decayed = p * decay;
                // update = exp_avg.clone().mul_(beta1).add(grad, alpha=1-beta1).sign_()
                let c = g.mul_add(one_minus_beta1, *m * beta1);
                let u: f32 = if c > 0.0 {
                    1.0
                } else if c < 0.0 {
                    -1.0
                } else {
                    0.0
                };
                // exp_avg.mul_(beta2).add_(grad, alpha=1-beta2)
                *m = g.mul_add(one_minus_beta2, *m * beta2);
                // p.add_(update, alpha=-lr)
                Updated {
                    param: u.mul_add(neg_lr, decayed),
                    delta: p * neg_lr_wd + u * neg_lr,
                }
            }
        }
    }
}

/// One chunk of the fused step's element-wise work: inputs `g` (the gradient, before clipping)
/// and `p`; `m` and `v` updated in place; `p` receives the new parameter and `d` the increment.
#[derive(Debug)]
pub(crate) struct Chunk<'a> {
    pub g: &'a [f32],
    pub p: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub d: &'a mut [f32],
}

lpmm_formats::multiversion! {
    /// Applies `rule` to every element of `c` with the gradient scaled by `clip`. An element whose
    /// gradient is not finite, or whose update would produce a non-finite parameter, increment or
    /// state, is left unchanged (`d = 0`); returns whether any was. Written without branches on
    /// the data so that it vectorizes; every element gets exactly [`Rule::apply`]'s arithmetic.
    pub(crate) fn apply_chunk(rule: Rule, clip: f32, first: bool, c: &mut Chunk<'_>) -> bool {
        #[inline(always)]
        fn run(rule: Rule, clip: f32, first: bool, c: &mut Chunk<'_>) -> bool {
            let n = c.g.len();
            let (g, p, m, v, d) = (&c.g[..n], &mut c.p[..n], &mut c.m[..n], &mut c.v[..n], &mut c.d[..n]);
            let mut bad = false;
            for i in 0..n {
                let gi = g[i] * clip;
                let (p0, m0, v0) = (p[i], m[i], v[i]);
                let (mut mi, mut vi) = (m0, v0);
                let u = rule.apply(p0, gi, &mut mi, &mut vi, first);
                let ok = gi.is_finite()
                    & u.param.is_finite()
                    & u.delta.is_finite()
                    & mi.is_finite()
                    & vi.is_finite();
                m[i] = if ok { mi } else { m0 };
                v[i] = if ok { vi } else { v0 };
                p[i] = if ok { u.param } else { p0 };
                d[i] = if ok { u.delta } else { 0.0 };
                bad |= !ok;
            }
            bad
        }
        // One loop per rule, so the rule's variant is known inside it.
        match rule {
            Rule::Adam { .. } => run(rule, clip, first, c),
            Rule::Sgd { .. } => run(rule, clip, first, c),
            Rule::Lion { .. } => run(rule, clip, first, c),
        }
    }
}
