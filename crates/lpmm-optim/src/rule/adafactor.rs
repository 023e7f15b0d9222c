//! Adafactor (Shazeer & Stern 2018), `transformers.optimization.Adafactor` semantics
//! ([docs/OPTIMIZERS.md], "Adafactor"): a second moment that is factorized for tensors of two or
//! more dimensions (state 2, [`crate::Storage::Factorized`]), an optional first moment of the
//! scaled update (state 1), update clipping by the update's RMS, and an optional step size
//! relative to the step count and the parameter's RMS. The two RMS values are tensor-wide sums
//! of squares ([`Rule::stats`]).
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Moment, Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;
use crate::vocab::SlotKind;

/// Adafactor's hyperparameters (`transformers`' names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adafactor {
    /// The learning rate when `relative_step` is off (then the step size; with
    /// `scale_parameter` it is multiplied by the parameter's RMS). Ignored with `relative_step`.
    pub lr: f64,
    /// `eps1`, added to the squared gradient, and `eps2`, the least parameter scale.
    pub eps: (f64, f64),
    /// The update's RMS is clipped to this.
    pub clip_threshold: f64,
    /// `beta2_t = 1 - t^decay_rate` (negative).
    pub decay_rate: f64,
    /// The first moment's decay; `None`: no first moment (no state 1).
    pub beta1: Option<f64>,
    /// Decoupled weight decay, scaled by the step size.
    pub weight_decay: f64,
    /// The step size is multiplied by `max(eps2, RMS(p))`.
    pub scale_parameter: bool,
    /// The step size is `min(1e-2, 1/sqrt(t))` (with `warmup_init`: `min(1e-6 t, 1/sqrt(t))`)
    /// instead of `lr`.
    pub relative_step: bool,
    /// See `relative_step`.
    pub warmup_init: bool,
}

impl Default for Adafactor {
    fn default() -> Self {
        Self::new()
    }
}

impl Adafactor {
    /// `transformers`' defaults: relative step, parameter scaling, no first moment, no weight
    /// decay, `eps = (1e-30, 1e-3)`, `clip_threshold = 1`, `decay_rate = -0.8`.
    pub fn new() -> Self {
        Adafactor {
            lr: 0.0,
            eps: (1e-30, 1e-3),
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            weight_decay: 0.0,
            scale_parameter: true,
            relative_step: true,
            warmup_init: false,
        }
    }

    /// A fixed learning rate `lr` (relative step off), parameter scaling kept.
    pub fn with_lr(lr: f64) -> Self {
        Adafactor {
            lr,
            relative_step: false,
            ..Self::new()
        }
    }
}

setters! {
    $ for Adafactor {
        /// With a first moment of decay `beta1`.
        pub fn beta1(self, beta1: f64) -> Self {
            Adafactor {
                beta1: Some(beta1),
                ..self
            }
        }

        /// With weight decay `wd`.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            Adafactor {
                weight_decay,
                ..self
            }
        }

        /// With or without parameter scaling.
        pub fn scale_parameter(self, on: bool) -> Self {
            Adafactor {
                scale_parameter: on,
                ..self
            }
        }

        /// With warmup of the relative step.
        pub fn warmup_init(self, on: bool) -> Self {
            Adafactor {
                warmup_init: on,
                ..self
            }
        }

        /// With another clipping threshold.
        pub fn clip_threshold(self, d: f64) -> Self {
            Adafactor {
                clip_threshold: d,
                ..self
            }
        }

        /// With another decay rate of `beta2_t`.
        pub fn decay_rate(self, c: f64) -> Self {
            Adafactor {
                decay_rate: c,
                ..self
            }
        }

        /// With other `eps1`, `eps2`.
        pub fn eps(self, eps1: f64, eps2: f64) -> Self {
            Adafactor {
                eps: (eps1, eps2),
                ..self
            }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// Adafactor as `transformers` defaults it (relative step size scaled by the parameter's RMS,
    /// no first moment, update clipping): f32 parameters and gradients, the second moment
    /// factorized (a full f32 one for vectors). The reference for the Adafactor presets.
    pub fn adafactor_f32() -> Preset<Adafactor> {
        Preset::f32(Adafactor::new()).with_state2(Storage::Factorized)
    }

    /// Adafactor with a first moment (`beta1 = 0.9`) stored 8-bit dynamic in blocks of 256, the
    /// second moment factorized, f32 parameters and gradients.
    pub fn adafactor_8bit() -> Preset<Adafactor> {
        adafactor_f32()
            .beta1(0.9)
            .with_state1(Storage::DYNAMIC8_SIGNED)
    }

    /// Adafactor with the whole model memory LPMM-style: parameters and gradient accumulator 8-bit
    /// linear in groups of 64 with stochastic rounding (every tensor, no minimum size), the first
    /// moment (`beta1 = 0.9`) 8-bit dynamic, the second moment factorized.
    pub fn adafactor_lpmm() -> Preset<Adafactor> {
        adafactor_8bit()
            .with_param(Storage::LINEAR8_GROUP64_SR)
            .with_grad(Storage::LINEAR8_GROUP64_SR)
            .with_min_quantized_size(0)
    }

    cases {
        "adafactor f32" => adafactor_f32(),
        "adafactor 8-bit" => adafactor_8bit(),
        "adafactor lpmm" => adafactor_lpmm(),
    }
}

