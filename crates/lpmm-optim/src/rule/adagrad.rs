//! Adagrad, `torch.optim.Adagrad` semantics ([docs/OPTIMIZERS.md], "Adagrad").
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;

/// Adagrad's hyperparameters. State 2 is the sum of squared gradients.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adagrad {
    /// Learning rate.
    pub lr: f64,
    /// The learning rate at step `t` is `lr / (1 + (t - 1) * lr_decay)`.
    pub lr_decay: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// The sum of squares before the first step.
    pub initial_accumulator_value: f64,
    /// Added to the root of the sum; must be positive.
    pub eps: f64,
}

impl Adagrad {
    /// `torch.optim.Adagrad(lr)` defaults: no learning-rate decay, no weight decay, initial
    /// accumulator 0, eps 1e-10.
    pub fn new(lr: f64) -> Self {
        Adagrad {
            lr,
            lr_decay: 0.0,
            weight_decay: 0.0,
            initial_accumulator_value: 0.0,
            eps: 1e-10,
        }
    }
}

setters! {
    $ for Adagrad {
        /// With a learning-rate decay.
        pub fn lr_decay(self, lr_decay: f64) -> Self {
            Adagrad { lr_decay, ..self }
        }

        /// With an L2 penalty.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            Adagrad {
                weight_decay,
                ..self
            }
        }

        /// With another initial value of the sum of squares.
        pub fn initial_accumulator_value(self, value: f64) -> Self {
            Adagrad {
                initial_accumulator_value: value,
                ..self
            }
        }

        /// With another eps.
        pub fn eps(self, eps: f64) -> Self {
            Adagrad { eps, ..self }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// f32 Adagrad with `torch.optim.Adagrad`'s defaults: the reference for the Adagrad presets (12
    /// bytes per parameter).
    pub fn adagrad_f32(lr: f64) -> Preset<Adagrad> {
        Preset::f32(Adagrad::new(lr))
    }

    /// 8-bit Adagrad on an f32 model, bitsandbytes' `Adagrad8bit` layout (blocks of 256): f32
    /// parameters and gradients, the sum of squares 8-bit dynamic unsigned (bitsandbytes stores it
    /// with the signed map).
    pub fn adagrad_8bit(lr: f64) -> Preset<Adagrad> {
        adagrad_f32(lr).with_state2(Storage::DYNAMIC8_UNSIGNED)
    }

    cases {
        "adagrad f32" => adagrad_f32(1e-2),
        "adagrad 8-bit" => adagrad_8bit(1e-2).initial_accumulator_value(0.1),
    }
}

kernel_struct! {
    /// Adagrad's per-step constants.
    pub struct AdagradConsts {
        /// `-lr / (1 + (t - 1) * lr_decay)`.
        pub neg_clr: f32,
        /// The L2 penalty.
        pub wd: f32,
        /// eps.
        pub eps: f32,
        /// The sum of squares before the first step.
        pub init: f32,
    }
}

impl Rule for Adagrad {
    const NAME: &'static str = "adagrad";
    type Consts = AdagradConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![(
            "adagrad-decay-wd-init",
            Adagrad::new(1e-2)
                .lr_decay(0.1)
                .weight_decay(1e-2)
                .initial_accumulator_value(0.1),
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
        check::finite_non_negative("lr_decay", self.lr_decay)?;
        check::finite_non_negative("weight_decay", self.weight_decay)?;
        check::finite_non_negative("initial_accumulator_value", self.initial_accumulator_value)?;
        // eps = 0 would divide 0 by 0 wherever the sum is 0 (a zero gradient).
        check::positive("eps", self.eps)
    }

    fn consts(&self, t: u64, _state: &RuleState) -> AdagradConsts {
        // clr = lr / (1 + (step - 1) * lr_decay), Python floats
        let clr = self.lr / (1.0 + (t.saturating_sub(1)) as f64 * self.lr_decay);
        AdagradConsts {
            neg_clr: (-clr) as f32,
            wd: self.weight_decay as f32,
            eps: self.eps as f32,
            init: self.initial_accumulator_value as f32,
        }
    }

    #[inline(always)]
    fn apply(
        c: &AdagradConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        _m: &mut f32,
        v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        // No penalty while the parameter does not move (optimizer accumulation).
        let wd = if f.has(StepFlags::UPDATE_PARAM) {
            c.wd
        } else {
            0.0
        };
        // grad = grad.add(param, alpha=wd)
        let g = if wd != 0.0 { p.mul_add(wd, g) } else { g };
        // state_sum = full_like(param, initial_accumulator_value) before the first step
        let sum = if f.has(StepFlags::FIRST) { c.init } else { *v };
        // state_sum.addcmul_(grad, grad, value=1): fma(1 * grad, grad, self)
        *v = g.mul_add(g, sum);
        // std = state_sum.sqrt().add_(eps); param.addcdiv_(grad, std, value=-clr)
        let std = v.sqrt() + c.eps;
        let step = c.neg_clr * g / std;
        Updated {
            param: p + step,
            delta: step,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_hyperparameters_are_typed_errors() {
        for (name, rule) in [
            ("lr", Adagrad::new(f64::NAN)),
            ("lr_decay", Adagrad::new(1e-2).lr_decay(-1.0)),
            ("weight_decay", Adagrad::new(1e-2).weight_decay(1e300)),
            (
                "initial_accumulator_value",
                Adagrad::new(1e-2).initial_accumulator_value(-0.1),
            ),
            ("eps", Adagrad::new(1e-2).eps(0.0)),
        ] {
            match rule.validate() {
                Err(OptimError::Hyperparameter { name: got, .. }) => assert_eq!(got, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    /// The sum starts at the initial accumulator value at the first step (whatever the slot
    /// holds) and from the slot afterwards; the learning rate decays with the step.
    #[test]
    fn the_initial_value_is_read_at_the_first_step_only() {
        let rule = Adagrad::new(0.5)
            .initial_accumulator_value(3.0)
            .lr_decay(1.0);
        let first = rule.consts(1, &RuleState::default());
        let second = rule.consts(2, &RuleState::default());
        assert_eq!((first.neg_clr, second.neg_clr), (-0.5, -0.25));
        let f = StepFlags(StepFlags::UPDATE_PARAM);
        let (mut m, mut w) = (0.0, 0.0);
        let mut v = 0.0;
        let u = Adagrad::apply(
            &first,
            f.with(StepFlags::FIRST, true),
            1.0,
            1.0,
            &mut m,
            &mut v,
            &mut w,
        );
        assert_eq!(v, 4.0);
        assert_eq!(u.param, 1.0 + (-0.5f32 * 1.0) / (2.0 + first.eps));
        let u = Adagrad::apply(&second, f, 1.0, 2.0, &mut m, &mut v, &mut w);
        assert_eq!(v, 8.0);
        assert_eq!(u.param, 1.0 + (-0.25f32 * 2.0) / (8f32.sqrt() + second.eps));
    }
}
