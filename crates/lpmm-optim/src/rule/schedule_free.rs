//! Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"), the `schedulefree`
//! package's `AdamWScheduleFree` semantics ([docs/OPTIMIZERS.md], "Schedule-free AdamW"). The
//! parameter holds the training point `y`; state 1 is the base sequence `z` (the parameter's
//! value at the first step), state 2 Adam's second moment. The averaged point `x`, where the
//! model is evaluated, is `y` moved towards `z`: [`Rule::transform`] switches the parameter
//! between the two (the package's `eval()` and `train()`). The averaging weights depend on every
//! step's learning rate, so the largest scheduled rate and the sum of the weights are host state
//! ([`RuleState`]), saved in checkpoints.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;

/// Schedule-free AdamW's hyperparameters (the package's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleFreeAdamW {
    /// Learning rate.
    pub lr: f64,
    /// `beta1` (the interpolation between `z` and `x`) and the second moment's decay.
    pub betas: (f64, f64),
    /// Added to the bias-corrected root of the second moment.
    pub eps: f64,
    /// Weight decay, applied at `y` through the normalized gradient.
    pub weight_decay: f64,
    /// Linear warmup of the learning rate over these many steps.
    pub warmup_steps: u64,
    /// The averaging weight's power of the step (`(t)^r`).
    pub r: f64,
    /// The averaging weight's power of the largest learning rate so far.
    pub weight_lr_power: f64,
}

impl ScheduleFreeAdamW {
    /// The package's defaults: betas (0.9, 0.999), eps 1e-8, no weight decay, no warmup, r 0,
    /// weight_lr_power 2.
    pub fn new(lr: f64) -> Self {
        ScheduleFreeAdamW {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            warmup_steps: 0,
            r: 0.0,
            weight_lr_power: 2.0,
        }
    }

    /// The scheduled learning rate of step `t` (the linear warmup).
    fn scheduled_lr(&self, t: u64) -> f64 {
        let k = t - 1;
        let sched = if k < self.warmup_steps {
            (k + 1) as f64 / self.warmup_steps as f64
        } else {
            1.0
        };
        self.lr * sched
    }
}

setters! {
    $ for ScheduleFreeAdamW {
        /// With other betas.
        pub fn betas(self, beta1: f64, beta2: f64) -> Self {
            ScheduleFreeAdamW {
                betas: (beta1, beta2),
                ..self
            }
        }

        /// With weight decay `wd`.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            ScheduleFreeAdamW {
                weight_decay,
                ..self
            }
        }

        /// With a linear warmup over `steps`.
        pub fn warmup_steps(self, steps: u64) -> Self {
            ScheduleFreeAdamW {
                warmup_steps: steps,
                ..self
            }
        }

        /// With another eps.
        pub fn eps(self, eps: f64) -> Self {
            ScheduleFreeAdamW { eps, ..self }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// Schedule-free AdamW with the package's defaults, everything f32: the reference.
    pub fn schedule_free_adamw_f32(lr: f64) -> Preset<ScheduleFreeAdamW> {
        Preset::f32(ScheduleFreeAdamW::new(lr))
    }

    /// Schedule-free AdamW with the second moment 8-bit dynamic (blocks of 256) and the base
    /// sequence `z` in bf16 with stochastic rounding; f32 parameters and gradients.
    pub fn schedule_free_adamw_8bit(lr: f64) -> Preset<ScheduleFreeAdamW> {
        schedule_free_adamw_f32(lr)
            .with_state1(Storage::Bf16(StoreRounding::Stochastic))
            .with_state2(Storage::DYNAMIC8_UNSIGNED)
    }

    cases {
        "schedule-free 8-bit" => schedule_free_adamw_8bit(1e-3),
    }
}

kernel_struct! {
    /// Schedule-free AdamW's per-step constants.
    pub struct ScheduleFreeConsts {
        /// `ckp1 = weight / weight_sum` (the step), or the transform's interpolation weight.
        pub ckp1: f32,
        /// `lr * (beta1 * (1 - ckp1) - 1)`: the gradient's weight in `y`.
        pub y_step: f32,
        /// `-lr`: the gradient's weight in `z`.
        pub neg_lr: f32,
        /// `beta2`.
        pub beta2: f32,
        /// `1 - beta2`.
        pub one_minus_beta2: f32,
        /// `1 - beta2^t`.
        pub bias_correction2: f32,
        /// eps.
        pub eps: f32,
        /// Weight decay.
        pub wd: f32,
    }
}

