//! Lion (Chen et al. 2023), lion-pytorch semantics ([docs/OPTIMIZERS.md], "Lion").
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;

/// Lion's hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lion {
    /// Learning rate.
    pub lr: f64,
    /// Interpolation (beta1) and momentum decay (beta2).
    pub betas: (f64, f64),
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Lion {
    /// lion-pytorch defaults: betas (0.9, 0.99), no weight decay.
    pub fn new(lr: f64) -> Self {
        Lion {
            lr,
            betas: (0.9, 0.99),
            weight_decay: 0.0,
        }
    }
}

setters! {
    $ for Lion {
        /// With other betas.
        pub fn betas(self, beta1: f64, beta2: f64) -> Self {
            Lion {
                betas: (beta1, beta2),
                ..self
            }
        }

        /// With weight decay.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            Lion {
                weight_decay,
                ..self
            }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// f32 Lion: the reference for the Lion presets (12 bytes per parameter).
    pub fn lion_f32(lr: f64) -> Preset<Lion> {
        Preset::f32(Lion::new(lr))
    }

    /// bitsandbytes' `Lion8bit` without paging: f32 parameters and gradients, the momentum 8-bit
    /// dynamic in blocks of 256.
    pub fn lion_8bit(lr: f64) -> Preset<Lion> {
        lion_f32(lr).with_state1(Storage::DYNAMIC8_SIGNED)
    }

    cases {
        "bf16 nearest lion" => bf16_nearest(Lion::new(1e-4)),
    }
}

kernel_struct! {
    /// Lion's per-step constants.
    pub struct LionConsts {
        /// `1 - lr*wd`.
        pub decay: f32,
        /// `-lr*wd` (for the Kahan increment).
        pub neg_lr_wd: f32,
        /// `-lr`.
        pub neg_lr: f32,
        /// `beta1`.
        pub beta1: f32,
        /// `1 - beta1`.
        pub one_minus_beta1: f32,
        /// `beta2`.
        pub beta2: f32,
        /// `1 - beta2`.
        pub one_minus_beta2: f32,
    }
}

impl Rule for Lion {
    const NAME: &'static str = "lion";
    type Consts = LionConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![("lion", Lion::new(1e-4).weight_decay(0.1))]
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn states(&self) -> [bool; 3] {
        [true, false, false]
    }

    fn validate(&self) -> Result<(), OptimError> {
        check::finite_non_negative("lr", self.lr)?;
        if self.betas.0 != 1.0 {
            check::beta("beta1", self.betas.0)?;
        }
        check::beta("beta2", self.betas.1)?;
        check::finite_non_negative("weight_decay", self.weight_decay)
    }

    fn consts(&self, _t: u64, _state: &RuleState) -> LionConsts {
        let (lr, wd, (b1, b2)) = (self.lr, self.weight_decay, self.betas);
        LionConsts {
            decay: (1.0 - lr * wd) as f32,
            neg_lr_wd: (-lr * wd) as f32,
            neg_lr: -lr as f32,
            beta1: b1 as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
        }
    }

    #[inline(always)]
    fn apply(
        c: &LionConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        _v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        // No decay while the parameter does not move (optimizer accumulation).
        let (decay, neg_lr_wd) = if f.has(StepFlags::UPDATE_PARAM) {
            (c.decay, c.neg_lr_wd)
        } else {
            (1.0, 0.0)
        };
        // p.mul_(1 - lr*wd)
        let decayed = p * decay;
        // update = exp_avg.clone().mul_(beta1).add(grad, alpha=1-beta1).sign_()
        let s = g.mul_add(c.one_minus_beta1, *m * c.beta1);
        let u: f32 = if s > 0.0 {
            1.0
        } else if s < 0.0 {
            -1.0
        } else {
            0.0
        };
        // exp_avg.mul_(beta2).add_(grad, alpha=1-beta2)
        *m = g.mul_add(c.one_minus_beta2, *m * c.beta2);
        // p.add_(update, alpha=-lr)
        Updated {
            param: u.mul_add(c.neg_lr, decayed),
            delta: p * neg_lr_wd + u * c.neg_lr,
        }
    }
}
