//! The update rules, element by element, in f32, with PyTorch's order of operations (each rule is
//! written out in [docs/OPTIMIZERS.md]). A rule is one file here: its configuration (the
//! hyperparameters a user sets, f64 as PyTorch's Python floats), its per-step constants (f32,
//! derived from the hyperparameters in f64 and rounded once, as PyTorch does; a `#[repr(C)]`
//! struct the GPU kernels read word for word) and its element-wise `apply`. The registry at the
//! bottom of this file generates [`Hyper`] (one variant per rule) and the dispatch; the kernel
//! side (`rule_<name>_apply` in each GPU language) is generated from the same registry by
//! `cargo xtask codegen`.
//!
//! `fma` marks where PyTorch's CPU kernels fuse a multiply-add (`add(..., alpha)`, `lerp`).
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

mod adam;
mod lion;
mod sgd;

pub use adam::{Adam, AdamConsts};
pub use lion::{Lion, LionConsts};
pub use sgd::{Sgd, SgdConsts};

use serde::{Deserialize, Serialize};

use crate::error::OptimError;
use crate::format::{F32_MAX_BITS, fits};

/// What the step knows besides the constants: bits the kernels read as `flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepFlags(pub u32);

impl StepFlags {
    /// The parameter's first step (SGD initialises its momentum with the gradient).
    pub const FIRST: u32 = 1;
    /// The parameter moves and decays (clear during optimizer accumulation, which updates the
    /// states with a micro-batch gradient but neither decays nor moves the parameter: optimi's
    /// `update_parameters=False`).
    pub const UPDATE_PARAM: u32 = 2;
    /// The second moment is supplied (a factorized state's reconstruction) and not updated.
    pub const GIVEN_V: u32 = 4;

    /// Whether `bit` is set.
    pub fn has(self, bit: u32) -> bool {
        self.0 & bit != 0
    }

    /// With `bit` set or cleared.
    pub fn with(self, bit: u32, on: bool) -> Self {
        StepFlags(if on { self.0 | bit } else { self.0 & !bit })
    }
}

/// What one element's update produced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Updated {
    /// The new parameter, rounded as PyTorch rounds it.
    pub param: f32,
    /// The same update as one increment (decay folded in), for Kahan-compensated storage, which
    /// must not lose the increment to the rounding of `param`.
    pub delta: f32,
}

/// The type of one field of a kernel-visible struct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldType {
    /// An f32 (its bits in one word).
    F32,
    /// A u32.
    U32,
}

/// A `#[repr(C)]` struct of 32-bit fields that the GPU kernels read word for word: its fields in
/// order, so `cargo xtask codegen` can write the same struct in WGSL and CUDA C.
pub trait KernelStruct: bytemuck::Pod {
    /// The struct's name in the kernels.
    const NAME: &'static str;
    /// Field names and types, in memory order.
    const FIELDS: &'static [(&'static str, FieldType)];
}

/// Defines a `#[repr(C)]` struct of f32/u32 fields with its [`KernelStruct`] description.
macro_rules! kernel_struct {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident : $ty:ident,)* }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq, Default, bytemuck::Pod, bytemuck::Zeroable)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
        }

        impl $crate::rule::KernelStruct for $name {
            const NAME: &'static str = stringify!($name);
            const FIELDS: &'static [(&'static str, $crate::rule::FieldType)] =
                &[$((stringify!($field), $crate::rule::kernel_struct!(@type $ty)),)*];
        }
    };
    (@type f32) => { $crate::rule::FieldType::F32 };
    (@type u32) => { $crate::rule::FieldType::U32 };
}
pub(crate) use kernel_struct;

/// One update rule: its configuration, constants and element-wise arithmetic.
pub trait Rule:
    Copy + std::fmt::Debug + PartialEq + Serialize + for<'de> Deserialize<'de> + Send + Sync + 'static
{
    /// The rule's name: reports, and the stem of its kernel files (`rule/<name>.wgsl`, ...).
    const NAME: &'static str;
    /// Whether state 2 is a second moment fed by squared gradients (it may be factorized).
    const SECOND_MOMENT: bool = false;
    /// The per-step constants.
    type Consts: KernelStruct;

    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate.
    fn set_lr(&mut self, lr: f64);
    /// Number of state slots this configuration uses (0, 1 or 2).
    fn states(&self) -> usize;
    /// Checks every hyperparameter; an invalid one is a typed error naming it.
    fn validate(&self) -> Result<(), OptimError>;
    /// The constants at 1-based step `t`.
    fn consts(&self, t: u64) -> Self::Consts;
    /// Updates one element: parameter `p`, gradient `g`, states `m` and `v` (unused ones are
    /// ignored).
    fn apply(c: &Self::Consts, f: StepFlags, p: f32, g: f32, m: &mut f32, v: &mut f32) -> Updated;
    /// The gradient the second moment sees (Adam with L2 decay folds `wd * p` in first).
    #[inline(always)]
    fn moment_gradient(_c: &Self::Consts, _f: StepFlags, _p: f32, g: f32) -> f32 {
        g
    }
    /// `(beta2, 1 - beta2)` of the second moment, as f32.
    fn second_moment_betas(_c: &Self::Consts) -> Option<(f32, f32)> {
        None
    }
}

