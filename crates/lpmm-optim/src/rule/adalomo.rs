//! AdaLomo (Lv et al. 2023, "AdaLomo: Low-memory Optimization with Adaptive Learning Rate"),
//! the authors' `lomo-optim` 0.1.1 `AdaLomo` semantics ([docs/OPTIMIZERS.md], "AdaLomo"): no
//! first moment, a second moment factorized for matrices (state 2,
//! [`crate::Storage::Factorized`]; a full one for vectors), the update `g / sqrt(v)` divided by
//! `max(1, RMS(update) / clip_threshold)`, and a step size `lr * max(eps2, RMS(p))`. The two
//! RMS values are tensor-wide sums of squares ([`Rule::stats`]). It is meant to step each
//! parameter as its gradient is released (`Step::param`, no gradient memory: the presets here
//! keep none).
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Moment, Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;
use crate::vocab::SlotKind;

/// AdaLomo's hyperparameters (`lomo_optim.AdaLomo`'s names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdaLomo {
    /// The learning rate, multiplied by `max(eps2, RMS(p))`.
    pub lr: f64,
    /// `eps1`, added to the squared gradient, and `eps2`, the least parameter scale.
    pub eps: (f64, f64),
    /// The update's RMS is clipped to this.
    pub clip_threshold: f64,
    /// `beta2_t = 1 - t^decay_rate` (negative).
    pub decay_rate: f64,
    /// Decoupled weight decay, scaled by the step size.
    pub weight_decay: f64,
    /// Each gradient value is clamped to `[-v, v]` first (`None`: not clamped).
    pub clip_grad_value: Option<f64>,
}

impl AdaLomo {
    /// `lomo_optim.AdaLomo(model, lr)` defaults: `eps = (1e-30, 1e-3)`, `clip_threshold = 1`,
    /// `decay_rate = -0.8`, no weight decay, no clamping.
    pub fn new(lr: f64) -> Self {
        AdaLomo {
            lr,
            eps: (1e-30, 1e-3),
            clip_threshold: 1.0,
            decay_rate: -0.8,
            weight_decay: 0.0,
            clip_grad_value: None,
        }
    }
}

setters! {
    $ for AdaLomo {
        /// With weight decay `wd`.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            AdaLomo {
                weight_decay,
                ..self
            }
        }

        /// With another clipping threshold of the update's RMS.
        pub fn clip_threshold(self, d: f64) -> Self {
            AdaLomo {
                clip_threshold: d,
                ..self
            }
        }

        /// With another decay rate of `beta2_t`.
        pub fn decay_rate(self, c: f64) -> Self {
            AdaLomo {
                decay_rate: c,
                ..self
            }
        }

        /// With other `eps1`, `eps2`.
        pub fn eps(self, eps1: f64, eps2: f64) -> Self {
            AdaLomo {
                eps: (eps1, eps2),
                ..self
            }
        }

        /// With each gradient value clamped to `[-v, v]`.
        pub fn clip_grad_value(self, v: f64) -> Self {
            AdaLomo {
                clip_grad_value: Some(v),
                ..self
            }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// AdaLomo with `lomo-optim`'s defaults: f32 parameters, the second moment factorized (a full
    /// f32 one for vectors), no gradient memory (each gradient is released: `Step::param`). The
    /// reference for the AdaLomo presets.
    pub fn adalomo_f32(lr: f64) -> Preset<AdaLomo> {
        Preset::f32(AdaLomo::new(lr))
            .with_state2(Storage::Factorized)
            .with_grad(Storage::None)
    }

    /// AdaLomo with bf16 parameters rounded stochastically: about 2 bytes a parameter in all
    /// (the factorized moment is a row and a column per matrix).
    pub fn adalomo_bf16_sr(lr: f64) -> Preset<AdaLomo> {
        adalomo_f32(lr).with_param(Storage::Bf16(StoreRounding::Stochastic))
    }

    cases {
        "adalomo f32" => adalomo_f32(1e-2),
        "adalomo bf16 sr wd" => adalomo_bf16_sr(1e-2).weight_decay(0.1).clip_grad_value(0.5),
    }
}

kernel_struct! {
    /// AdaLomo's per-step constants. `neg_step`, `decay`, `neg_step_wd` and `clip_div` are set
    /// by [`RuleConsts::combine_stats`](crate::backend::RuleConsts::combine_stats) from the
    /// tensor-wide sums; the last words are read only there.
    pub struct AdaLomoConsts {
        /// `beta2_t = 1 - t^decay_rate`.
        pub beta2t: f32,
        /// `1 - beta2_t`.
        pub one_minus_beta2t: f32,
        /// `eps1`.
        pub eps1: f32,
        /// The gradient's clamp (0: none).
        pub clip_value: f32,
        /// `-lr_t`, `lr_t = f32(lr * max(eps2, RMS(p)))`.
        pub neg_step: f32,
        /// `f32(1 - lr_t * wd)`.
        pub decay: f32,
        /// `f32(-lr_t * wd)` (the decay as an increment).
        pub neg_step_wd: f32,
        /// `max(1, RMS(update) / clip_threshold)`.
        pub clip_div: f32,
        /// The learning rate, f64 bits (low word).
        pub lr_lo: u32,
        /// High word.
        pub lr_hi: u32,
        /// `eps2`.
        pub eps2: f32,
        /// `clip_threshold`.
        pub clip_threshold: f32,
        /// `weight_decay`.
        pub wd: f32,
    }
}

/// The gradient, clamped (`grad_fp32.clamp_(min=-v, max=v)`; a NaN stays NaN) where a clamp is
/// set.
#[inline(always)]
fn clamped(c: &AdaLomoConsts, g: f32) -> f32 {
    if c.clip_value > 0.0 {
        g.clamp(-c.clip_value, c.clip_value)
    } else {
        g
    }
}

