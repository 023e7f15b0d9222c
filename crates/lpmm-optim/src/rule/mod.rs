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

use serde::{Deserialize, Serialize};

use crate::error::OptimError;
use crate::vocab::SlotKind;
use crate::vocab::{F32_MAX_BITS, fits};

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
    /// State 3 is supplied (a factorized state's reconstruction) and not updated.
    pub const GIVEN_W: u32 = 8;
    /// The step only moves the parameter by the rule's transform ([`Hyper::transform`]: e.g.
    /// schedule-free AdamW's switch between its training point `y` and its evaluation point
    /// `x`): no gradient is read or consumed and no state changes.
    pub const TRANSFORM: u32 = 16;

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

/// A rule's setters (`fn name(self, args) -> Self`), declared once in its file: they become
/// methods of the rule, and the module's `forward_setters!` hands their signatures to a macro
/// (`$ for Rule { ... }`; the `$` lets this macro define that one). The presets forward every
/// setter through it ([`each_rule_setters!`]), so a rule's builder has no second list.
macro_rules! setters {
    ($d:tt for $rule:ident {
        $($(#[$doc:meta])* pub fn $name:ident($self:tt $(, $arg:ident: $ty:ty)* $(,)?) -> Self $body:block)*
    }) => {
        impl $rule {
            $($(#[$doc])* pub fn $name($self $(, $arg: $ty)*) -> Self $body)*
        }

        /// Hands this rule's setters to `$m` (the presets' forwarding).
        macro_rules! forward_setters {
            ($d m:ident) => {
                $d m! { $rule { $($(#[$doc])* fn $name($($arg: $ty),*);)* } }
            };
        }
        pub(crate) use forward_setters;
    };
}

/// A rule's named presets, declared once in its file: each a function returning a `Preset` of
/// the rule (the storages of every slot besides the rule's settings), then the presets the
/// backend conformance suite steps (`cases`: a name and a preset, `lpmm_optim::testing`'s
/// `preset_cases`). The tokens are compiled in [`crate::presets`], where `Preset`, `Storage`,
/// `StoreRounding` and the other presets are in scope (a rule itself knows nothing of
/// storage): the module's `forward_presets!` hands them there ([`each_rule_presets!`]), so the
/// presets and their cases have no list outside the rule's file.
macro_rules! presets {
    ($d:tt
        $($(#[$doc:meta])* pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block)*
        cases { $($case:literal => $preset:expr),* $(,)? }
    ) => {
        /// Hands this rule's presets and conformance cases to `$m` (the presets module).
        macro_rules! forward_presets {
            ($d m:ident) => {
                $d m! {
                    $($(#[$doc])* pub fn $name($($arg: $ty),*) -> $ret $body)*
                    cases { $($case => $preset,)* }
                }
            };
        }
        pub(crate) use forward_presets;
    };
}

/// The exponential moving average of squares a factorized slot keeps (its row and column
/// means): `new = beta * old + (1 - beta) * (mean(x^2) + eps)`, all f32, `x` the rule's
/// [`RuleConsts::moment_input`] for the slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moment {
    /// The decay of the old average.
    pub beta: f32,
    /// The weight of this step's mean.
    pub one_minus_beta: f32,
    /// Added to this step's mean (Adafactor's and CAME's `eps`; 0 for Adam).
    pub eps: f32,
}

/// The matrix phase a rule takes before its fused pass (Muon's orthogonalisation,
/// [docs/OPTIMIZERS.md] "Muon"): each element's matrix input (the rule's `matrix_input`) gathered into the
/// parameter's matrix, then `steps` Newton–Schulz iterations `A = X Xᵀ`, `B = b A + c A A`,
/// `X = a X + B X` on it (seen transposed when it has more rows than columns), whose result
/// each element then reads as its `v` operand in the rule's element-wise `apply`.
///
/// [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NewtonSchulz {
    /// The coefficient of `X`.
    pub a: f32,
    /// The coefficient of `A`.
    pub b: f32,
    /// The coefficient of `A A`.
    pub c: f32,
    /// How many iterations.
    pub steps: u32,
}

/// What a rule keeps on the host between steps, besides the step counter (schedule-free AdamW:
/// the largest scheduled learning rate so far and the sum of the averaging weights). Saved in
/// checkpoints; all zeros for rules that keep nothing.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct RuleState(pub [f64; 2]);

impl RuleState {
    /// Finite and non-negative (what a checkpoint may hold).
    pub fn valid(&self) -> bool {
        self.0.iter().all(|x| x.is_finite() && *x >= 0.0)
    }
}

/// One update rule: its configuration, constants and element-wise arithmetic.
///
/// A step is element-wise ([`Rule::apply`]) after up to three tensor-wide phases, each a fold
/// over the tensor and a host combine: the statistics of a factorized state 2
/// ([`Rule::moment`]), the rule's own sums of squares ([`Rule::stats`], e.g. Adafactor's RMS of
/// the update, which sets its clipping), then the statistics of a factorized state 3.
pub trait Rule:
    Copy + std::fmt::Debug + PartialEq + Serialize + for<'de> Deserialize<'de> + Send + Sync + 'static
{
    /// The rule's name: reports, and the stem of its kernel files (`rule/<name>.wgsl`, ...).
    const NAME: &'static str;
    /// The per-step constants.
    type Consts: KernelStruct;

    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate.
    fn set_lr(&mut self, lr: f64);
    /// Sets a fixed learning rate as a preset's `lr` does (Adafactor leaves its relative step
    /// for it; the others set it).
    fn fix_lr(&mut self, lr: f64) {
        self.set_lr(lr);
    }
    /// Which state slots (1, 2, 3) this configuration uses.
    fn states(&self) -> [bool; 3];
    /// Checks every hyperparameter; an invalid one is a typed error naming it.
    fn validate(&self) -> Result<(), OptimError>;
    /// Settings that exercise the rule's options, by name: the backend conformance suite steps
    /// each with every storage (`lpmm_optim::testing`), so a rule brings its own cases.
    fn conformance_cases() -> Vec<(&'static str, Self)>;
    /// The host state after step `t` (1-based) from the state before it.
    fn advance(&self, _t: u64, state: RuleState) -> RuleState {
        state
    }
    /// The constants at 1-based step `t`; `state` is the host state after step `t`
    /// ([`Rule::advance`]).
    fn consts(&self, t: u64, state: &RuleState) -> Self::Consts;
    /// Updates one element: parameter `p`, gradient `g`, states `m`, `v` and `w` (unused ones
    /// are ignored).
    fn apply(
        c: &Self::Consts,
        f: StepFlags,
        p: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        w: &mut f32,
    ) -> Updated;
    /// Whether `slot` may be factorized ([`crate::Storage::Factorized`]): an average of squares
    /// the rule reads but does not update when it is given ([`StepFlags::GIVEN_V`],
    /// [`StepFlags::GIVEN_W`]).
    fn factorable(_slot: SlotKind) -> bool {
        false
    }
    /// Why `slot` must be factorized on a tensor of two or more dimensions, if it must (the rule
    /// reads it only as a factorized reconstruction: CAME's instability).
    fn needs_factorized(_slot: SlotKind) -> Option<&'static str> {
        None
    }
    /// The moving average a factorized `slot` keeps.
    fn moment(_c: &Self::Consts, _slot: SlotKind) -> Option<Moment> {
        None
    }
    /// The value whose square feeds a factorized `slot`'s statistics (state 2: the gradient the
    /// second moment sees; Adam with L2 decay folds `wd * p` in first). For state 3 the states
    /// are state 1 and 2 as [`Rule::apply`] receives them (state 2 given).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn moment_input(
        _c: &Self::Consts,
        _f: StepFlags,
        _slot: SlotKind,
        _p: f32,
        g: f32,
        _m: f32,
        _v: f32,
        _w: f32,
    ) -> f32 {
        g
    }
    /// How many tensor-wide sums of squares the step needs before its fused pass.
    fn stats(_c: &Self::Consts) -> usize {
        0
    }
    /// The value whose square feeds sum `k` (the states as [`Rule::apply`] receives them,
    /// state 2 given if factorized).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn stat_input(
        _c: &Self::Consts,
        _f: StepFlags,
        _k: usize,
        _p: f32,
        _g: f32,
        _m: f32,
        _v: f32,
        _w: f32,
    ) -> f32 {
        0.0
    }
    /// Sets the constants that depend on the sums (host code, the same for every backend):
    /// `sums[k]` is the sum of squares of [`Rule::stat_input`] `k` over the tensor's `numel`
    /// elements.
    fn combine_stats(_c: &mut Self::Consts, _sums: &[f64], _numel: usize) {}
    /// The constants of the rule's transform of the parameter ([`StepFlags::TRANSFORM`]):
    /// towards the point it is evaluated at (`eval`), or back to the point it trains at. `None`
    /// if it evaluates where it trains.
    fn transform(&self, _eval: bool) -> Option<Self::Consts> {
        None
    }
    /// The matrix phase the step takes before its fused pass, if any ([`NewtonSchulz`]): the
    /// rule then steps only matrices (tensors of two dimensions), and [`Rule::apply`] reads the
    /// phase's result of its element as `v` (the rule keeps no state 2).
    fn newton_schulz(_c: &Self::Consts) -> Option<NewtonSchulz> {
        None
    }
    /// An element's value in the matrix phase's input (the states as [`Rule::apply`] receives
    /// them; constants combined from the rule's sums).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn matrix_input(
        _c: &Self::Consts,
        _f: StepFlags,
        _p: f32,
        _g: f32,
        _m: f32,
        _v: f32,
        _w: f32,
    ) -> f32 {
        0.0
    }
    /// Sets the constants that depend on the shape of the parameter's matrix, `rows × cols`
    /// (host code, before the matrix phase; Muon's shape-adjusted learning rate).
    fn combine_matrix(_c: &mut Self::Consts, _rows: usize, _cols: usize) {}
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

    /// The hyperparameters of Adafactor's relative second moment (Adafactor, AdaLomo): `eps1`
    /// positive, `eps2` finite and non-negative, `clip_threshold` positive, `decay_rate` finite
    /// and negative (`beta2_t = 1 - t^decay_rate`).
    pub fn relative_moment(
        eps: (f64, f64),
        clip_threshold: f64,
        decay_rate: f64,
    ) -> Result<(), OptimError> {
        positive("eps1", eps.0)?;
        finite_non_negative("eps2", eps.1)?;
        positive("clip_threshold", clip_threshold)?;
        if !(decay_rate.is_finite() && decay_rate < 0.0) {
            return Err(OptimError::Hyperparameter {
                name: "decay_rate",
                value: decay_rate,
            });
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
/// and `p`; `m`, `v` and `w` updated in place; `p` receives the new parameter and `d` the
/// increment.
#[derive(Debug)]
pub(crate) struct Chunk<'a> {
    pub g: &'a [f32],
    /// Added to each gradient before clipping: `+0.0` when `g` is a released gradient read where
    /// the caller holds it (the step's gradient is then `0.0 + g`: `-0.0` becomes `+0.0`, as
    /// after `accumulate`), `-0.0` otherwise (`x + -0.0` is `x`, bit for bit).
    pub g_plus: f32,
    pub p: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub w: &'a mut [f32],
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
    /// State 3's.
    pub state3: u32,
}

/// Applies rule `R` to every element of `c` with the gradient scaled by `clip` (`LEAN`: `c.w`
/// and `c.d` are neither read nor written, state 3 reading as zeros). An element whose
/// gradient is not finite, or whose update would produce a non-finite increment or a parameter or
/// state that does not fit its slot (`limits`: non-finite, or beyond the format's largest
/// magnitude, e.g. above bf16's range), is left unchanged (`d = 0`); returns whether any was.
/// Written without branches on the data so that it vectorizes; every element gets exactly
/// [`Rule::apply`]'s arithmetic.
#[inline(always)]
fn apply_rule<R: Rule, const LEAN: bool, const AVX512: bool>(
    c: &R::Consts,
    f: StepFlags,
    clip: f32,
    limits: Limits,
    chunk: &mut Chunk<'_>,
) -> bool {
    let n = chunk.g.len();
    // Lean: no state 3 (it reads as zeros and is not touched), no increments kept.
    let lean = if LEAN { 0 } else { n };
    let (g, p, m, v, w, d) = (
        &chunk.g[..n],
        &mut chunk.p[..n],
        &mut chunk.m[..n],
        &mut chunk.v[..n],
        &mut chunk.w[..lean],
        &mut chunk.d[..lean],
    );
    // One loop over the chunk (`apply_run` slices every operand to one length, so its bounds
    // checks go): runs of 64 elements, as this took before, made f32 AdamW's step 1.4x slower
    // on one Zen 4 core (docs/BENCHMARKS.md, "What was tried"). The usual flags of a step are a
    // constant there, so the rule's branches on them leave the loop.
    if f.0 == StepFlags::UPDATE_PARAM {
        apply_run::<R, LEAN, AVX512, { StepFlags::UPDATE_PARAM }>(
            c,
            f,
            clip,
            limits,
            chunk.g_plus,
            g,
            p,
            m,
            v,
            w,
            d,
        )
    } else {
        apply_run::<R, LEAN, AVX512, ANY_FLAGS>(c, f, clip, limits, chunk.g_plus, g, p, m, v, w, d)
    }
}

/// [`apply_run`]'s `FLAGS` when the step's flags are not a constant.
const ANY_FLAGS: u32 = u32::MAX;

/// [`apply_rule`]'s loop; `FLAGS`: the step's flags where they are known at compile time (`f`
/// is then `StepFlags(FLAGS)`), or [`ANY_FLAGS`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn apply_run<R: Rule, const LEAN: bool, const AVX512: bool, const FLAGS: u32>(
    c: &R::Consts,
    f: StepFlags,
    clip: f32,
    limits: Limits,
    g_plus: f32,
    g: &[f32],
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    w: &mut [f32],
    d: &mut [f32],
) -> bool {
    let n = g.len();
    let f = if FLAGS == ANY_FLAGS {
        f
    } else {
        StepFlags(FLAGS)
    };
    let lean = if LEAN { 0 } else { n };
    let (p, m, v, w, d) = (
        &mut p[..n],
        &mut m[..n],
        &mut v[..n],
        &mut w[..lean],
        &mut d[..lean],
    );
    let mut bad = false;
    // `opaque(x)` is `x`, below AVX-512 through an OR with a zero the compiler cannot see: LLVM
    // turns the store of `if ok { new } else { loaded }` to the loaded address into a masked
    // store, at AVX2 `vmaskmovps`, which AMD's Zen cores run as microcode (on a Zen 4, f32 AdamW
    // at AVX2 took 1.4x the time of the blend and plain store it stands for); AVX-512's masked
    // stores are single instructions, kept.
    let zero = if AVX512 {
        0
    } else {
        std::hint::black_box(0u32)
    };
    let opaque = |x: f32| f32::from_bits(x.to_bits() | zero);
    for i in 0..n {
        let gi = (g[i] + g_plus) * clip;
        let (p0, m0, v0) = (p[i], m[i], v[i]);
        let w0 = if LEAN { 0.0 } else { w[i] };
        let (mut mi, mut vi, mut wi) = (m0, v0, w0);
        let u = R::apply(c, f, p0, gi, &mut mi, &mut vi, &mut wi);
        let ok = fits(gi, F32_MAX_BITS)
            & fits(u.param, limits.param)
            & fits(u.delta, F32_MAX_BITS)
            & fits(mi, limits.state1)
            & fits(vi, limits.state2)
            & fits(wi, limits.state3);
        m[i] = opaque(if ok { mi } else { m0 });
        v[i] = opaque(if ok { vi } else { v0 });
        p[i] = opaque(if ok { u.param } else { p0 });
        if !LEAN {
            w[i] = opaque(if ok { wi } else { w0 });
            d[i] = if ok { u.delta } else { 0.0 };
        }
        bad |= !ok;
    }
    bad
}

/// The registry: one line per rule generates the [`Hyper`] variant, the [`RuleConsts`] variant
/// and every dispatch below (the kernels' dispatch is generated from [`RuleConsts::KERNELS`]).
macro_rules! rules {
    ($d:tt $($(#[$meta:meta])* $variant:ident($config:ident) in $module:ident,)*) => {
        // Each rule's file, and its configuration type.
        $(pub(crate) mod $module;)*
        $(pub use $module::$config;)*

        /// Every rule's configuration type, for the crate root's re-export (`pub use
        /// rule::configs::*`): the registry line is the only list.
        pub mod configs {
            $(pub use super::$module::$config;)*
        }

        /// Hands every rule's setters to `$m`, one invocation per rule (each rule file's
        /// `setters!`).
        macro_rules! each_rule_setters {
            ($d m:ident) => {
                $($crate::rule::$module::forward_setters!($d m);)*
            };
        }
        pub(crate) use each_rule_setters;

        /// Hands every rule's presets and their conformance cases to `$m`, one invocation per
        /// rule in the registry's order (each rule file's `presets!`).
        macro_rules! each_rule_presets {
            ($d m:ident) => {
                $($crate::rule::$module::forward_presets!($d m);)*
            };
        }
        pub(crate) use each_rule_presets;

        /// The optimizer and its hyperparameters: one variant per update rule. Defaults are the
        /// reference implementations'. Hyperparameters are f64, as PyTorch's are Python floats:
        /// derived factors such as `1 - beta1` are computed in f64 and rounded to f32 once, as
        /// PyTorch does.
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
            /// Every rule's own conformance cases (its file's `conformance_cases`): settings that
            /// exercise its options, by name, in the registry's order.
            pub fn conformance_cases() -> Vec<(&'static str, Hyper)> {
                let mut cases = Vec::new();
                $(cases.extend(
                    <$config as Rule>::conformance_cases()
                        .into_iter()
                        .map(|(name, rule)| (name, Hyper::$variant(rule))),
                );)*
                cases
            }

            /// The learning rate.
            pub fn lr(&self) -> f64 {
                match self { $(Hyper::$variant(h) => h.lr(),)* }
            }

            /// Sets the learning rate.
            pub fn set_lr(&mut self, lr: f64) {
                match self { $(Hyper::$variant(h) => h.set_lr(lr),)* }
            }

            /// Which state slots (1, 2, 3) the configuration uses.
            pub fn states(&self) -> [bool; 3] {
                match self { $(Hyper::$variant(h) => h.states(),)* }
            }

            /// Whether the configuration uses `slot` (the parameter and the gradient always).
            pub fn uses(&self, slot: SlotKind) -> bool {
                match slot {
                    SlotKind::Param | SlotKind::Grad => true,
                    SlotKind::State1 => self.states()[0],
                    SlotKind::State2 => self.states()[1],
                    SlotKind::State3 => self.states()[2],
                }
            }

            /// Checks every hyperparameter; an invalid one is a typed error naming it.
            pub fn validate(&self) -> Result<(), OptimError> {
                match self { $(Hyper::$variant(h) => h.validate(),)* }
            }

            /// The rule's name.
            pub fn name(&self) -> &'static str {
                match self { $(Hyper::$variant(_) => <$config as Rule>::NAME,)* }
            }

            /// Whether `slot` may be factorized (an average of squares: Adam's, Adafactor's and
            /// CAME's second moments, CAME's instability).
            pub fn factorable(&self, slot: SlotKind) -> bool {
                match self { $(Hyper::$variant(_) => <$config as Rule>::factorable(slot),)* }
            }

            /// Why `slot` must be factorized on a tensor of two or more dimensions, if it must.
            pub fn needs_factorized(&self, slot: SlotKind) -> Option<&'static str> {
                match self { $(Hyper::$variant(_) => <$config as Rule>::needs_factorized(slot),)* }
            }

            /// The host state after step `t` from the state before it.
            pub fn advance(&self, t: u64, state: RuleState) -> RuleState {
                match self { $(Hyper::$variant(h) => h.advance(t, state),)* }
            }

            /// The constants at 1-based step `t`, `state` the host state after it.
            pub fn consts(&self, t: u64, state: &RuleState) -> RuleConsts {
                match self { $(Hyper::$variant(h) => RuleConsts::$variant(h.consts(t, state)),)* }
            }

            /// The constants of the parameter's transform to its evaluation point (`eval`) or
            /// back ([`StepFlags::TRANSFORM`]); `None` for rules that evaluate where they train.
            pub fn transform(&self, eval: bool) -> Option<RuleConsts> {
                match self { $(Hyper::$variant(h) => h.transform(eval).map(RuleConsts::$variant),)* }
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

            /// The moving average a factorized `slot` keeps.
            pub fn moment(&self, slot: SlotKind) -> Option<Moment> {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::moment(c, slot),)* }
            }

            /// One element's update (see `Rule::apply`).
            #[inline]
            #[allow(clippy::too_many_arguments)]
            pub fn apply(&self, f: StepFlags, p: f32, g: f32, m: &mut f32, v: &mut f32, w: &mut f32) -> Updated {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::apply(c, f, p, g, m, v, w),)* }
            }

            /// The value whose square feeds a factorized `slot`'s statistics.
            #[inline]
            #[allow(clippy::too_many_arguments)]
            pub fn moment_input(&self, f: StepFlags, slot: SlotKind, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::moment_input(c, f, slot, p, g, m, v, w),)* }
            }

            /// How many tensor-wide sums of squares the step needs.
            pub fn stats(&self) -> usize {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::stats(c),)* }
            }

            /// The value whose square feeds sum `k`.
            #[inline]
            #[allow(clippy::too_many_arguments)]
            pub fn stat_input(&self, f: StepFlags, k: usize, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::stat_input(c, f, k, p, g, m, v, w),)* }
            }

            /// Sets the constants that depend on the sums of squares (host code).
            pub fn combine_stats(&mut self, sums: &[f64], numel: usize) {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::combine_stats(c, sums, numel),)* }
            }

            /// The matrix phase the step takes before its fused pass, if any.
            pub fn newton_schulz(&self) -> Option<NewtonSchulz> {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::newton_schulz(c),)* }
            }

            /// An element's value in the matrix phase's input.
            #[inline]
            #[allow(clippy::too_many_arguments)]
            pub fn matrix_input(&self, f: StepFlags, p: f32, g: f32, m: f32, v: f32, w: f32) -> f32 {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::matrix_input(c, f, p, g, m, v, w),)* }
            }

            /// Sets the constants that depend on the parameter's matrix shape (host code).
            pub fn combine_matrix(&mut self, rows: usize, cols: usize) {
                match self { $(RuleConsts::$variant(c) => <$config as Rule>::combine_matrix(c, rows, cols),)* }
            }
        }

        lpmm_formats::multiversion! {
            /// The rule over a chunk (see `apply_rule`), compiled per SIMD level and per rule.
            pub(crate) fn apply_chunk<const AVX512: bool>(rule: RuleConsts, f: StepFlags, clip: f32, limits: Limits, c: &mut Chunk<'_>) -> bool {
                match rule { $(RuleConsts::$variant(k) => apply_rule::<$config, false, AVX512>(&k, f, clip, limits, c),)* }
            }
        }

        lpmm_formats::multiversion! {
            /// [`apply_chunk`] for a parameter without state 3 whose increments are not kept
            /// (`c.w` and `c.d` are neither read nor written): the CPU's specialized kernels.
            pub(crate) fn apply_chunk_lean<const AVX512: bool>(rule: RuleConsts, f: StepFlags, clip: f32, limits: Limits, c: &mut Chunk<'_>) -> bool {
                match rule { $(RuleConsts::$variant(k) => apply_rule::<$config, true, AVX512>(&k, f, clip, limits, c),)* }
            }
        }

        lpmm_formats::multiversion! {
            /// `c.d[j]` = the fold input `of` ([`RuleConsts::moment_input`] or
            /// [`RuleConsts::stat_input`], the gradient times `clip`) of every element of a
            /// chunk: a fold pass's inputs, compiled per SIMD level and per rule (the rules'
            /// `mul_add`s are FMA instructions, not library calls).
            pub(crate) fn fold_inputs(rule: RuleConsts, f: StepFlags, of: FoldValue, clip: f32, c: &mut Chunk<'_>) {
                match rule {
                    $(RuleConsts::$variant(k) => {
                        for (j, d) in c.d.iter_mut().enumerate() {
                            let (p, g, m, v, w) = (c.p[j], c.g[j] * clip, c.m[j], c.v[j], c.w[j]);
                            *d = match of {
                                FoldValue::Moment(slot) => <$config as Rule>::moment_input(&k, f, slot, p, g, m, v, w),
                                FoldValue::Stat(s) => <$config as Rule>::stat_input(&k, f, s, p, g, m, v, w),
                                FoldValue::Matrix => <$config as Rule>::matrix_input(&k, f, p, g, m, v, w),
                            };
                        }
                    })*
                }
            }
        }
    };
}

