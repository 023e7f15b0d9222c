//! Named configurations a user picks in one line, each a builder ([`Preset`]) that converts into
//! the [`ParamConfig`] an optimizer takes:
//!
//! ```
//! use lpmm_optim::{ParamConfig, presets};
//!
//! // bitsandbytes' AdamW8bit: f32 parameters, 8-bit states; betas and decay changed.
//! let config: ParamConfig = presets::adamw_8bit(1e-3).weight_decay(0.1).betas(0.9, 0.95).into();
//! assert_eq!(config.hyper.lr(), 1e-3);
//! ```
//!
//! The builder is typed by its update rule: Adam's presets take `betas`/`eps`, Lion's `betas`,
//! SGD's `momentum`/`dampening`/`nesterov`, and a setter a rule lacks does not compile. The
//! storages can be overridden too (`with_state1`, `with_min_quantized_size`, ...). Which preset
//! to pick: the README's table (memory per parameter, quality, speed).
//!
//! A rule's presets are declared in its own file (`presets!` in `rule/<name>.rs`, with the cases
//! the conformance suite steps) and defined here from there; this module holds the builder and
//! [`bf16_nearest`], which fits every rule. docs/REGISTRIES.md lists every preset with its
//! storages (generated: `cargo xtask codegen`).

use crate::config::ParamConfig;
use crate::format::{Storage, StoreRounding};
// Every rule's configuration type (the registry's list), for `forward!` and the presets.
use crate::routing::Hybrid;
use crate::rule::configs::*;
use crate::rule::{AdjustLr, Hyper, Rule};

/// A preset being customised: an update rule `R` ([`Adam`], [`Lion`], [`Sgd`], or any
/// [`Hyper`]) and the storage of each slot. Converts into [`ParamConfig`] (`.into()` or
/// [`Preset::build`]); every function taking a configuration accepts it as it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preset<R> {
    rule: R,
    param: Storage,
    grad: Storage,
    state1: Storage,
    state2: Storage,
    state3: Storage,
    min_quantized_size: usize,
}

impl<R: Into<Hyper>> From<Preset<R>> for ParamConfig {
    fn from(p: Preset<R>) -> Self {
        ParamConfig::f32(p.rule.into())
            .with_param(p.param)
            .with_grad(p.grad)
            .with_state1(p.state1)
            .with_state2(p.state2)
            .with_state3(p.state3)
            .with_min_quantized_size(p.min_quantized_size)
    }
}

impl<R: Into<Hyper>> Preset<R> {
    /// The configuration ([`ParamConfig::validate`] checks it when an optimizer takes it).
    pub fn build(self) -> ParamConfig {
        self.into()
    }
}

impl<R> Preset<R> {
    /// All f32 with update rule `rule`; the minimum quantized size is bitsandbytes' 4096.
    pub fn f32(rule: R) -> Self {
        Preset {
            rule,
            param: Storage::F32,
            grad: Storage::F32,
            state1: Storage::F32,
            state2: Storage::F32,
            state3: Storage::F32,
            min_quantized_size: 4096,
        }
    }

    /// The update rule and its hyperparameters.
    pub fn rule(&self) -> &R {
        &self.rule
    }

    /// With the parameter stored as `s`.
    pub fn with_param(self, s: Storage) -> Self {
        Preset { param: s, ..self }
    }

    /// With the gradient accumulator stored as `s`.
    pub fn with_grad(self, s: Storage) -> Self {
        Preset { grad: s, ..self }
    }

    /// With state 1 (momentum / first moment) stored as `s`.
    pub fn with_state1(self, s: Storage) -> Self {
        Preset { state1: s, ..self }
    }

    /// With state 2 (Adam's second moment) stored as `s`.
    pub fn with_state2(self, s: Storage) -> Self {
        Preset { state2: s, ..self }
    }

    /// With state 3 (AdEMAMix's slow first moment, CAME's instability) stored as `s`.
    pub fn with_state3(self, s: Storage) -> Self {
        Preset { state3: s, ..self }
    }

    /// Tensors with fewer elements keep quantized slots in f32 (bitsandbytes' `min_8bit_size`).
    pub fn with_min_quantized_size(self, n: usize) -> Self {
        Preset {
            min_quantized_size: n,
            ..self
        }
    }

    fn map_rule(self, f: impl FnOnce(R) -> R) -> Self {
        Preset {
            rule: f(self.rule),
            ..self
        }
    }
}

impl<R: Rule> Preset<R> {
    /// With learning rate `lr` (for Adafactor: a fixed rate instead of the relative step,
    /// parameter scaling kept as set).
    pub fn lr(self, lr: f64) -> Self {
        self.map_rule(|mut r| {
            r.fix_lr(lr);
            r
        })
    }
}

