//! CAME (Luo et al. 2023, "Confidence-guided Adaptive Memory Efficient Optimization"), the
//! authors' `came-pytorch` semantics ([docs/OPTIMIZERS.md], "CAME"): Adafactor's factorized
//! second moment (state 2) and update clipping, a first moment of the clipped update (state 1),
//! and a factorized moving average of the update's instability `(u - m)^2` (state 3) that scales
//! the first moment. Tensors of fewer than two dimensions keep a full second moment and step
//! with the first moment alone (state 3 is not allocated), as the reference does.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Moment, Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;
use crate::vocab::SlotKind;

/// CAME's hyperparameters (the reference's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Came {
    /// Learning rate.
    pub lr: f64,
    /// Decays of the first moment, the second moment and the instability.
    pub betas: (f64, f64, f64),
    /// Added to the squared gradient and to the squared instability.
    pub eps: (f64, f64),
    /// The update's RMS is clipped to this.
    pub clip_threshold: f64,
    /// Decoupled weight decay (`p -= lr * wd * p`).
    pub weight_decay: f64,
}

impl Came {
    /// The reference's defaults: betas (0.9, 0.999, 0.9999), eps (1e-30, 1e-16), clipping at
    /// RMS 1, no weight decay.
    pub fn new(lr: f64) -> Self {
        Came {
            lr,
            betas: (0.9, 0.999, 0.9999),
            eps: (1e-30, 1e-16),
            clip_threshold: 1.0,
            weight_decay: 0.0,
        }
    }
}

setters! {
    $ for Came {
        /// With other betas.
        pub fn betas(self, beta1: f64, beta2: f64, beta3: f64) -> Self {
            Came {
                betas: (beta1, beta2, beta3),
                ..self
            }
        }

        /// With weight decay `wd`.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            Came {
                weight_decay,
                ..self
            }
        }

        /// With other eps.
        pub fn eps(self, eps1: f64, eps2: f64) -> Self {
            Came {
                eps: (eps1, eps2),
                ..self
            }
        }

        /// With another clipping threshold.
        pub fn clip_threshold(self, d: f64) -> Self {
            Came {
                clip_threshold: d,
                ..self
            }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// CAME with the authors' defaults: f32 parameters, gradients and first moment, the second
    /// moment and the instability factorized. The reference for the CAME presets.
    pub fn came_f32(lr: f64) -> Preset<Came> {
        Preset::f32(Came::new(lr))
            .with_state2(Storage::Factorized)
            .with_state3(Storage::Factorized)
    }

    /// CAME with the first moment 8-bit dynamic in blocks of 256; f32 parameters and gradients.
    pub fn came_8bit(lr: f64) -> Preset<Came> {
        came_f32(lr).with_state1(Storage::DYNAMIC8_SIGNED)
    }

    /// CAME with the whole model memory LPMM-style: parameters and gradient accumulator 8-bit
    /// linear in groups of 64 with stochastic rounding (every tensor), the first moment 8-bit
    /// dynamic, the two statistics factorized.
    pub fn came_lpmm(lr: f64) -> Preset<Came> {
        came_8bit(lr)
            .with_param(Storage::LINEAR8_GROUP64_SR)
            .with_grad(Storage::LINEAR8_GROUP64_SR)
            .with_min_quantized_size(0)
    }

    cases {
        "came f32" => came_f32(2e-4),
        "came lpmm" => came_lpmm(2e-4),
    }
}

kernel_struct! {
    /// CAME's per-step constants; `clip_div` is set by [`RuleConsts::combine_stats`](crate::backend::RuleConsts::combine_stats).
    pub struct CameConsts {
        /// `beta1`.
        pub beta1: f32,
        /// `1 - beta1`.
        pub one_minus_beta1: f32,
        /// `beta2`.
        pub beta2: f32,
        /// `1 - beta2`.
        pub one_minus_beta2: f32,
        /// `beta3`.
        pub beta3: f32,
        /// `1 - beta3`.
        pub one_minus_beta3: f32,
        /// `eps1`.
        pub eps1: f32,
        /// `eps2`.
        pub eps2: f32,
        /// `lr`.
        pub lr: f32,
        /// `-wd * lr`.
        pub neg_lr_wd: f32,
        /// `max(1, RMS(update) / clip_threshold)`.
        pub clip_div: f32,
        /// `clip_threshold`.
        pub clip_threshold: f32,
    }
}