/// What a fold pass sums the squares of, element by element ([`fold_inputs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FoldValue {
    /// The moment input of a slot ([`RuleConsts::moment_input`]).
    Moment(SlotKind),
    /// The input of the rule's sum `k` ([`RuleConsts::stat_input`]).
    Stat(usize),
    /// The element's value in the matrix phase's input ([`RuleConsts::matrix_input`]).
    Matrix,
}

/// The most tensor-wide sums a rule may ask for ([`RuleConsts::stats`]).
pub const MAX_STATS: usize = 2;

rules! {
    $
    /// SGD with momentum, `torch.optim.SGD` semantics.
    Sgd(Sgd) in sgd,
    /// Adam / AdamW.
    Adam(Adam) in adam,
    /// Lion (Chen et al. 2023; lion-pytorch semantics).
    Lion(Lion) in lion,
    /// Adafactor (Shazeer & Stern 2018; `transformers.optimization.Adafactor` semantics).
    Adafactor(Adafactor) in adafactor,
    /// CAME (Luo et al. 2023; the authors' `came-pytorch` semantics).
    Came(Came) in came,
    /// AdEMAMix (Pagliardini et al. 2024; bitsandbytes' `AdEMAMix` semantics).
    AdEMAMix(AdEMAMix) in ademamix,
    /// Schedule-free AdamW (Defazio et al. 2024; the `schedulefree` package's
    /// `AdamWScheduleFree`).
    ScheduleFreeAdamW(ScheduleFreeAdamW) in schedule_free,
    /// RMSprop, `torch.optim.RMSprop` semantics.
    RmsProp(RmsProp) in rmsprop,
    /// Adagrad, `torch.optim.Adagrad` semantics.
    Adagrad(Adagrad) in adagrad,
    /// LAMB (You et al. 2019; `torch_optimizer.Lamb` semantics).
    Lamb(Lamb) in lamb,
    /// Muon (Jordan et al. 2024; `torch.optim.Muon` semantics): a matrix phase.
    Muon(Muon) in muon,
    /// AdaLomo (Lv et al. 2023; the authors' `lomo-optim` semantics).
    AdaLomo(AdaLomo) in adalomo,
}