/// Every setter of rule `R` on `Preset<R>`, from the rule file's `setters!`.
macro_rules! forward {
    ($rule:ident { $($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*);)* }) => {
        impl Preset<$rule> {
            $($(#[$doc])* pub fn $name(self, $($arg: $ty),*) -> Self {
                self.map_rule(|r| r.$name($($arg),*))
            })*
        }
    };
}
crate::rule::each_rule_setters!(forward);

impl Preset<Hyper> {
    /// With learning rate `lr`.
    pub fn lr(self, lr: f64) -> Self {
        self.map_rule(|mut h| {
            h.set_lr(lr);
            h
        })
    }
}

/// Defines the presets of every rule, from its file's `presets!` (their doc comments are theirs).
macro_rules! define {
    ($($(#[$doc:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block)*
        cases { $($case:literal => $preset:expr,)* }) => {
        $($(#[$doc])* pub fn $name($($arg: $ty),*) -> $ret $body)*
    };
}
crate::rule::each_rule_presets!(define);

/// Every named preset of every rule (its file's `presets!`), in the registry's order: its name
/// and its configuration with every argument 0 (what it stores; its hyperparameters are not the
/// point).
#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))] // read by `testing`
pub(crate) fn named() -> Vec<(&'static str, ParamConfig)> {
    let mut named = Vec::new();
    macro_rules! collect {
        ($($(#[$doc:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block)*
            cases { $($case:literal => $preset:expr,)* }) => {
            $(named.push((stringify!($name), $name($(<$ty>::default()),*).build()));)*
        };
    }
    crate::rule::each_rule_presets!(collect);
    named
}

/// The presets the backend conformance suite steps (`lpmm_optim::testing::preset_cases`): every
/// rule's `cases` (its file's `presets!`), in the registry's order.
#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))] // read by `testing`
pub(crate) fn conformance_cases() -> Vec<(&'static str, ParamConfig)> {
    let mut cases = Vec::new();
    macro_rules! collect {
        ($($(#[$doc:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block)*
            cases { $($case:literal => $preset:expr,)* }) => {
            $(cases.push(($case, $preset.build()));)*
        };
    }
    crate::rule::each_rule_presets!(collect);
    cases
}

/// Everything bf16 with round-to-nearest: the naive low-precision setup whose small updates
/// underflow. `rule` is any rule ([`Adam`], [`Lion`], [`Sgd`]) or a [`Hyper`].
pub fn bf16_nearest<R>(rule: R) -> Preset<R> {
    let bf = Storage::Bf16(StoreRounding::Nearest);
    Preset::f32(rule)
        .with_param(bf)
        .with_grad(bf)
        .with_state1(bf)
        .with_state2(bf)
}

/// Muon for a model's hidden matrices and AdamW for the rest ([`Hybrid`]), all f32: the
/// reference for the Muon hybrids. `muon_lr` is Muon's (torch's examples: 0.02), `adamw_lr`
/// AdamW's.
pub fn muon_adamw_f32(muon_lr: f64, adamw_lr: f64) -> Hybrid {
    Hybrid::new(muon_f32(muon_lr), adamw_f32(adamw_lr))
}

/// 8-bit Muon for the hidden matrices and 8-bit AdamW for the rest, both with bf16 parameters
/// and gradients rounded stochastically ([`muon_8bit_bf16_sr`], [`adamw_8bit_bf16_sr`]).
pub fn muon_adamw_8bit_bf16_sr(muon_lr: f64, adamw_lr: f64) -> Hybrid {
    Hybrid::new(muon_8bit_bf16_sr(muon_lr), adamw_8bit_bf16_sr(adamw_lr))
}

/// 4-bit Muon for the hidden matrices and 4-bit AdamW for the rest, both with bf16 parameters
/// and gradients rounded stochastically ([`muon_4bit_bf16_sr`]; AdamW's states as
/// [`adamw_4bit`]'s).
pub fn muon_adamw_4bit_bf16_sr(muon_lr: f64, adamw_lr: f64) -> Hybrid {
    let bf16_sr = Storage::Bf16(StoreRounding::Stochastic);
    Hybrid::new(
        muon_4bit_bf16_sr(muon_lr),
        adamw_4bit(adamw_lr).with_param(bf16_sr).with_grad(bf16_sr),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rules_presets_and_cases_are_valid_and_named_once() {
        let (named, cases) = (named(), conformance_cases());
        for list in [&named, &cases] {
            let mut names: Vec<&str> = list.iter().map(|(n, _)| *n).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), list.len(), "a name is used twice");
            for (name, config) in list {
                config.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
            }
        }
        // Every rule of the registry brings presets and preset cases.
        for (rule, _, _) in crate::rule::RuleConsts::KERNELS {
            assert!(named.iter().any(|(_, c)| c.hyper.name() == *rule), "{rule}");
            assert!(cases.iter().any(|(_, c)| c.hyper.name() == *rule), "{rule}");
        }
    }

    #[test]
    fn builders_set_the_rule() {
        let c: ParamConfig = adamw_8bit(1e-3)
            .weight_decay(0.1)
            .betas(0.9, 0.95)
            .eps(1e-6)
            .into();
        assert_eq!(
            c.hyper,
            Hyper::Adam(
                Adam::adamw(1e-3)
                    .weight_decay(0.1)
                    .betas(0.9, 0.95)
                    .eps(1e-6)
            )
        );
        assert_eq!(c.state1, Storage::DYNAMIC8_SIGNED);
        assert_eq!(c.param, Storage::F32);
        let l = lion_8bit(1e-4).betas(0.95, 0.98).weight_decay(1.0).build();
        assert_eq!(
            l.hyper,
            Hyper::Lion(Lion::new(1e-4).betas(0.95, 0.98).weight_decay(1.0))
        );
        assert_eq!(
            (l.state1, l.state2),
            (Storage::DYNAMIC8_SIGNED, Storage::F32)
        );
        let s = lpmm_sgdm(0.1, 0.9).nesterov(true).lr(0.2).build();
        assert_eq!(
            s.hyper,
            Hyper::Sgd(Sgd::new(0.2).momentum(0.9).nesterov(true))
        );
        assert_eq!(s.min_quantized_size, 0);
        let b = bf16_nearest(Hyper::lion(1e-4)).lr(1e-3).build();
        assert_eq!(b.hyper.lr(), 1e-3);
        for c in [
            adamw_8bit(1e-3).build(),
            adamw_4bit(1e-3).build(),
            lion_8bit(1e-3).build(),
            adamw_4bit_split(1e-3).build(),
            adamw_4bit_bf16_sr_released(1e-3).build(),
            adafactor_f32().build(),
            adafactor_8bit().weight_decay(0.01).build(),
            adafactor_lpmm().build(),
            came_f32(2e-4).build(),
            came_8bit(2e-4).betas(0.9, 0.999, 0.9999).build(),
            came_lpmm(2e-4).build(),
            ademamix_f32(1e-3).build(),
            ademamix_8bit(1e-3).warmup(Some(100), Some(100)).build(),
            schedule_free_adamw_f32(1e-3).warmup_steps(10).build(),
            schedule_free_adamw_8bit(1e-3).build(),
            rmsprop_f32(1e-2).build(),
            rmsprop_8bit(1e-2).momentum(0.9).centered(true).build(),
            adagrad_f32(1e-2).build(),
            adagrad_8bit(1e-2).lr_decay(1e-3).build(),
            lamb_f32(1e-3).build(),
            lamb_8bit(1e-3).weight_decay(0.01).debias(true).build(),
        ] {
            c.validate().unwrap();
        }
        let a = adafactor_8bit().lr(1e-3).build();
        assert_eq!(
            a.hyper,
            Hyper::Adafactor(Adafactor::with_lr(1e-3).beta1(0.9))
        );
        let r = rmsprop_8bit(1e-2)
            .alpha(0.9)
            .eps(1e-6)
            .weight_decay(0.1)
            .momentum(0.5)
            .centered(true)
            .lr(1e-3)
            .build();
        assert_eq!(
            r.hyper,
            Hyper::RmsProp(
                RmsProp::new(1e-3)
                    .alpha(0.9)
                    .eps(1e-6)
                    .weight_decay(0.1)
                    .momentum(0.5)
                    .centered(true)
            )
        );
        assert_eq!(
            (r.state1, r.state2, r.state3),
            (
                Storage::DYNAMIC8_SIGNED,
                Storage::DYNAMIC8_UNSIGNED,
                Storage::DYNAMIC8_SIGNED
            )
        );
        let g = adagrad_8bit(1e-2)
            .lr_decay(0.1)
            .weight_decay(0.2)
            .initial_accumulator_value(0.3)
            .eps(1e-8)
            .lr(1e-3)
            .build();
        assert_eq!(
            g.hyper,
            Hyper::Adagrad(
                Adagrad::new(1e-3)
                    .lr_decay(0.1)
                    .weight_decay(0.2)
                    .initial_accumulator_value(0.3)
                    .eps(1e-8)
            )
        );
        assert_eq!(
            (g.state1, g.state2),
            (Storage::F32, Storage::DYNAMIC8_UNSIGNED)
        );
    }
}