kernel_struct! {
    /// Adafactor's per-step constants. `step`, `neg_step`, `neg_step_wd` and `clip_div` are set
    /// by [`RuleConsts::combine_stats`](crate::backend::RuleConsts::combine_stats) from the tensor-wide sums; the last words are read only there.
    pub struct AdafactorConsts {
        /// `beta2_t = 1 - t^decay_rate`.
        pub beta2t: f32,
        /// `1 - beta2_t`.
        pub one_minus_beta2t: f32,
        /// `eps1`.
        pub eps1: f32,
        /// `beta1` (with a first moment).
        pub beta1: f32,
        /// `1 - beta1`.
        pub one_minus_beta1: f32,
        /// Bit 0: a first moment; bit 1: the first sum is the parameter's (scaling).
        pub mode: u32,
        /// The step size `lr_t`.
        pub step: f32,
        /// `-wd * lr_t`.
        pub neg_step_wd: f32,
        /// `max(1, RMS(update) / clip_threshold)`.
        pub clip_div: f32,
        /// The step size before parameter scaling, f64 bits (low word).
        pub rel_lo: u32,
        /// High word.
        pub rel_hi: u32,
        /// `eps2`.
        pub eps2: f32,
        /// `clip_threshold`.
        pub clip_threshold: f32,
        /// `weight_decay`.
        pub wd: f32,
    }
}

const FIRST_MOMENT: u32 = 1;
const SCALE: u32 = 2;

/// The new second moment of a full (not factorized) state: `beta2_t v + (1 - beta2_t)(g^2 +
/// eps1)` with torch's roundings (`mul_`, then `add_(.., alpha)` fused).
#[inline(always)]
fn second_moment(c: &AdafactorConsts, g: f32, v: f32) -> f32 {
    (g * g + c.eps1).mul_add(c.one_minus_beta2t, v * c.beta2t)
}

/// The unclipped update `g / sqrt(v)`, `v` the new second moment (given, or updated here).
#[inline(always)]
fn unscaled(c: &AdafactorConsts, f: StepFlags, g: f32, v: &mut f32) -> f32 {
    if !f.has(StepFlags::GIVEN_V) {
        *v = second_moment(c, g, *v);
    }
    g / v.sqrt()
}

impl Rule for Adafactor {
    const NAME: &'static str = "adafactor";
    type Consts = AdafactorConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![(
            "adafactor-beta1-wd",
            Adafactor::new().beta1(0.9).weight_decay(0.1),
        )]
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn fix_lr(&mut self, lr: f64) {
        self.lr = lr;
        self.relative_step = false;
    }

    fn states(&self) -> [bool; 3] {
        [self.beta1.is_some(), true, false]
    }

    fn validate(&self) -> Result<(), OptimError> {
        check::finite_non_negative("lr", self.lr)?;
        check::relative_moment(self.eps, self.clip_threshold, self.decay_rate)?;
        if let Some(b1) = self.beta1 {
            check::beta("beta1", b1)?;
        }
        check::finite_non_negative("weight_decay", self.weight_decay)
    }

