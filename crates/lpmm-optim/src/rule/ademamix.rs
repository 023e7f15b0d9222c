//! AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better, Faster, Older"),
//! bitsandbytes' `AdEMAMix` semantics ([docs/OPTIMIZERS.md], "AdEMAMix"): Adam's fast first
//! moment (state 1) and second moment (state 2), plus a slow first moment (state 3, decay
//! `beta3`) mixed in with weight `alpha`; optional warmups of `alpha` and `beta3`.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;

/// AdEMAMix's hyperparameters (bitsandbytes' names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdEMAMix {
    /// Learning rate.
    pub lr: f64,
    /// Decays of the fast first moment, the second moment and the slow first moment.
    pub betas: (f64, f64, f64),
    /// The slow moment's weight.
    pub alpha: f64,
    /// Added to the bias-corrected root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Steps over which `alpha` grows linearly from 0 (`None`: no warmup).
    pub t_alpha: Option<u64>,
    /// Steps over which `beta3` grows from `beta1` (`None`: no warmup).
    pub t_beta3: Option<u64>,
}

impl AdEMAMix {
    /// bitsandbytes' defaults: betas (0.9, 0.999, 0.9999), alpha 5, eps 1e-8, weight decay
    /// 0.01, no warmups.
    pub fn new(lr: f64) -> Self {
        AdEMAMix {
            lr,
            betas: (0.9, 0.999, 0.9999),
            alpha: 5.0,
            eps: 1e-8,
            weight_decay: 0.01,
            t_alpha: None,
            t_beta3: None,
        }
    }

    /// `alpha` at step `t` (bitsandbytes' `_get_alpha`).
    pub fn alpha_at(&self, t: u64) -> f64 {
        match self.t_alpha {
            Some(ta) if ta > 0 => (t as f64 * self.alpha / ta as f64).min(self.alpha),
            _ => self.alpha,
        }
    }

    /// `beta3` at step `t` (bitsandbytes' `_get_beta3`: `beta1` at step 0, growing so that
    /// the moment's half-life grows linearly, `beta3` from `t_beta3` on).
    pub fn beta3_at(&self, t: u64) -> f64 {
        let (b1, _, b3) = self.betas;
        match self.t_beta3 {
            Some(tb) if tb > 0 => {
                let (ln1, ln3) = (b1.ln(), b3.ln());
                let s = t as f64 / tb as f64;
                ((ln1 * ln3) / ((1.0 - s) * ln3 + s * ln1)).exp().min(b3)
            }
            _ => b3,
        }
    }
}

setters! {
    $ for AdEMAMix {
        /// With other betas.
        pub fn betas(self, beta1: f64, beta2: f64, beta3: f64) -> Self {
            AdEMAMix {
                betas: (beta1, beta2, beta3),
                ..self
            }
        }

        /// With another alpha.
        pub fn alpha(self, alpha: f64) -> Self {
            AdEMAMix { alpha, ..self }
        }

        /// With weight decay `wd`.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            AdEMAMix {
                weight_decay,
                ..self
            }
        }

        /// With another eps.
        pub fn eps(self, eps: f64) -> Self {
            AdEMAMix { eps, ..self }
        }

        /// With warmups of `alpha` and `beta3` over these many steps.
        pub fn warmup(self, t_alpha: Option<u64>, t_beta3: Option<u64>) -> Self {
            AdEMAMix {
                t_alpha,
                t_beta3,
                ..self
            }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// AdEMAMix with bitsandbytes' defaults, everything f32: the reference for the AdEMAMix
    /// presets.
    pub fn ademamix_f32(lr: f64) -> Preset<AdEMAMix> {
        Preset::f32(AdEMAMix::new(lr))
    }

    /// bitsandbytes' `AdEMAMix8bit`: f32 parameters and gradients, both first moments 8-bit dynamic
    /// signed and the second moment 8-bit dynamic unsigned, in blocks of 256.
    pub fn ademamix_8bit(lr: f64) -> Preset<AdEMAMix> {
        ademamix_f32(lr)
            .with_state1(Storage::DYNAMIC8_SIGNED)
            .with_state2(Storage::DYNAMIC8_UNSIGNED)
            .with_state3(Storage::DYNAMIC8_SIGNED)
    }

    cases {
        "ademamix 8-bit" => ademamix_8bit(1e-3).warmup(Some(3), Some(3)),
    }
}

