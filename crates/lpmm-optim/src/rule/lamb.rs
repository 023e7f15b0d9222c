//! LAMB (You et al. 2019), `torch_optimizer.Lamb` semantics ([docs/OPTIMIZERS.md], "LAMB"):
//! Adam's moments, an update `m / (sqrt(v) + eps) + wd * p`, and a step scaled per tensor by the
//! trust ratio `min(||p||, clamp) / ||update||`. The two norms are tensor-wide sums of squares
//! ([`Rule::stats`]) of the parameter and of the update, which the update's first pass computes
//! from the new moments.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;

/// LAMB's hyperparameters (`torch_optimizer.Lamb`'s names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lamb {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the root of the second moment; must be positive.
    pub eps: f64,
    /// Weight decay, added to the update before its norm (`update + wd * p`).
    pub weight_decay: f64,
    /// The parameter's norm is clamped to at most this in the trust ratio.
    pub clamp_value: f64,
    /// Bias correction of the step size, `sqrt(1 - beta2^t) / (1 - beta1^t)` (the paper's
    /// third version has none: off by default).
    pub debias: bool,
}

impl Lamb {
    /// `torch_optimizer.Lamb(lr)` defaults: betas (0.9, 0.999), eps 1e-6, no weight decay,
    /// clamp 10, no bias correction.
    pub fn new(lr: f64) -> Self {
        Lamb {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-6,
            weight_decay: 0.0,
            clamp_value: 10.0,
            debias: false,
        }
    }
}

