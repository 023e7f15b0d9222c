//! Adam and AdamW, `torch.optim.Adam`/`AdamW` semantics ([docs/OPTIMIZERS.md], "Adam / AdamW").
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Moment, Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;
use crate::vocab::SlotKind;

/// Adam's and AdamW's hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adam {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the bias-corrected root of the second moment; must be positive.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// `true`: AdamW, decay applied to the parameter (`p *= 1 - lr*wd`); `false`: Adam, L2
    /// penalty added to the gradient (`g += wd*p`).
    pub decoupled: bool,
}

impl Adam {
    /// `torch.optim.AdamW(lr)` defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn adamw(lr: f64) -> Self {
        Adam {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        }
    }

    /// `torch.optim.Adam(lr)` defaults: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn new(lr: f64) -> Self {
        Adam {
            weight_decay: 0.0,
            decoupled: false,
            ..Self::adamw(lr)
        }
    }
}

setters! {
    $ for Adam {
        /// With other betas.
        pub fn betas(self, beta1: f64, beta2: f64) -> Self {
            Adam {
                betas: (beta1, beta2),
                ..self
            }
        }

        /// With another eps.
        pub fn eps(self, eps: f64) -> Self {
            Adam { eps, ..self }
        }

        /// With another weight decay.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            Adam {
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
    /// f32 AdamW: the reference for the AdamW presets (16 bytes per parameter).
    pub fn adamw_f32(lr: f64) -> Preset<Adam> {
        Preset::f32(Adam::adamw(lr))
    }

    /// bitsandbytes' `AdamW8bit` on an f32 model: f32 parameters and gradients, 8-bit dynamic
    /// states in blocks of 256 (a one-line swap for f32 AdamW; with gradients stepped where the
    /// framework holds them, no accumulator is ever allocated).
    pub fn adamw_8bit(lr: f64) -> Preset<Adam> {
        adamw_f32(lr)
            .with_state1(Storage::DYNAMIC8_SIGNED)
            .with_state2(Storage::DYNAMIC8_UNSIGNED)
    }

    /// The 4-bit twin of [`adamw_8bit`] (thu-ml lpmm's 4-bit AdamW states on an f32 model): f32
    /// parameters and gradients, 4-bit states (signed dynamic-exponent first moment, linear second
    /// moment, blocks of 128).
    pub fn adamw_4bit(lr: f64) -> Preset<Adam> {
        adamw_f32(lr)
            .with_state1(Storage::FOUR_BIT_SIGNED)
            .with_state2(Storage::FOUR_BIT_UNSIGNED)
    }

    /// bitsandbytes-like: bf16 parameters and gradients (round to nearest), 8-bit dynamic states in
    /// blocks of 256.
    pub fn adamw_8bit_bf16(lr: f64) -> Preset<Adam> {
        adamw_8bit(lr)
            .with_param(Storage::Bf16(StoreRounding::Nearest))
            .with_grad(Storage::Bf16(StoreRounding::Nearest))
    }

    /// As [`adamw_8bit_bf16`] with stochastic rounding of the bf16 parameters and gradients.
    pub fn adamw_8bit_bf16_sr(lr: f64) -> Preset<Adam> {
        adamw_8bit(lr)
            .with_param(Storage::Bf16(StoreRounding::Stochastic))
            .with_grad(Storage::Bf16(StoreRounding::Stochastic))
    }

    /// 8-bit AdamW with 24-bit master weights ([`Storage::Bf16Plus8`], to nearest: a bf16 value a
    /// bf16 forward pass reads and an 8-bit correction, 256 times finer than bf16) and bf16
    /// gradients: one byte a parameter more than [`adamw_8bit_bf16`], whose updates below half a
    /// bf16 step are lost.
    pub fn adamw_8bit_bf16_plus8(lr: f64) -> Preset<Adam> {
        adamw_8bit(lr)
            .with_param(Storage::Bf16Plus8(StoreRounding::Nearest))
            .with_grad(Storage::Bf16(StoreRounding::Nearest))
    }

    /// 4-bit AdamW (lpmm's maps, blocks of 128) with split-f32 parameters (exactly f32,
    /// bf16-readable) and bf16 gradients.
    pub fn adamw_4bit_split(lr: f64) -> Preset<Adam> {
        adamw_4bit(lr)
            .with_param(Storage::SplitF32)
            .with_grad(Storage::Bf16(StoreRounding::Nearest))
    }

    /// The smallest AdamW: bf16 parameters with stochastic rounding, 4-bit states, and no gradient
    /// memory at all: gradients are released in the backward pass (`Step::param`) or folded into
    /// the states (`Step::states_only`).
    pub fn adamw_4bit_bf16_sr_released(lr: f64) -> Preset<Adam> {
        adamw_4bit(lr)
            .with_param(Storage::Bf16(StoreRounding::Stochastic))
            .with_grad(Storage::None)
    }

    cases {
        "adamw f32" => adamw_f32(1e-3),
        "adamw 8-bit bf16" => adamw_8bit_bf16(1e-3),
        "adamw 8-bit bf16 sr" => adamw_8bit_bf16_sr(1e-3),
        "adamw 4-bit split" => adamw_4bit_split(1e-3),
        "adamw 8-bit bf16+8" => adamw_8bit_bf16_plus8(1e-3),
        "adamw 4-bit released" => adamw_4bit_bf16_sr_released(1e-3),
    }
}

kernel_struct! {
    /// Adam's per-step constants.
    pub struct AdamConsts {
        /// `1 - lr*wd` (AdamW).
        pub decay: f32,
        /// `-lr*wd` (AdamW, for the Kahan increment).
        pub neg_lr_wd: f32,
        /// The L2 penalty (Adam).
        pub wd: f32,
        /// `1 - beta1`.
        pub one_minus_beta1: f32,
        /// `beta2`.
        pub beta2: f32,
        /// `1 - beta2`.
        pub one_minus_beta2: f32,
        /// `sqrt(1 - beta2^t)`.
        pub bias_correction2_sqrt: f32,
        /// eps.
        pub eps: f32,
        /// `-lr / (1 - beta1^t)`.
        pub neg_step_size: f32,
        /// 1: AdamW (decoupled decay); 0: Adam with an L2 penalty.
        pub decoupled: u32,
    }
}

impl Rule for Adam {
    const NAME: &'static str = "adam";
    type Consts = AdamConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![
            ("adam-l2", Adam::new(1e-3).weight_decay(1e-2)),
            ("adamw", Adam::adamw(1e-3)),
            (
                "adamw-beta1-0.3",
                Adam::adamw(1e-3)
                    .betas(0.3, 0.99)
                    .eps(1e-6)
                    .weight_decay(0.1),
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
        // eps = 0 would divide 0 by 0 wherever the moments are 0 (a zero gradient): the
        // element would be left unchanged and reported at every step.
        check::positive("eps", self.eps)?;
        check::finite_non_negative("weight_decay", self.weight_decay)
    }

    fn consts(&self, t: u64, _state: &RuleState) -> AdamConsts {
        let (lr, wd, (b1, b2)) = (self.lr, self.weight_decay, self.betas);
        let t = t as f64;
        let bias_correction1 = 1.0 - b1.powf(t);
        let bias_correction2 = 1.0 - b2.powf(t);
        AdamConsts {
            decay: (1.0 - lr * wd) as f32,
            neg_lr_wd: (-lr * wd) as f32,
            wd: wd as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps: self.eps as f32,
            neg_step_size: (-(lr / bias_correction1)) as f32,
            decoupled: u32::from(self.decoupled),
        }
    }

    #[inline(always)]
    fn apply(
        c: &AdamConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        // Neither decay nor penalty while the parameter does not move (optimizer accumulation).
        let decay_on = f.has(StepFlags::UPDATE_PARAM);
        let (g, decayed, decay_delta) = if c.decoupled != 0 && decay_on {
            // param.mul_(1 - lr*wd)
            (g, p * c.decay, p * c.neg_lr_wd)
        } else if c.decoupled == 0 && decay_on && c.wd != 0.0 {
            // grad.add(param, alpha=wd)
            (p.mul_add(c.wd, g), p, 0.0)
        } else {
            (g, p, 0.0)
        };
        // exp_avg.lerp_(grad, w = 1-beta1): torch's kernel is fma(w, g - m, m) for |w| < 0.5
        // and fma(w - 1, g - m, g) otherwise (w - 1 in f32).
        *m = if c.one_minus_beta1 < 0.5 {
            (g - *m).mul_add(c.one_minus_beta1, *m)
        } else {
            (g - *m).mul_add(c.one_minus_beta1 - 1.0, g)
        };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2): torch's kernel is
        // fma(value * grad, grad, self)
        if !f.has(StepFlags::GIVEN_V) {
            *v = (c.one_minus_beta2 * g).mul_add(g, *v * c.beta2);
        }
        // denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps. IEEE sqrt: torch 2.15's CPU
        // sqrt is off by one ulp on ~18% of inputs, the one difference from torch here. Once
        // `sqrt(1 - beta2^t)` rounds to 1 (t past ~17,000 at beta2 = 0.999) the division is
        // `x / 1 = x` exactly, and is skipped.
        let root = v.sqrt();
        let root = if c.bias_correction2_sqrt == 1.0 {
            root
        } else {
            root / c.bias_correction2_sqrt
        };
        let denom = root + c.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        let step = c.neg_step_size * *m / denom;
        Updated {
            param: decayed + step,
            delta: decay_delta + step,
        }
    }

    fn factorable(slot: SlotKind) -> bool {
        slot == SlotKind::State2
    }

    fn moment(c: &AdamConsts, slot: SlotKind) -> Option<Moment> {
        (slot == SlotKind::State2).then_some(Moment {
            beta: c.beta2,
            one_minus_beta: c.one_minus_beta2,
            eps: 0.0,
        })
    }

    /// The gradient the second moment sees: Adam's L2 penalty folded in.
    #[inline(always)]
    fn moment_input(
        c: &AdamConsts,
        f: StepFlags,
        _slot: SlotKind,
        p: f32,
        g: f32,
        _m: f32,
        _v: f32,
        _w: f32,
    ) -> f32 {
        if c.decoupled == 0 && f.has(StepFlags::UPDATE_PARAM) && c.wd != 0.0 {
            p.mul_add(c.wd, g)
        } else {
            g
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past the step where `sqrt(1 - beta2^t)` rounds to 1, skipping its division gives the
    /// bits of dividing, for every kind of second moment.
    #[test]
    fn the_bias_correction_skipped_at_one_gives_the_same_bits() {
        let rule = Adam::adamw(1e-3);
        let early = rule.consts(10, &RuleState::default());
        assert_ne!(early.bias_correction2_sqrt, 1.0);
        let late = rule.consts(100_000, &RuleState::default());
        assert_eq!(late.bias_correction2_sqrt, 1.0);
        let flags = StepFlags(StepFlags::UPDATE_PARAM);
        for bits in (0..=0x7F80_0000u32)
            .step_by(9_973)
            .chain([0, 1, 0x7F7F_FFFF])
        {
            let v0 = f32::from_bits(bits);
            let (mut m, mut v, mut w) = (0.01, v0, 0.0);
            let got = Adam::apply(&late, flags, 0.5, 1e-3, &mut m, &mut v, &mut w);
            // The formula with the division, by hand.
            let v1 = (late.one_minus_beta2 * 1e-3f32).mul_add(1e-3, v0 * late.beta2);
            let m1 = (1e-3f32 - 0.01).mul_add(late.one_minus_beta1, 0.01);
            let step =
                late.neg_step_size * m1 / (v1.sqrt() / late.bias_correction2_sqrt + late.eps);
            assert_eq!(
                got.param.to_bits(),
                (0.5 * late.decay + step).to_bits(),
                "{bits:#x}"
            );
        }
    }
}
