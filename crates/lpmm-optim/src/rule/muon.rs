//! Muon (Jordan et al. 2024), `torch.optim.Muon` semantics ([docs/OPTIMIZERS.md], "Muon"):
//! momentum (torch's `lerp`), its Nesterov update orthogonalised by Newton–Schulz iterations
//! over the whole matrix (the rule's matrix phase, [`NewtonSchulz`]), a learning rate adjusted
//! to the matrix's shape, and decoupled weight decay. One state: the momentum (state 1), in any
//! storage.
//!
//! A step is three passes and the products: the tensor-wide sum of squares of the Nesterov
//! update (its Frobenius norm, [`Rule::stats`]); the update over that norm gathered into the
//! matrix phase's workspace ([`Rule::matrix_input`]); the iterations; the element-wise pass that
//! stores the momentum and moves the parameter by the result ([`Rule::apply`], reading it as
//! `v`). The first two recompute the momentum from the stored one as the last does, so all
//! three see the same bits.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use serde::{Deserialize, Serialize};

use super::{NewtonSchulz, Rule, RuleState, StepFlags, Updated, check};
use crate::error::OptimError;
use crate::vocab::{F32_MAX_BITS, fits};

/// How Muon scales the learning rate with the matrix's shape `A × B` (torch's `adjust_lr_fn`,
/// burn-optim's `AdjustLrFn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum AdjustLr {
    /// Keller Jordan's: `lr * sqrt(max(1, A / B))` (torch's default, `"original"`).
    #[default]
    Original,
    /// Moonshot's, to match AdamW's update RMS: `lr * 0.2 * sqrt(max(A, B))`
    /// (`"match_rms_adamw"`).
    MatchRmsAdamW,
    /// Bernstein's: `lr * sqrt(A / B)` (`"spectral_unclamped"`).
    SpectralUnclamped,
}

impl AdjustLr {
    /// The factor for a matrix of `rows × cols`, in f64 as torch's `_adjust_lr` computes it.
    pub fn ratio(self, rows: usize, cols: usize) -> f64 {
        let (a, b) = (rows as f64, cols as f64);
        match self {
            AdjustLr::Original => (a / b).max(1.0).sqrt(),
            AdjustLr::MatchRmsAdamW => 0.2 * a.max(b).sqrt(),
            AdjustLr::SpectralUnclamped => (a / b).sqrt(),
        }
    }

    fn id(self) -> u32 {
        match self {
            AdjustLr::Original => 0,
            AdjustLr::MatchRmsAdamW => 1,
            AdjustLr::SpectralUnclamped => 2,
        }
    }

    fn from_id(id: u32) -> AdjustLr {
        match id {
            1 => AdjustLr::MatchRmsAdamW,
            2 => AdjustLr::SpectralUnclamped,
            _ => AdjustLr::Original,
        }
    }
}

/// Muon's hyperparameters (`torch.optim.Muon`'s names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Muon {
    /// Learning rate (before the shape adjustment).
    pub lr: f64,
    /// Decoupled weight decay: the parameter is multiplied by `1 - lr * weight_decay` (the
    /// unadjusted rate).
    pub weight_decay: f64,
    /// The momentum factor `mu`: `buf = lerp(buf, g, 1 - mu)`.
    pub momentum: f64,
    /// The update is `lerp(g, buf, mu)` (Nesterov) rather than `buf`.
    pub nesterov: bool,
    /// Newton–Schulz coefficients `(a, b, c)`.
    pub ns_coefficients: (f64, f64, f64),
    /// The update's Frobenius norm is clamped to at least this before the division.
    pub eps: f64,
    /// Newton–Schulz iterations (fewer than 100, as torch requires).
    pub ns_steps: u32,
    /// The learning rate's shape adjustment.
    pub adjust_lr: AdjustLr,
}

impl Muon {
    /// `torch.optim.Muon(lr)` defaults: weight decay 0.1, momentum 0.95, Nesterov, coefficients
    /// (3.4445, -4.775, 2.0315), eps 1e-7, 5 iterations, the original shape adjustment.
    pub fn new(lr: f64) -> Self {
        Muon {
            lr,
            weight_decay: 0.1,
            momentum: 0.95,
            nesterov: true,
            ns_coefficients: (3.4445, -4.775, 2.0315),
            eps: 1e-7,
            ns_steps: 5,
            adjust_lr: AdjustLr::Original,
        }
    }
}