/// The unclipped update `g / sqrt(v)`, `v` the new second moment (given, or updated here with
/// torch's roundings).
#[inline(always)]
fn unscaled(c: &CameConsts, f: StepFlags, g: f32, v: &mut f32) -> f32 {
    if !f.has(StepFlags::GIVEN_V) {
        *v = (g * g + c.eps1).mul_add(c.one_minus_beta2, *v * c.beta2);
    }
    g / v.sqrt()
}

/// The clipped update and the new first moment.
#[inline(always)]
fn moments(c: &CameConsts, f: StepFlags, g: f32, m: f32, v: &mut f32) -> (f32, f32) {
    let u = unscaled(c, f, g, v) / c.clip_div;
    // exp_avg.mul_(beta1).add_(update, alpha=1-beta1)
    (u, u.mul_add(c.one_minus_beta1, m * c.beta1))
}

impl Rule for Came {
    const NAME: &'static str = "came";
    type Consts = CameConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![("came-wd", Came::new(2e-4).weight_decay(0.1))]
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
        check::positive("eps1", self.eps.0)?;
        check::positive("eps2", self.eps.1)?;
        check::positive("clip_threshold", self.clip_threshold)?;
        check::finite_non_negative("weight_decay", self.weight_decay)
    }

    fn consts(&self, _t: u64, _state: &RuleState) -> CameConsts {
        let (b1, b2, b3) = self.betas;
        CameConsts {
            beta1: b1 as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            beta3: b3 as f32,
            one_minus_beta3: (1.0 - b3) as f32,
            eps1: self.eps.0 as f32,
            eps2: self.eps.1 as f32,
            lr: self.lr as f32,
            neg_lr_wd: (-self.weight_decay * self.lr) as f32,
            clip_div: 1.0,
            clip_threshold: self.clip_threshold as f32,
        }
    }

    #[inline(always)]
    fn apply(
        c: &CameConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        w: &mut f32,
    ) -> Updated {
        let (_, m1) = moments(c, f, g, *m, v);
        *m = m1;
        // Factorized instability (given): update = exp_avg / sqrt(S); else update = exp_avg.
        let u = if f.has(StepFlags::GIVEN_W) {
            m1 / w.sqrt()
        } else {
            m1
        };
        let decay = if f.has(StepFlags::UPDATE_PARAM) {
            c.neg_lr_wd
        } else {
            0.0
        };
        // p.add_(p, alpha=-wd*lr); update.mul_(lr); p.add_(-update)
        let step = u * c.lr;
        Updated {
            param: p.mul_add(decay, p) - step,
            delta: p.mul_add(decay, -step),
        }
    }

    fn factorable(slot: SlotKind) -> bool {
        matches!(slot, SlotKind::State2 | SlotKind::State3)
    }

    /// The instability is an average of squares CAME only reads as a factorized reconstruction.
    fn needs_factorized(slot: SlotKind) -> Option<&'static str> {
        (slot == SlotKind::State3).then_some("CAME's instability is factorized")
    }

    fn moment(c: &CameConsts, slot: SlotKind) -> Option<Moment> {
        match slot {
            SlotKind::State2 => Some(Moment {
                beta: c.beta2,
                one_minus_beta: c.one_minus_beta2,
                eps: c.eps1,
            }),
            SlotKind::State3 => Some(Moment {
                beta: c.beta3,
                one_minus_beta: c.one_minus_beta3,
                eps: c.eps2,
            }),
            _ => None,
        }
    }

    /// State 2: the gradient; state 3: the instability `u - m` of the clipped update against
    /// the new first moment.
    #[inline(always)]
    fn moment_input(
        c: &CameConsts,
        f: StepFlags,
        slot: SlotKind,
        _p: f32,
        g: f32,
        m: f32,
        mut v: f32,
        _w: f32,
    ) -> f32 {
        if slot == SlotKind::State3 {
            let (u, m1) = moments(c, f, g, m, &mut v);
            u - m1
        } else {
            g
        }
    }

    fn stats(_c: &CameConsts) -> usize {
        1
    }

    #[inline(always)]
    fn stat_input(
        c: &CameConsts,
        f: StepFlags,
        _k: usize,
        _p: f32,
        g: f32,
        _m: f32,
        mut v: f32,
        _w: f32,
    ) -> f32 {
        unscaled(c, f, g, &mut v)
    }

    fn combine_stats(c: &mut CameConsts, sums: &[f64], numel: usize) {
        let rms = match sums.first() {
            Some(&s) if numel > 0 => (s / numel as f64).sqrt(),
            _ => 0.0,
        };
        c.clip_div = (rms / f64::from(c.clip_threshold)).max(1.0) as f32;
    }
}
