//! RMSprop, `torch.optim.RMSprop` semantics ([docs/OPTIMIZERS.md], "RMSprop").
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;

/// RMSprop's hyperparameters. State 1 is the momentum buffer (with `momentum > 0`), state 2 the
/// square average, state 3 the gradient average (`centered`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RmsProp {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the square average (and of the gradient average when centered).
    pub alpha: f64,
    /// Added to the root of the square average; must be positive.
    pub eps: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Momentum factor (0 disables the momentum state).
    pub momentum: f64,
    /// Centered: the square average minus the squared gradient average (an estimate of the
    /// gradient's variance) under the root.
    pub centered: bool,
}

impl RmsProp {
    /// `torch.optim.RMSprop(lr)` defaults: alpha 0.99, eps 1e-8, no weight decay, no momentum,
    /// not centered.
    pub fn new(lr: f64) -> Self {
        RmsProp {
            lr,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        }
    }
}

setters! {
    $ for RmsProp {
        /// With another alpha.
        pub fn alpha(self, alpha: f64) -> Self {
            RmsProp { alpha, ..self }
        }

        /// With another eps.
        pub fn eps(self, eps: f64) -> Self {
            RmsProp { eps, ..self }
        }

        /// With an L2 penalty.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            RmsProp {
                weight_decay,
                ..self
            }
        }

        /// With momentum `mu`.
        pub fn momentum(self, mu: f64) -> Self {
            RmsProp {
                momentum: mu,
                ..self
            }
        }

        /// Centered or not.
        pub fn centered(self, centered: bool) -> Self {
            RmsProp { centered, ..self }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`.
presets! {
    $
    /// f32 RMSprop with `torch.optim.RMSprop`'s defaults: the reference for the RMSprop presets (12
    /// bytes per parameter; 16 with momentum, 20 with momentum and centered).
    pub fn rmsprop_f32(lr: f64) -> Preset<RmsProp> {
        Preset::f32(RmsProp::new(lr))
    }

    /// 8-bit RMSprop on an f32 model, bitsandbytes' `RMSprop8bit` layout (blocks of 256): f32
    /// parameters and gradients, the square average 8-bit dynamic unsigned (bitsandbytes stores its
    /// one state with the signed map, a bit of precision less for a value that is never negative),
    /// the momentum buffer and the centered gradient average, when turned on, 8-bit dynamic signed
    /// (bitsandbytes has neither: it ignores `momentum` and refuses `centered`).
    pub fn rmsprop_8bit(lr: f64) -> Preset<RmsProp> {
        rmsprop_f32(lr)
            .with_state1(Storage::DYNAMIC8_SIGNED)
            .with_state2(Storage::DYNAMIC8_UNSIGNED)
            .with_state3(Storage::DYNAMIC8_SIGNED)
    }

    cases {
        "rmsprop f32" => rmsprop_f32(1e-2),
        "rmsprop 8-bit momentum centered" => rmsprop_8bit(1e-2).momentum(0.9).centered(true),
    }
}

kernel_struct! {
    /// RMSprop's per-step constants.
    pub struct RmsPropConsts {
        /// `-lr`.
        pub neg_lr: f32,
        /// The L2 penalty.
        pub wd: f32,
        /// `alpha`.
        pub alpha: f32,
        /// `1 - alpha`.
        pub one_minus_alpha: f32,
        /// eps.
        pub eps: f32,
        /// The momentum factor.
        pub momentum: f32,
        /// [`RmsPropConsts::HAS_MOMENTUM`] | [`RmsPropConsts::CENTERED`].
        pub options: u32,
    }
}

impl RmsPropConsts {
    /// A momentum state (state 1) is kept.
    pub const HAS_MOMENTUM: u32 = 1;
    /// Centered: a gradient average (state 3) is kept.
    pub const CENTERED: u32 = 2;
}

impl Rule for RmsProp {
    const NAME: &'static str = "rmsprop";
    type Consts = RmsPropConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![
            (
                "rmsprop-momentum-centered-wd",
                RmsProp::new(1e-2)
                    .momentum(0.9)
                    .centered(true)
                    .weight_decay(1e-2),
            ),
            (
                "rmsprop-alpha-0.4-centered",
                RmsProp::new(1e-3).alpha(0.4).centered(true),
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
        [self.momentum != 0.0, true, self.centered]
    }

    fn validate(&self) -> Result<(), OptimError> {
        check::finite_non_negative("lr", self.lr)?;
        check::beta("alpha", self.alpha)?;
        // eps = 0 would divide 0 by 0 wherever the square average is 0 (a zero gradient).
        check::positive("eps", self.eps)?;
        check::finite_non_negative("weight_decay", self.weight_decay)?;
        check::finite_non_negative("momentum", self.momentum)
    }

    fn consts(&self, _t: u64, _state: &RuleState) -> RmsPropConsts {
        RmsPropConsts {
            neg_lr: -self.lr as f32,
            wd: self.weight_decay as f32,
            alpha: self.alpha as f32,
            one_minus_alpha: (1.0 - self.alpha) as f32,
            eps: self.eps as f32,
            momentum: self.momentum as f32,
            options: (u32::from(self.momentum != 0.0) * RmsPropConsts::HAS_MOMENTUM)
                | (u32::from(self.centered) * RmsPropConsts::CENTERED),
        }
    }

    #[inline(always)]
    fn apply(
        c: &RmsPropConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        w: &mut f32,
    ) -> Updated {
        // No penalty while the parameter does not move (optimizer accumulation).
        let wd = if f.has(StepFlags::UPDATE_PARAM) {
            c.wd
        } else {
            0.0
        };
        // grad = grad.add(param, alpha=wd)
        let g = if wd != 0.0 { p.mul_add(wd, g) } else { g };
        // square_avg.mul_(alpha).addcmul_(grad, grad, value=1-alpha): fma(value * grad, grad,
        // self)
        *v = (c.one_minus_alpha * g).mul_add(g, *v * c.alpha);
        let avg = if c.options & RmsPropConsts::CENTERED != 0 {
            // grad_avg.lerp_(grad, 1-alpha): fma(w, g - a, a) for |w| < 0.5, else
            // fma(w - 1, g - a, g)
            *w = if c.one_minus_alpha < 0.5 {
                (g - *w).mul_add(c.one_minus_alpha, *w)
            } else {
                (g - *w).mul_add(c.one_minus_alpha - 1.0, g)
            };
            // square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_(): negative (NaN root)
            // only by rounding, and then the element is left unchanged and reported
            (-*w).mul_add(*w, *v).sqrt()
        } else {
            v.sqrt()
        };
        // avg.add_(eps)
        let avg = avg + c.eps;
        if c.options & RmsPropConsts::HAS_MOMENTUM != 0 {
            // buf.mul_(momentum).addcdiv_(grad, avg); param.add_(buf, alpha=-lr)
            *m = *m * c.momentum + g / avg;
            Updated {
                param: m.mul_add(c.neg_lr, p),
                delta: *m * c.neg_lr,
            }
        } else {
            // param.addcdiv_(grad, avg, value=-lr)
            let step = c.neg_lr * g / avg;
            Updated {
                param: p + step,
                delta: step,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_hyperparameters_are_typed_errors() {
        for (name, rule) in [
            ("lr", RmsProp::new(-1e-3)),
            ("alpha", RmsProp::new(1e-3).alpha(1.0)),
            ("alpha", RmsProp::new(1e-3).alpha(f64::NAN)),
            ("eps", RmsProp::new(1e-3).eps(0.0)),
            ("eps", RmsProp::new(1e-3).eps(1e-50)),
            ("weight_decay", RmsProp::new(1e-3).weight_decay(-0.1)),
            ("momentum", RmsProp::new(1e-3).momentum(f64::INFINITY)),
        ] {
            match rule.validate() {
                Err(OptimError::Hyperparameter { name: got, .. }) => assert_eq!(got, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        RmsProp::new(1e-2)
            .alpha(0.0)
            .momentum(0.9)
            .centered(true)
            .validate()
            .unwrap();
    }

    #[test]
    fn states_follow_momentum_and_centering() {
        assert_eq!(RmsProp::new(1e-2).states(), [false, true, false]);
        assert_eq!(
            RmsProp::new(1e-2).momentum(0.9).centered(true).states(),
            [true, true, true]
        );
    }

    /// The Kahan increment is the update: `p + delta` gives `param` where nothing rounds away.
    #[test]
    fn the_increment_is_the_update() {
        let flags = StepFlags(StepFlags::UPDATE_PARAM);
        for rule in [
            RmsProp::new(1e-2),
            RmsProp::new(1e-2)
                .momentum(0.9)
                .centered(true)
                .weight_decay(0.1),
        ] {
            let c = rule.consts(1, &RuleState::default());
            let (mut m, mut v, mut w) = (0.25, 0.5, 0.125);
            let u = RmsProp::apply(&c, flags, 0.0, 0.75, &mut m, &mut v, &mut w);
            assert_eq!(u.param, u.delta, "{rule:?}");
        }
    }
}