setters! {
    $ for Muon {
        /// With momentum factor `mu`.
        pub fn momentum(self, mu: f64) -> Self {
            Muon {
                momentum: mu,
                ..self
            }
        }

        /// With Nesterov's update on or off.
        pub fn nesterov(self, on: bool) -> Self {
            Muon {
                nesterov: on,
                ..self
            }
        }

        /// With decoupled weight decay `wd`.
        pub fn weight_decay(self, weight_decay: f64) -> Self {
            Muon {
                weight_decay,
                ..self
            }
        }

        /// With other Newton–Schulz coefficients.
        pub fn ns_coefficients(self, a: f64, b: f64, c: f64) -> Self {
            Muon {
                ns_coefficients: (a, b, c),
                ..self
            }
        }

        /// With `steps` Newton–Schulz iterations.
        pub fn ns_steps(self, steps: u32) -> Self {
            Muon {
                ns_steps: steps,
                ..self
            }
        }

        /// With another clamp of the update's norm.
        pub fn eps(self, eps: f64) -> Self {
            Muon { eps, ..self }
        }

        /// With another shape adjustment of the learning rate.
        pub fn adjust_lr(self, adjust_lr: AdjustLr) -> Self {
            Muon { adjust_lr, ..self }
        }
    }
}

// The rule's named presets (`lpmm_optim::presets`) and those the backend conformance suite
// steps (`lpmm_optim::testing::preset_cases`): see `presets!`. Muon steps matrices only:
// `lpmm_optim::Hybrid` routes a model's hidden matrices to one of these and the rest to AdamW.
presets! {
    $
    /// f32 Muon with torch's defaults: the reference for the Muon presets (12 bytes per
    /// parameter; 8 when gradients are stepped where the framework holds them).
    pub fn muon_f32(lr: f64) -> Preset<Muon> {
        Preset::f32(Muon::new(lr))
    }

    /// Muon with a bf16 momentum (stochastic rounding), f32 parameters and gradients.
    pub fn muon_bf16(lr: f64) -> Preset<Muon> {
        muon_f32(lr).with_state1(Storage::Bf16(StoreRounding::Stochastic))
    }

    /// Muon with an 8-bit momentum (dynamic signed, blocks of 256: bitsandbytes' first moment,
    /// the block-wise 8-bit momentum of arXiv 2509.23106), f32 parameters and gradients.
    pub fn muon_8bit(lr: f64) -> Preset<Muon> {
        muon_f32(lr).with_state1(Storage::DYNAMIC8_SIGNED)
    }

    /// Muon with a 4-bit momentum (lpmm's signed dynamic-exponent map, blocks of 128), f32
    /// parameters and gradients.
    pub fn muon_4bit(lr: f64) -> Preset<Muon> {
        muon_f32(lr).with_state1(Storage::FOUR_BIT_SIGNED)
    }

    /// 8-bit Muon with bf16 parameters and gradients, both with stochastic rounding: 3 bytes a
    /// parameter where gradients are stepped where the framework holds them (AdamW in f32: 16).
    pub fn muon_8bit_bf16_sr(lr: f64) -> Preset<Muon> {
        muon_8bit(lr)
            .with_param(Storage::Bf16(StoreRounding::Stochastic))
            .with_grad(Storage::Bf16(StoreRounding::Stochastic))
    }

    /// 4-bit Muon with bf16 parameters and gradients, both with stochastic rounding.
    pub fn muon_4bit_bf16_sr(lr: f64) -> Preset<Muon> {
        muon_4bit(lr)
            .with_param(Storage::Bf16(StoreRounding::Stochastic))
            .with_grad(Storage::Bf16(StoreRounding::Stochastic))
    }

    cases {
        "muon f32" => muon_f32(0.02),
        "muon 8-bit bf16 sr" => muon_8bit_bf16_sr(0.02),
        "muon 4-bit bf16 sr" => muon_4bit_bf16_sr(0.02).adjust_lr(AdjustLr::MatchRmsAdamW),
    }
}