    fn consts(&self, t: u64, _state: &RuleState) -> AdafactorConsts {
        let tf = t as f64;
        let beta2t = 1.0 - tf.powf(self.decay_rate);
        let rel = if self.relative_step {
            let min_step = if self.warmup_init { 1e-6 * tf } else { 1e-2 };
            min_step.min(1.0 / tf.sqrt())
        } else {
            self.lr
        };
        let b1 = self.beta1.unwrap_or(0.0);
        let mut c = AdafactorConsts {
            beta2t: beta2t as f32,
            one_minus_beta2t: (1.0 - beta2t) as f32,
            eps1: self.eps.0 as f32,
            beta1: b1 as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            mode: if self.beta1.is_some() {
                FIRST_MOMENT
            } else {
                0
            } | if self.scale_parameter { SCALE } else { 0 },
            step: 0.0,
            neg_step_wd: 0.0,
            clip_div: 1.0,
            rel_lo: rel.to_bits() as u32,
            rel_hi: (rel.to_bits() >> 32) as u32,
            eps2: self.eps.1 as f32,
            clip_threshold: self.clip_threshold as f32,
            wd: self.weight_decay as f32,
        };
        // Without the sums (a backend must combine them before the fused pass): no scaling,
        // no clipping.
        Self::combine_stats(&mut c, &[], 0);
        c
    }

    #[inline(always)]
    fn apply(
        c: &AdafactorConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        // update = g / sqrt(v); update.div_(clip); update.mul_(lr)
        let u = unscaled(c, f, g, v) / c.clip_div * c.step;
        // exp_avg.mul_(beta1).add_(update, alpha=1-beta1); update = exp_avg
        let u = if c.mode & FIRST_MOMENT != 0 {
            *m = u.mul_add(c.one_minus_beta1, *m * c.beta1);
            *m
        } else {
            u
        };
        // p.add_(p, alpha=-wd*lr); p.add_(-update). No decay while the parameter does not move.
        let decay = if f.has(StepFlags::UPDATE_PARAM) {
            c.neg_step_wd
        } else {
            0.0
        };
        let decayed = p.mul_add(decay, p);
        Updated {
            param: decayed - u,
            delta: p.mul_add(decay, -u),
        }
    }

    fn factorable(slot: SlotKind) -> bool {
        slot == SlotKind::State2
    }

    fn moment(c: &AdafactorConsts, slot: SlotKind) -> Option<Moment> {
        (slot == SlotKind::State2).then_some(Moment {
            beta: c.beta2t,
            one_minus_beta: c.one_minus_beta2t,
            eps: c.eps1,
        })
    }

    fn stats(c: &AdafactorConsts) -> usize {
        1 + usize::from(c.mode & SCALE != 0)
    }

    #[inline(always)]
    fn stat_input(
        c: &AdafactorConsts,
        f: StepFlags,
        k: usize,
        p: f32,
        g: f32,
        _m: f32,
        mut v: f32,
        _w: f32,
    ) -> f32 {
        if k == 0 && c.mode & SCALE != 0 {
            p
        } else {
            unscaled(c, f, g, &mut v)
        }
    }

    fn combine_stats(c: &mut AdafactorConsts, sums: &[f64], numel: usize) {
        let rms = |k: usize| match sums.get(k) {
            Some(&s) if numel > 0 => (s / numel as f64).sqrt(),
            _ => 0.0,
        };
        let rel = f64::from_bits(u64::from(c.rel_lo) | u64::from(c.rel_hi) << 32);
        let scaled = c.mode & SCALE != 0;
        let scale = if scaled {
            f64::from(c.eps2).max(rms(0))
        } else {
            1.0
        };
        let step = (scale * rel) as f32;
        c.step = step;
        c.neg_step_wd = (-f64::from(c.wd) * f64::from(step)) as f32;
        let u = rms(usize::from(scaled));
        c.clip_div = (u / f64::from(c.clip_threshold)).max(1.0) as f32;
    }
}