kernel_struct! {
    /// AdEMAMix's per-step constants.
    pub struct AdEMAMixConsts {
        /// `beta1`.
        pub beta1: f32,
        /// `1 - beta1`.
        pub one_minus_beta1: f32,
        /// `beta2`.
        pub beta2: f32,
        /// `1 - beta2`.
        pub one_minus_beta2: f32,
        /// `beta3` at this step.
        pub beta3: f32,
        /// `1 - beta3` at this step.
        pub one_minus_beta3: f32,
        /// `alpha` at this step.
        pub alpha: f32,
        /// `1 - beta1^t`.
        pub bias_correction1: f32,
        /// `sqrt(1 - beta2^t)`.
        pub bias_correction2_sqrt: f32,
        /// eps.
        pub eps: f32,
        /// `1 - lr * wd`.
        pub decay: f32,
        /// `-lr * wd`.
        pub neg_lr_wd: f32,
        /// `-lr`.
        pub neg_lr: f32,
    }
}

impl Rule for AdEMAMix {
    const NAME: &'static str = "ademamix";
    type Consts = AdEMAMixConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![(
            "ademamix-warmup",
            AdEMAMix::new(1e-3).warmup(Some(2), Some(3)),
        )]
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn states(&self) -> [bool; 3] {
        [true, true, true]
    }

    fn validate(&self) -> Result<(), OptimError> {
        check::finite_non_negative("lr", self.lr)?;
        check::beta("beta1", self.betas.0)?;
        check::beta("beta2", self.betas.1)?;
        check::beta("beta3", self.betas.2)?;
        check::finite_non_negative("alpha", self.alpha)?;
        check::positive("eps", self.eps)?;
        check::finite_non_negative("weight_decay", self.weight_decay)?;
        if self.t_beta3.is_some() && self.betas.0 == 0.0 {
            // ln(beta1) would be -inf.
            return Err(OptimError::Hyperparameter {
                name: "beta1",
                value: self.betas.0,
            });
        }
        Ok(())
    }

    fn consts(&self, t: u64, _state: &RuleState) -> AdEMAMixConsts {
        let (lr, wd, (b1, b2, _)) = (self.lr, self.weight_decay, self.betas);
        let tf = t as f64;
        let b3 = self.beta3_at(t);
        AdEMAMixConsts {
            beta1: b1 as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            beta3: b3 as f32,
            one_minus_beta3: (1.0 - b3) as f32,
            alpha: self.alpha_at(t) as f32,
            bias_correction1: (1.0 - b1.powf(tf)) as f32,
            bias_correction2_sqrt: (1.0 - b2.powf(tf)).sqrt() as f32,
            eps: self.eps as f32,
            decay: (1.0 - lr * wd) as f32,
            neg_lr_wd: (-lr * wd) as f32,
            neg_lr: -lr as f32,
        }
    }

    #[inline(always)]
    fn apply(
        c: &AdEMAMixConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        w: &mut f32,
    ) -> Updated {
        // m1.mul_(beta1).add_(grad, alpha=1-beta1); m2 likewise with beta3;
        // nu.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
        *m = g.mul_add(c.one_minus_beta1, *m * c.beta1);
        *w = g.mul_add(c.one_minus_beta3, *w * c.beta3);
        *v = (c.one_minus_beta2 * g).mul_add(g, *v * c.beta2);
        // update = (m1 / bc1 + alpha * m2) / (sqrt(nu) / sqrt(bc2) + eps)
        let denom = v.sqrt() / c.bias_correction2_sqrt + c.eps;
        let update = (*m / c.bias_correction1 + c.alpha * *w) / denom;
        // p.mul_(1 - lr*wd); p.add_(update, alpha=-lr). No decay while the parameter does not
        // move.
        let (decay, neg_lr_wd) = if f.has(StepFlags::UPDATE_PARAM) {
            (c.decay, c.neg_lr_wd)
        } else {
            (1.0, 0.0)
        };
        Updated {
            param: update.mul_add(c.neg_lr, p * decay),
            delta: update.mul_add(c.neg_lr, p * neg_lr_wd),
        }
    }
}