kernel_struct! {
    /// Muon's per-step constants. `norm` is set by
    /// [`RuleConsts::combine_stats`](crate::backend::RuleConsts::combine_stats) from the
    /// update's sum of squares and `neg_step` by
    /// [`RuleConsts::combine_matrix`](crate::backend::RuleConsts::combine_matrix) from the
    /// matrix's shape; the last words are read only there and by the matrix phase.
    pub struct MuonConsts {
        /// `f32(1 - momentum)`: the momentum's `lerp` weight.
        pub w_momentum: f32,
        /// `f32(momentum)`: the Nesterov update's `lerp` weight.
        pub w_nesterov: f32,
        /// 1: Nesterov's update.
        pub nesterov: u32,
        /// `f32(1 - lr * weight_decay)`.
        pub decay: f32,
        /// `f32(-lr * weight_decay)` (the decay as an increment).
        pub neg_lr_wd: f32,
        /// The update's Frobenius norm, clamped to at least eps.
        pub norm: f32,
        /// `f32(-adjusted lr)`.
        pub neg_step: f32,
        /// eps.
        pub eps: f32,
        /// The learning rate, f64 bits (low word).
        pub lr_lo: u32,
        /// High word.
        pub lr_hi: u32,
        /// The shape adjustment ([`AdjustLr`]).
        pub adjust: u32,
        /// Newton–Schulz `a`.
        pub ns_a: f32,
        /// Newton–Schulz `b`.
        pub ns_b: f32,
        /// Newton–Schulz `c`.
        pub ns_c: f32,
        /// Newton–Schulz iterations.
        pub ns_steps: u32,
    }
}

/// Torch's `lerp` on the CPU: `fma(w, b - a, a)` for `|w| < 0.5`, else `fma(w - 1, b - a, b)`.
#[inline(always)]
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        w.mul_add(b - a, a)
    } else {
        (w - 1.0).mul_add(b - a, b)
    }
}

/// The new momentum `buf.lerp_(grad, 1 - mu)`.
#[inline(always)]
fn momentum(c: &MuonConsts, g: f32, m: f32) -> f32 {
    lerp(m, g, c.w_momentum)
}

/// The update the matrix phase orthogonalises: `grad.lerp(buf, mu)` (Nesterov) or `buf`, from
/// the new momentum; 0 where the gradient, the new momentum or the update is not finite (such an
/// element does not move: [`Rule::apply`] leaves it, and it adds nothing to the matrix).
#[inline(always)]
fn update(c: &MuonConsts, g: f32, m: f32) -> f32 {
    let m1 = momentum(c, g, m);
    let u = if c.nesterov != 0 {
        lerp(g, m1, c.w_nesterov)
    } else {
        m1
    };
    let ok = fits(g, F32_MAX_BITS) & fits(m1, F32_MAX_BITS) & fits(u, F32_MAX_BITS);
    if ok { u } else { 0.0 }
}

impl Rule for Muon {
    const NAME: &'static str = "muon";
    type Consts = MuonConsts;