/// Torch's `lerp_(end, weight)` on the CPU: `a + w (b - a)` fused for `|w| < 0.5`, else
/// `b - (b - a)(1 - w)`, i.e. `fma(w - 1, b - a, b)`.
#[inline(always)]
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        w.mul_add(b - a, a)
    } else {
        (w - 1.0).mul_add(b - a, b)
    }
}

impl Rule for ScheduleFreeAdamW {
    const NAME: &'static str = "schedule_free";
    type Consts = ScheduleFreeConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![(
            "schedule-free-warmup-wd",
            ScheduleFreeAdamW::new(2.5e-3)
                .warmup_steps(2)
                .weight_decay(0.1),
        )]
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
        // beta1 = 0 would make the evaluation point's transform divide by zero.
        check::positive("beta1", self.betas.0)?;
        check::beta("beta1", self.betas.0)?;
        check::beta("beta2", self.betas.1)?;
        check::positive("eps", self.eps)?;
        check::finite_non_negative("weight_decay", self.weight_decay)?;
        check::finite_non_negative("r", self.r)?;
        check::finite_non_negative("weight_lr_power", self.weight_lr_power)
    }

    /// `[lr_max, weight_sum]`: `lr_max = max(lr_max, lr_t)`, `weight = t^r lr_max^power`,
    /// `weight_sum += weight`.
    fn advance(&self, t: u64, state: RuleState) -> RuleState {
        let [lr_max, weight_sum] = state.0;
        let lr_max = lr_max.max(self.scheduled_lr(t));
        let weight = (t as f64).powf(self.r) * lr_max.powf(self.weight_lr_power);
        RuleState([lr_max, weight_sum + weight])
    }

    fn consts(&self, t: u64, state: &RuleState) -> ScheduleFreeConsts {
        let [lr_max, weight_sum] = state.0;
        let lr = self.scheduled_lr(t);
        let weight = (t as f64).powf(self.r) * lr_max.powf(self.weight_lr_power);
        let ckp1 = if weight_sum > 0.0 {
            weight / weight_sum
        } else {
            0.0
        };
        let (b1, b2) = self.betas;
        ScheduleFreeConsts {
            ckp1: ckp1 as f32,
            y_step: (lr * (b1 * (1.0 - ckp1) - 1.0)) as f32,
            neg_lr: -lr as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            bias_correction2: (1.0 - b2.powf(t as f64)) as f32,
            eps: self.eps as f32,
            wd: self.weight_decay as f32,
        }
    }

    #[inline(always)]
    fn apply(
        c: &ScheduleFreeConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        if f.has(StepFlags::TRANSFORM) {
            // p.lerp_(z, weight): to x (eval) or back to y (train).
            let q = lerp(p, *m, c.ckp1);
            return Updated {
                param: q,
                delta: q - p,
            };
        }
        // z = clone(p) at the first step.
        if f.has(StepFlags::FIRST) {
            *m = p;
        }
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
        *v = (c.one_minus_beta2 * g).mul_add(g, *v * c.beta2);
        // grad_normalized = grad / (sqrt(exp_avg_sq / bias_correction2) + eps); + decay * y
        let mut gn = g / ((*v / c.bias_correction2).sqrt() + c.eps);
        if f.has(StepFlags::UPDATE_PARAM) && c.wd != 0.0 {
            gn = p.mul_add(c.wd, gn);
        }
        if !f.has(StepFlags::UPDATE_PARAM) {
            return Updated {
                param: p,
                delta: 0.0,
            };
        }
        // y.lerp_(z, ckp1); y.add_(grad_normalized, alpha=lr*(beta1*(1-ckp1)-1));
        // z.sub_(grad_normalized, alpha=lr)
        let y = gn.mul_add(c.y_step, lerp(p, *m, c.ckp1));
        *m = gn.mul_add(c.neg_lr, *m);
        Updated {
            param: y,
            delta: y - p,
        }
    }

    fn transform(&self, eval: bool) -> Option<ScheduleFreeConsts> {
        let b1 = self.betas.0;
        let weight = if eval { 1.0 - 1.0 / b1 } else { 1.0 - b1 };
        Some(ScheduleFreeConsts {
            ckp1: weight as f32,
            ..self.consts(1, &RuleState::default())
        })
    }
}