/// The unclipped update `rsqrt(v) * g` (torch's `rsqrt` is `1 / sqrt`), `v` the new second
/// moment (given, or updated here as `beta2_t v + (1 - beta2_t)(g^2 + eps1)`: `mul_`, then
/// `add_(.., alpha)` fused).
#[inline(always)]
fn unscaled(c: &AdaLomoConsts, f: StepFlags, g: f32, v: &mut f32) -> f32 {
    if !f.has(StepFlags::GIVEN_V) {
        *v = (g * g + c.eps1).mul_add(c.one_minus_beta2t, *v * c.beta2t);
    }
    (1.0 / v.sqrt()) * g
}

impl Rule for AdaLomo {
    const NAME: &'static str = "adalomo";
    type Consts = AdaLomoConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![(
            "adalomo-wd-clamp",
            AdaLomo::new(1e-2)
                .weight_decay(0.1)
                .clip_grad_value(0.3)
                .clip_threshold(0.5),
        )]
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn states(&self) -> [bool; 3] {
        [false, true, false]
    }

    fn validate(&self) -> Result<(), OptimError> {
        check::finite_non_negative("lr", self.lr)?;
        check::relative_moment(self.eps, self.clip_threshold, self.decay_rate)?;
        if let Some(v) = self.clip_grad_value {
            check::positive("clip_grad_value", v)?;
        }
        check::finite_non_negative("weight_decay", self.weight_decay)
    }

    fn consts(&self, t: u64, _state: &RuleState) -> AdaLomoConsts {
        // beta2t = 1.0 - math.pow(step_num, decay_rate), step_num the 1-based step.
        let beta2t = 1.0 - (t as f64).powf(self.decay_rate);
        let mut c = AdaLomoConsts {
            beta2t: beta2t as f32,
            one_minus_beta2t: (1.0 - beta2t) as f32,
            eps1: self.eps.0 as f32,
            clip_value: self.clip_grad_value.map_or(0.0, |v| v as f32),
            neg_step: 0.0,
            decay: 1.0,
            neg_step_wd: 0.0,
            clip_div: 1.0,
            lr_lo: self.lr.to_bits() as u32,
            lr_hi: (self.lr.to_bits() >> 32) as u32,
            eps2: self.eps.1 as f32,
            clip_threshold: self.clip_threshold as f32,
            wd: self.weight_decay as f32,
        };
        // Without the sums (a backend must combine them before the fused pass): no clipping,
        // the parameter scale eps2.
        Self::combine_stats(&mut c, &[], 0);
        c
    }

    #[inline(always)]
    fn apply(
        c: &AdaLomoConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        _m: &mut f32,
        v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        // update.div_((rms(update) / clip_threshold).clamp_(min=1.0))
        let u = unscaled(c, f, clamped(c, g), v) / c.clip_div;
        if !f.has(StepFlags::UPDATE_PARAM) {
            return Updated {
                param: p,
                delta: 0.0,
            };
        }
        // p.mul_(1 - lr*wd) (with weight decay); p.add_(update, alpha=-lr)
        let (decayed, decay_delta) = if c.wd != 0.0 {
            (p * c.decay, p * c.neg_step_wd)
        } else {
            (p, 0.0)
        };
        Updated {
            param: u.mul_add(c.neg_step, decayed),
            delta: u.mul_add(c.neg_step, decay_delta),
        }
    }

    fn factorable(slot: SlotKind) -> bool {
        slot == SlotKind::State2
    }

    fn moment(c: &AdaLomoConsts, slot: SlotKind) -> Option<Moment> {
        (slot == SlotKind::State2).then_some(Moment {
            beta: c.beta2t,
            one_minus_beta: c.one_minus_beta2t,
            eps: c.eps1,
        })
    }

    /// The clamped gradient.
    #[inline(always)]
    fn moment_input(
        c: &AdaLomoConsts,
        _f: StepFlags,
        _slot: SlotKind,
        _p: f32,
        g: f32,
        _m: f32,
        _v: f32,
        _w: f32,
    ) -> f32 {
        clamped(c, g)
    }

    fn stats(_c: &AdaLomoConsts) -> usize {
        2
    }

    /// Sum 0: the parameter (its RMS scales the step); sum 1: the unclipped update (its RMS
    /// clips it).
    #[inline(always)]
    fn stat_input(
        c: &AdaLomoConsts,
        f: StepFlags,
        k: usize,
        p: f32,
        g: f32,
        _m: f32,
        mut v: f32,
        _w: f32,
    ) -> f32 {
        if k == 0 {
            p
        } else {
            unscaled(c, f, clamped(c, g), &mut v)
        }
    }

    /// `lr_t = f32(lr * max(eps2, RMS(p)))`, `decay = f32(1 - lr_t * wd)`,
    /// `clip_div = f32(max(1, RMS(update) / clip_threshold))`; the RMS values from the exact
    /// sums, in f64.
    fn combine_stats(c: &mut AdaLomoConsts, sums: &[f64], numel: usize) {
        let rms = |k: usize| match sums.get(k) {
            Some(&s) if numel > 0 => (s / numel as f64).sqrt(),
            _ => 0.0,
        };
        let lr = f64::from_bits(u64::from(c.lr_lo) | u64::from(c.lr_hi) << 32);
        let step = (lr * f64::from(c.eps2).max(rms(0))) as f32;
        c.neg_step = -step;
        c.decay = (1.0 - f64::from(step) * f64::from(c.wd)) as f32;
        c.neg_step_wd = (-f64::from(step) * f64::from(c.wd)) as f32;
        c.clip_div = (rms(1) / f64::from(c.clip_threshold)).max(1.0) as f32;
    }
}
