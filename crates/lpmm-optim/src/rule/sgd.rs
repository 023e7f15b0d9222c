//! SGD with momentum, `torch.optim.SGD` semantics ([docs/OPTIMIZERS.md], "SGD").
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;

/// SGD's hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the momentum state).
    pub momentum: f64,
    /// Dampening of the gradient in the momentum update.
    pub dampening: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening = 0, as in PyTorch).
    pub nesterov: bool,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
}

impl Sgd {
    /// Plain SGD at `lr` (no momentum, dampening or decay).
    pub fn new(lr: f64) -> Self {
        Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }
}

setters! {
    $ for Sgd {
        /// With momentum `mu`.
        pub fn momentum(self, mu: f64) -> Self {
            Sgd {
                momentum: mu,
                ..self
            }
        }

        /// With dampening.
        pub fn dampening(self, dampening: f64) -> Self {
            Sgd { dampening, ..self }
        }

        /// With Nesterov momentum on or off.
        pub fn nesterov(self, nesterov: bool) -> Self {
            Sgd { nesterov, ..self }
        }

        /// With an L2 penalty.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            Sgd {
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
    /// f32 SGD with momentum: the reference for the SGDM presets (12 bytes per parameter).
    pub fn sgdm_f32(lr: f64, momentum: f64) -> Preset<Sgd> {
        Preset::f32(Sgd::new(lr).momentum(momentum))
    }

    /// LPMM-SGDM: parameters, gradient accumulator and momentum all 8-bit linear in groups of 64
    /// with stochastic rounding (about 3.19 bytes per parameter), for every tensor however small
    /// (LPMM keeps the whole model memory in 8 bits; there is no minimum size).
    pub fn lpmm_sgdm(lr: f64, momentum: f64) -> Preset<Sgd> {
        sgdm_f32(lr, momentum)
            .with_param(Storage::LINEAR8_GROUP64_SR)
            .with_grad(Storage::LINEAR8_GROUP64_SR)
            .with_state1(Storage::LINEAR8_GROUP64_SR)
            .with_min_quantized_size(0)
    }

    cases {
        "sgdm f32" => sgdm_f32(0.05, 0.9),
        "lpmm sgdm" => lpmm_sgdm(0.05, 0.9),
    }
}

kernel_struct! {
    /// SGD's per-step constants.
    pub struct SgdConsts {
        /// `-lr`.
        pub neg_lr: f32,
        /// The L2 penalty.
        pub wd: f32,
        /// The momentum factor.
        pub momentum: f32,
        /// `1 - dampening`.
        pub one_minus_dampening: f32,
        /// [`SgdConsts::NESTEROV`] | [`SgdConsts::HAS_MOMENTUM`].
        pub options: u32,
    }
}

impl SgdConsts {
    /// Nesterov momentum.
    pub const NESTEROV: u32 = 1;
    /// A momentum state is kept.
    pub const HAS_MOMENTUM: u32 = 2;
}

impl Rule for Sgd {
    const NAME: &'static str = "sgd";
    type Consts = SgdConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![
            ("sgd", Sgd::new(0.05).momentum(0.0)),
            (
                "sgd-nesterov-wd",
                Sgd::new(0.05)
                    .momentum(0.9)
                    .nesterov(true)
                    .weight_decay(1e-2),
            ),
            ("sgd-dampening", Sgd::new(0.05).momentum(0.9).dampening(0.3)),
        ]
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn states(&self) -> [bool; 3] {
        [self.momentum != 0.0, false, false]
    }

    fn validate(&self) -> Result<(), OptimError> {
        check::finite_non_negative("lr", self.lr)?;
        check::finite_non_negative("momentum", self.momentum)?;
        if self.dampening != 1.0 {
            check::beta("dampening", self.dampening)?;
        }
        check::finite_non_negative("weight_decay", self.weight_decay)?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(OptimError::Nesterov);
        }
        Ok(())
    }

    fn consts(&self, _t: u64, _state: &RuleState) -> SgdConsts {
        SgdConsts {
            neg_lr: -self.lr as f32,
            wd: self.weight_decay as f32,
            momentum: self.momentum as f32,
            one_minus_dampening: (1.0 - self.dampening) as f32,
            options: (u32::from(self.nesterov) * SgdConsts::NESTEROV)
                | (u32::from(self.momentum != 0.0) * SgdConsts::HAS_MOMENTUM),
        }
    }

    #[inline(always)]
    fn apply(
        c: &SgdConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        _v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        // No penalty while the parameter does not move (optimizer accumulation).
        let wd = if f.has(StepFlags::UPDATE_PARAM) {
            c.wd
        } else {
            0.0
        };
        // grad.add(param, alpha=wd)
        let mut d = if wd != 0.0 { p.mul_add(wd, g) } else { g };
        if c.options & SgdConsts::HAS_MOMENTUM != 0 {
            // buf = grad (first step) / buf.mul_(momentum).add_(grad, alpha=1-dampening)
            *m = if f.has(StepFlags::FIRST) {
                d
            } else {
                d.mul_add(c.one_minus_dampening, *m * c.momentum)
            };
            // grad.add(buf, alpha=momentum) / grad = buf
            d = if c.options & SgdConsts::NESTEROV != 0 {
                m.mul_add(c.momentum, d)
            } else {
                *m
            };
        }
        // param.add_(grad, alpha=-lr)
        Updated {
            param: d.mul_add(c.neg_lr, p),
            delta: d * c.neg_lr,
        }
    }
}