pub use muon::AdjustLr;

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

    /// `transformers`' Adafactor defaults: relative step size, parameter scaling, no first
    /// moment, `beta2_t = 1 - t^-0.8`, update clipping at RMS 1.
    pub fn adafactor() -> Self {
        Hyper::Adafactor(Adafactor::new())
    }

    /// CAME with learning rate `lr` and the authors' defaults: betas (0.9, 0.999, 0.9999), eps
    /// (1e-30, 1e-16), no weight decay.
    pub fn came(lr: f64) -> Self {
        Hyper::Came(Came::new(lr))
    }

    /// bitsandbytes' AdEMAMix defaults: betas (0.9, 0.999, 0.9999), alpha 5, eps 1e-8, weight
    /// decay 0.01, no schedules.
    pub fn ademamix(lr: f64) -> Self {
        Hyper::AdEMAMix(AdEMAMix::new(lr))
    }

    /// `schedulefree.AdamWScheduleFree(lr)` defaults: betas (0.9, 0.999), eps 1e-8, no weight
    /// decay, no warmup, r 0, weight_lr_power 2.
    pub fn schedule_free_adamw(lr: f64) -> Self {
        Hyper::ScheduleFreeAdamW(ScheduleFreeAdamW::new(lr))
    }

    /// `torch.optim.RMSprop(lr)` defaults: alpha 0.99, eps 1e-8, no weight decay, no momentum,
    /// not centered.
    pub fn rmsprop(lr: f64) -> Self {
        Hyper::RmsProp(RmsProp::new(lr))
    }

    /// `torch.optim.Adagrad(lr)` defaults: no learning-rate decay, no weight decay, initial
    /// accumulator 0, eps 1e-10.
    pub fn adagrad(lr: f64) -> Self {
        Hyper::Adagrad(Adagrad::new(lr))
    }

    /// `torch.optim.Muon(lr)` defaults: weight decay 0.1, momentum 0.95, Nesterov, coefficients
    /// (3.4445, -4.775, 2.0315), eps 1e-7, 5 Newton–Schulz iterations, the original shape
    /// adjustment.
    pub fn muon(lr: f64) -> Self {
        Hyper::Muon(Muon::new(lr))
    }

    /// `lomo_optim.AdaLomo(model, lr)` defaults: `eps = (1e-30, 1e-3)`, clip threshold 1, decay
    /// rate -0.8, no weight decay, no gradient clamp.
    pub fn adalomo(lr: f64) -> Self {
        Hyper::AdaLomo(AdaLomo::new(lr))
    }

    /// Whether the rule takes a matrix phase (steps matrices only).
    pub fn takes_matrix(&self) -> bool {
        self.consts(1, &RuleState::default())
            .newton_schulz()
            .is_some()
    }
}