    fn conformance_cases() -> Vec<(&'static str, Self)> {
        vec![
            ("muon", Muon::new(0.02)),
            (
                "muon-plain-momentum-wd-adjusted",
                Muon::new(0.02)
                    .nesterov(false)
                    .momentum(0.3)
                    .weight_decay(0.01)
                    .ns_steps(3)
                    .adjust_lr(AdjustLr::SpectralUnclamped),
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
        [true, false, false]
    }

    fn validate(&self) -> Result<(), OptimError> {
        check::finite_non_negative("lr", self.lr)?;
        check::finite_non_negative("weight_decay", self.weight_decay)?;
        check::beta("momentum", self.momentum)?;
        check::positive("eps", self.eps)?;
        let (a, b, c) = self.ns_coefficients;
        for (name, v) in [("ns_a", a), ("ns_b", b), ("ns_c", c)] {
            if !(v.is_finite() && (v as f32).is_finite()) {
                return Err(OptimError::Hyperparameter { name, value: v });
            }
        }
        if self.ns_steps >= 100 {
            return Err(OptimError::Hyperparameter {
                name: "ns_steps",
                value: f64::from(self.ns_steps),
            });
        }
        if self.nesterov && self.momentum <= 0.0 {
            return Err(OptimError::Nesterov);
        }
        Ok(())
    }

    fn consts(&self, _t: u64, _state: &RuleState) -> MuonConsts {
        let (a, b, c) = self.ns_coefficients;
        let lr_wd = self.lr * self.weight_decay;
        let mut k = MuonConsts {
            w_momentum: (1.0 - self.momentum) as f32,
            w_nesterov: self.momentum as f32,
            nesterov: u32::from(self.nesterov),
            decay: (1.0 - lr_wd) as f32,
            neg_lr_wd: (-lr_wd) as f32,
            norm: 0.0,
            neg_step: 0.0,
            eps: self.eps as f32,
            lr_lo: self.lr.to_bits() as u32,
            lr_hi: (self.lr.to_bits() >> 32) as u32,
            adjust: self.adjust_lr.id(),
            ns_a: a as f32,
            ns_b: b as f32,
            ns_c: c as f32,
            ns_steps: self.ns_steps,
        };
        // Without the sums and the shape (a backend combines them before the matrix phase): a
        // norm of eps, the unadjusted rate.
        Self::combine_stats(&mut k, &[], 0);
        Self::combine_matrix(&mut k, 1, 1);
        k
    }

    #[inline(always)]
    fn apply(
        c: &MuonConsts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        _w: &mut f32,
    ) -> Updated {
        // buf.lerp_(grad, 1 - momentum)
        *m = momentum(c, g, *m);
        // `v` is the matrix phase's result (the rule keeps no state 2: nothing is stored).
        let o = *v;
        if !f.has(StepFlags::UPDATE_PARAM) {
            return Updated {
                param: p,
                delta: 0.0,
            };
        }
        // param.mul_(1 - lr * weight_decay); param.add_(update, alpha=-adjusted_lr)
        Updated {
            param: o.mul_add(c.neg_step, p * c.decay),
            delta: o.mul_add(c.neg_step, p * c.neg_lr_wd),
        }
    }

    fn stats(_c: &MuonConsts) -> usize {
        1
    }

    /// The update whose Frobenius norm normalises the matrix.
    #[inline(always)]
    fn stat_input(
        c: &MuonConsts,
        _f: StepFlags,
        _k: usize,
        _p: f32,
        g: f32,
        m: f32,
        _v: f32,
        _w: f32,
    ) -> f32 {
        update(c, g, m)
    }

    /// `norm = max(f32(sqrt(sum)), eps)`.
    fn combine_stats(c: &mut MuonConsts, sums: &[f64], _numel: usize) {
        let norm = sums.first().map_or(0.0, |&s| s.sqrt() as f32);
        c.norm = norm.max(c.eps);
    }

    fn newton_schulz(c: &MuonConsts) -> Option<NewtonSchulz> {
        Some(NewtonSchulz {
            a: c.ns_a,
            b: c.ns_b,
            c: c.ns_c,
            steps: c.ns_steps,
        })
    }

    /// The update over its norm (torch's `ortho_grad.div_(norm.clamp(min=eps))`).
    #[inline(always)]
    fn matrix_input(
        c: &MuonConsts,
        _f: StepFlags,
        _p: f32,
        g: f32,
        m: f32,
        _v: f32,
        _w: f32,
    ) -> f32 {
        update(c, g, m) / c.norm
    }

    /// `neg_step = f32(-(lr * ratio))`, the ratio in f64 ([`AdjustLr::ratio`]).
    fn combine_matrix(c: &mut MuonConsts, rows: usize, cols: usize) {
        let lr = f64::from_bits(u64::from(c.lr_lo) | u64::from(c.lr_hi) << 32);
        let ratio = AdjustLr::from_id(c.adjust).ratio(rows, cols);
        c.neg_step = (-(lr * ratio)) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shape_adjustments_are_torchs() {
        assert_eq!(AdjustLr::Original.ratio(512, 512), 1.0);
        assert_eq!(AdjustLr::Original.ratio(512, 1024), 1.0);
        assert_eq!(AdjustLr::Original.ratio(1024, 512), 2f64.sqrt());
        assert_eq!(AdjustLr::MatchRmsAdamW.ratio(1024, 512), 0.2 * 32.0);
        assert_eq!(AdjustLr::SpectralUnclamped.ratio(512, 2048), 0.5);
    }

    #[test]
    fn a_non_finite_gradient_adds_nothing_to_the_matrix() {
        let c = Muon::new(0.02).consts(1, &RuleState::default());
        for g in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(update(&c, g, 0.5), 0.0);
        }
        // A finite gradient whose momentum overflows f32: `g - m` is beyond f32.
        assert_eq!(update(&c, f32::MAX, -f32::MAX), 0.0);
        assert_ne!(update(&c, 1.0, 0.5), 0.0);
    }

    #[test]
    fn optimizer_accumulation_moves_only_the_momentum() {
        let c = Muon::new(0.02).consts(1, &RuleState::default());
        let (mut m, mut v, mut w) = (0.0, 0.7, 0.0);
        let u = Muon::apply(&c, StepFlags(0), 0.5, 1.0, &mut m, &mut v, &mut w);
        assert_eq!((u.param, u.delta), (0.5, 0.0));
        assert_eq!(m, momentum(&c, 1.0, 0.0));
    }
}