setters! {
    $ for Lamb {
        /// With other betas.
        pub fn betas(self, beta1: f64, beta2: f64) -> Self {
            Lamb {
                betas: (beta1, beta2),
                ..self
            }
        }

        /// With another eps.
        pub fn eps(self, eps: f64) -> Self {
            Lamb { eps, ..self }
        }

        /// With weight decay `wd` (in the update, under the trust ratio).
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            Lamb {
                weight_decay,
                ..self
            }
        }

        /// With another clamp of the parameter's norm.
        pub fn clamp_value(self, clamp_value: f64) -> Self {
            Lamb {
                clamp_value,
                ..self
            }
        }

        /// With or without bias correction of the step size.
        pub fn debias(self, on: bool) -> Self {
            Lamb { debias: on, ..self }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// f32 LAMB with `torch_optimizer.Lamb`'s defaults: the reference for the LAMB presets (12
    /// bytes per parameter).
    pub fn lamb_f32(lr: f64) -> Preset<Lamb> {
        Preset::f32(Lamb::new(lr))
    }

    /// 8-bit LAMB on an f32 model, in the layout of bitsandbytes' `LAMB8bit` states (first moment
    /// 8-bit dynamic signed, second unsigned, blocks of 256; bitsandbytes' LAMB is AdamW whose
    /// update is scaled down, never up, to at most the parameter's norm: docs/OPTIMIZERS.md,
    /// "LAMB").
    pub fn lamb_8bit(lr: f64) -> Preset<Lamb> {
        lamb_f32(lr)
            .with_state1(Storage::DYNAMIC8_SIGNED)
            .with_state2(Storage::DYNAMIC8_UNSIGNED)
    }

    cases {
        "lamb f32" => lamb_f32(1e-3),
        "lamb 8-bit wd debias" => lamb_8bit(1e-3).weight_decay(0.01).debias(true),
    }
}

kernel_struct! {
    /// LAMB's per-step constants. `neg_step` is set by
    /// [`RuleConsts::combine_stats`](crate::backend::RuleConsts::combine_stats) from the
    /// tensor-wide sums; the last words are read only there.
    pub struct LambConsts {
        /// `beta1`.
        pub beta1: f32,
        /// `1 - beta1`.
        pub one_minus_beta1: f32,
        /// `beta2`.
        pub beta2: f32,
        /// `1 - beta2`.
        pub one_minus_beta2: f32,
        /// eps.
        pub eps: f32,
        /// Weight decay.
        pub wd: f32,
        /// `-step_size * trust_ratio`, in f32.
        pub neg_step: f32,
        /// `-step_size` (`-lr`, times the bias correction with `debias`), in f32.
        pub neg_step_size: f32,
        /// `clamp_value`, in f32.
        pub clamp: f32,
    }
}

/// The moments after this step: `m.mul_(beta1).add_(g, alpha=1-beta1)` and
/// `v.mul_(beta2).addcmul_(g, g, value=1-beta2)`, torch's CPU roundings.
#[inline(always)]
fn moments(c: &LambConsts, f: StepFlags, g: f32, m: f32, v: f32) -> (f32, f32) {
    let m = g.mul_add(c.one_minus_beta1, m * c.beta1);
    let v = if f.has(StepFlags::GIVEN_V) {
        v
    } else {
        (c.one_minus_beta2 * g).mul_add(g, v * c.beta2)
    };
    (m, v)
}

/// The update `m / (sqrt(v) + eps)`, plus `wd * p` (`add_(p, alpha=wd)`, fused) with weight
/// decay.
#[inline(always)]
fn update(c: &LambConsts, p: f32, m: f32, v: f32) -> f32 {
    let u = m / (v.sqrt() + c.eps);
    if c.wd != 0.0 { p.mul_add(c.wd, u) } else { u }
}

impl Rule for Lamb {
    const NAME: &'static str = "lamb";
    type Consts = LambConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![
            ("lamb", Lamb::new(1e-3)),
            (
                "lamb-wd-debias-clamp",
                Lamb::new(1e-3)
                    .weight_decay(0.01)
                    .debias(true)
                    .clamp_value(0.5)
                    .betas(0.8, 0.99),
            ),
        ]
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn states(&self) -> [bool; 3] {
        [true, true, false]
    }

    fn validate(&self) -> Result<(), OptimError> {
        check::finite_non_negative("lr", self.lr)?;
        check::beta("beta1", self.betas.0)?;
        check::beta("beta2", self.betas.1)?;
        check::positive("eps", self.eps)?;
        check::finite_non_negative("weight_decay", self.weight_decay)?;
        check::positive("clamp_value", self.clamp_value)
    }

    fn consts(&self, t: u64, _state: &RuleState) -> LambConsts {
        let (b1, b2) = self.betas;
        let tf = t as f64;
        let bias_correction = if self.debias {
            (1.0 - b2.powf(tf)).sqrt() / (1.0 - b1.powf(tf))
        } else {
            1.0
        };
        let mut c = LambConsts {
            beta1: b1 as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            eps: self.eps as f32,
            wd: self.weight_decay as f32,
            neg_step: 0.0,
            neg_step_size: (-(self.lr * bias_correction)) as f32,
            clamp: self.clamp_value as f32,
        };
        // Without the sums (a backend must combine them before the fused pass): a trust ratio
        // of 1.
        Self::combine_stats(&mut c, &[], 0);
        c
    }

    #[inline(always)]
    fn apply(
        c: &LambConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        let (m1, v1) = moments(c, f, g, *m, *v);
        *m = m1;
        *v = v1;
        if !f.has(StepFlags::UPDATE_PARAM) {
            return Updated {
                param: p,
                delta: 0.0,
            };
        }
        // p.add_(adam_step, alpha=-step_size * trust_ratio)
        let u = update(c, p, m1, v1);
        Updated {
            param: u.mul_add(c.neg_step, p),
            delta: u * c.neg_step,
        }
    }

    fn stats(_c: &LambConsts) -> usize {
        2
    }

    /// Sum 0: the parameter (its norm); sum 1: the update (its norm), from the new moments.
    #[inline(always)]
    fn stat_input(
        c: &LambConsts,
        f: StepFlags,
        k: usize,
        p: f32,
        g: f32,
        m: f32,
        v: f32,
        _w: f32,
    ) -> f32 {
        if k == 0 {
            p
        } else {
            let (m1, v1) = moments(c, f, g, m, v);
            update(c, p, m1, v1)
        }
    }

    /// `trust_ratio = min(||p||, clamp) / ||update||` in f32 (1 where either norm is 0), each
    /// norm the root of its sum rounded to f32; `neg_step = -step_size * trust_ratio` in f32.
    fn combine_stats(c: &mut LambConsts, sums: &[f64], _numel: usize) {
        let norm = |k: usize| sums.get(k).map_or(0.0, |&s| s.sqrt() as f32);
        let weight_norm = norm(0).min(c.clamp);
        let adam_norm = norm(1);
        let trust_ratio = if weight_norm == 0.0 || adam_norm == 0.0 {
            1.0
        } else {
            weight_norm / adam_norm
        };
        c.neg_step = c.neg_step_size * trust_ratio;
    }
}