/// Hyperparameter checks shared by the rules.
pub(crate) mod check {
    use crate::error::OptimError;

    /// Finite and non-negative in f64 and in f32, and a positive value must not round to 0 in
    /// f32 (every hyperparameter is used as f32 or through an f32 factor).
    pub fn finite_non_negative(name: &'static str, v: f64) -> Result<(), OptimError> {
        if v.is_finite() && v >= 0.0 && (v as f32).is_finite() && (v == 0.0 || v as f32 > 0.0) {
            Ok(())
        } else {
            Err(OptimError::Hyperparameter { name, value: v })
        }
    }

    /// As [`finite_non_negative`], and not 0 (a divisor's guard: Adam's eps).
    pub fn positive(name: &'static str, v: f64) -> Result<(), OptimError> {
        finite_non_negative(name, v)?;
        if v == 0.0 {
            return Err(OptimError::Hyperparameter { name, value: v });
        }
        Ok(())
    }

    /// In [0, 1).
    pub fn beta(name: &'static str, v: f64) -> Result<(), OptimError> {
        if (0.0..1.0).contains(&v) {
            Ok(())
        } else {
            Err(OptimError::Hyperparameter { name, value: v })
        }
    }
}

/// A chunk of the fused step's element-wise work: inputs `g` (the gradient, before clipping)
/// and `p`; `m` and `v` updated in place; `p` receives the new parameter and `d` the increment.
#[derive(Debug)]
pub(crate) struct Chunk<'a> {
    pub g: &'a [f32],
    pub p: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub d: &'a mut [f32],
}

/// The largest magnitudes (f32 bit patterns, [`crate::backend::Format::limit`]) the step may
/// store into the parameter and the two states: a result beyond its slot's limit does not fit,
/// and is treated as a non-finite one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The parameter's (f32's when the parameter does not move).
    pub param: u32,
    /// State 1's.
    pub state1: u32,
    /// State 2's.
    pub state2: u32,
}

/// Applies rule `R` to every element of `c` with the gradient scaled by `clip`. An element whose
/// gradient is not finite, or whose update would produce a non-finite increment or a parameter or
/// state that does not fit its slot (`limits`: non-finite, or beyond the format's largest
/// magnitude, e.g. above bf16's range), is left unchanged (`d = 0`); returns whether any was.
/// Written without branches on the data so that it vectorizes; every element gets exactly
/// [`Rule::apply`]'s arithmetic.
#[inline(always)]
fn apply_rule<R: Rule>(
    c: &R::Consts,
    f: StepFlags,
    clip: f32,
    limits: Limits,
    chunk: &mut Chunk<'_>,
) -> bool {
    let n = chunk.g.len();
    let (g, p, m, v, d) = (
        &chunk.g[..n],
        &mut chunk.p[..n],
        &mut chunk.m[..n],
        &mut chunk.v[..n],
        &mut chunk.d[..n],
    );
    let mut bad = false;
    for i in 0..n {
        let gi = g[i] * clip;
        let (p0, m0, v0) = (p[i], m[i], v[i]);
        let (mut mi, mut vi) = (m0, v0);
        let u = R::apply(c, f, p0, gi, &mut mi, &mut vi);
        let ok = fits(gi, F32_MAX_BITS)
            & fits(u.param, limits.param)
            & fits(u.delta, F32_MAX_BITS)
            & fits(mi, limits.state1)
            & fits(vi, limits.state2);
        m[i] = if ok { mi } else { m0 };
        v[i] = if ok { vi } else { v0 };
        p[i] = if ok { u.param } else { p0 };
        d[i] = if ok { u.delta } else { 0.0 };
        bad |= !ok;
    }
    bad
}

/// The registry: one line per rule generates the [`Hyper`] variant, the [`RuleConsts`] variant
/// and every dispatch below (the kernels' dispatch is generated from [`RuleConsts::KERNELS`]).
macro_rules! rules {
    ($($(#[$meta:meta])* $variant:ident($config:ty),)*) => {
        /// The optimizer and its hyperparameters: one variant per update rule. Defaults are
        /// PyTorch's. Hyperparameters are f64, as PyTorch's are Python floats: derived factors
        /// such as `1 - beta1` are computed in f64 and rounded to f32 once, as PyTorch does.
        #[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
        pub enum Hyper {
            $($(#[$meta])* $variant($config),)*
        }

        /// One parameter's rule constants for one step (what every backend applies).
        #[derive(Debug, Clone, Copy, PartialEq)]
        #[allow(missing_docs)]
        pub enum RuleConsts {
            $($variant(<$config as Rule>::Consts),)*
        }

        $(
            impl From<$config> for Hyper {
                fn from(rule: $config) -> Self {
                    Hyper::$variant(rule)
                }
            }
        )*

        impl Hyper {
            /// The learning rate.
            pub fn lr(&self) -> f64 {
                match self { $(Hyper::$variant(h) => h.lr(),)* }
            }

            /// Sets the learning rate.
            pub fn set_lr(&mut self, lr: f64) {
                match self { $(Hyper::$variant(h) => h.set_lr(lr),)* }
            }

            /// Number of state slots: 0, 1 or 2.
            pub fn states(&self) -> usize {
                match self { $(Hyper::$variant(h) => h.states(),)* }
            }

            /// Checks every hyperparameter; an invalid one is a typed error naming it.
            pub fn validate(&self) -> Result<(), OptimError> {
                match self { $(Hyper::$variant(h) => h.validate(),)* }
            }

            /// The rule's name.
            pub fn name(&self) -> &'static str {
                match self { $(Hyper::$variant(_) => <$config as Rule>::NAME,)* }
            }

            /// Whether state 2 is a second moment (which may be factorized).
            pub fn has_second_moment(&self) -> bool {
                match self { $(Hyper::$variant(_) => <$config as Rule>::SECOND_MOMENT,)* }
            }

            /// The constants at 1-based step `t`.
            pub fn consts(&self, t: u64) -> RuleConsts {
                match self { $(Hyper::$variant(h) => RuleConsts::$variant(h.consts(t)),)* }
            }
        }

        impl RuleConsts {
            /// Every rule, in kernel-id order: its name and its constants' layout.
            pub const KERNELS: &'static [(&'static str, &'static str, &'static [(&'static str, FieldType)])] = &[
                $((
                    <$config as Rule>::NAME,
                    <<$config as Rule>::Consts as KernelStruct>::NAME,
                    <<$config as Rule>::Consts as KernelStruct>::FIELDS,
                ),)*
            ];

            /// The rule's id in the kernels (its index in [`RuleConsts::KERNELS`]).
            pub fn kernel_id(&self) -> u32 {
                let mut k = 0u32;
                $(
                    if let RuleConsts::$variant(_) = self {
                        return k;
                    }
                    k += 1;
                )*
                k
            }

            /// The constants as the kernels read them (32-bit words).
            pub fn words(&self) -> &[u32] {
                match self { $(RuleConsts::$variant(c) => bytemuck::cast_slice(std::slice::from_ref(c)),)* }
            }

            /// `(beta2, 1 - beta2)` of the second moment.
            pub fn second_moment_betas(&self) -> Option<(f32, f32)> {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::second_moment_betas(c),)* }
            }

            /// One element's update (see `Rule::apply`).
            #[inline]
            pub fn apply(&self, f: StepFlags, p: f32, g: f32, m: &mut f32, v: &mut f32) -> Updated {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::apply(c, f, p, g, m, v),)* }
            }

            /// The gradient the second moment sees.
            #[inline]
            pub fn moment_gradient(&self, f: StepFlags, p: f32, g: f32) -> f32 {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::moment_gradient(c, f, p, g),)* }
            }
        }

        lpmm_formats::multiversion! {
            /// The rule over a chunk (see `apply_rule`), compiled per SIMD level and per rule.
            pub(crate) fn apply_chunk(rule: RuleConsts, f: StepFlags, clip: f32, limits: Limits, c: &mut Chunk<'_>) -> bool {
                match rule { $(RuleConsts::$variant(k) => apply_rule::<$config>(&k, f, clip, limits, c),)* }
            }
        }
    };
}

rules! {
    /// SGD with momentum, `torch.optim.SGD` semantics.
    Sgd(Sgd),
    /// Adam / AdamW.
    Adam(Adam),
    /// Lion (Chen et al. 2023; lion-pytorch semantics).
    Lion(Lion),
}

impl Hyper {
    /// `torch.optim.SGD(lr, momentum)` defaults otherwise.
    pub fn sgd(lr: f64, momentum: f64) -> Self {
        Hyper::Sgd(Sgd::new(lr).momentum(momentum))
    }

    /// `torch.optim.AdamW(lr)` defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn adamw(lr: f64) -> Self {
        Hyper::Adam(Adam::adamw(lr))
    }

    /// `torch.optim.Adam(lr)` defaults: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam(lr: f64) -> Self {
        Hyper::Adam(Adam::new(lr))
    }

    /// lion-pytorch defaults: betas (0.9, 0.99), no weight decay.
    pub fn lion(lr: f64) -> Self {
        Hyper::Lion(Lion::new(lr))
    }
}
