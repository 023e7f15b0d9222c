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

use crate::config::ParamConfig;
use crate::format::{Storage, StoreRounding};
// Every rule's configuration type (the registry's list), for `forward!` and the presets.
use crate::rule::configs::*;
use crate::rule::{Hyper, Rule};

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

/// f32 SGD with momentum: the reference for the SGDM presets (12 bytes per parameter).
pub fn sgdm_f32(lr: f64, momentum: f64) -> Preset<Sgd> {
    Preset::f32(Sgd::new(lr).momentum(momentum))
}

/// LPMM-SGDM: parameters, gradient accumulator and momentum all 8-bit linear in groups of 64 with
/// stochastic rounding (about 3.19 bytes per parameter), for every tensor however small (LPMM
/// keeps the whole model memory in 8 bits; there is no minimum size).
pub fn lpmm_sgdm(lr: f64, momentum: f64) -> Preset<Sgd> {
    sgdm_f32(lr, momentum)
        .with_param(Storage::LINEAR8_GROUP64_SR)
        .with_grad(Storage::LINEAR8_GROUP64_SR)
        .with_state1(Storage::LINEAR8_GROUP64_SR)
        .with_min_quantized_size(0)
}

/// f32 AdamW: the reference for the AdamW presets (16 bytes per parameter).
pub fn adamw_f32(lr: f64) -> Preset<Adam> {
    Preset::f32(Adam::adamw(lr))
}

/// bitsandbytes' `AdamW8bit` on an f32 model: f32 parameters and gradients, 8-bit dynamic states
/// in blocks of 256 (a one-line swap for f32 AdamW; with gradients stepped where the framework
/// holds them, no accumulator is ever allocated).
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

/// 4-bit AdamW (lpmm's maps, blocks of 128) with split-f32 parameters (exactly f32, bf16-readable)
/// and bf16 gradients.
pub fn adamw_4bit_split(lr: f64) -> Preset<Adam> {
    adamw_4bit(lr)
        .with_param(Storage::SplitF32)
        .with_grad(Storage::Bf16(StoreRounding::Nearest))
}

/// f32 Lion: the reference for the Lion presets (12 bytes per parameter).
pub fn lion_f32(lr: f64) -> Preset<Lion> {
    Preset::f32(Lion::new(lr))
}

/// bitsandbytes' `Lion8bit` without paging: f32 parameters and gradients, the momentum 8-bit
/// dynamic in blocks of 256.
pub fn lion_8bit(lr: f64) -> Preset<Lion> {
    lion_f32(lr).with_state1(Storage::DYNAMIC8_SIGNED)
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

/// The smallest AdamW: bf16 parameters with stochastic rounding, 4-bit states, and no gradient
/// memory at all: gradients are released in the backward pass (`Step::param`) or folded into the
/// states (`Step::states_only`).
pub fn adamw_4bit_bf16_sr_released(lr: f64) -> Preset<Adam> {
    adamw_4bit(lr)
        .with_param(Storage::Bf16(StoreRounding::Stochastic))
        .with_grad(Storage::None)
}

/// Adafactor as `transformers` defaults it (relative step size scaled by the parameter's RMS, no
/// first moment, update clipping): f32 parameters and gradients, the second moment factorized
/// (a full f32 one for vectors). The reference for the Adafactor presets.
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

/// CAME with the authors' defaults: f32 parameters, gradients and first moment, the second
/// moment and the instability factorized. The reference for the CAME presets.
pub fn came_f32(lr: f64) -> Preset<Came> {
    Preset::f32(Came::new(lr))
        .with_state2(Storage::Factorized)
        .with_state3(Storage::Factorized)
}

/// CAME with the first moment 8-bit dynamic in blocks of 256; f32 parameters and gradients.
pub fn came_8bit(lr: f64) -> Preset<Came> {
    came_f32(lr).with_state1(Storage::DYNAMIC8_SIGNED)
}

/// CAME with the whole model memory LPMM-style: parameters and gradient accumulator 8-bit linear
/// in groups of 64 with stochastic rounding (every tensor), the first moment 8-bit dynamic, the
/// two statistics factorized.
pub fn came_lpmm(lr: f64) -> Preset<Came> {
    came_8bit(lr)
        .with_param(Storage::LINEAR8_GROUP64_SR)
        .with_grad(Storage::LINEAR8_GROUP64_SR)
        .with_min_quantized_size(0)
}

/// AdEMAMix with bitsandbytes' defaults, everything f32: the reference for the AdEMAMix presets.
pub fn ademamix_f32(lr: f64) -> Preset<AdEMAMix> {
    Preset::f32(AdEMAMix::new(lr))
}

/// bitsandbytes' `AdEMAMix8bit`: f32 parameters and gradients, both first moments 8-bit dynamic
/// signed and the second moment 8-bit dynamic unsigned, in blocks of 256.
pub fn ademamix_8bit(lr: f64) -> Preset<AdEMAMix> {
    ademamix_f32(lr)
        .with_state1(Storage::DYNAMIC8_SIGNED)
        .with_state2(Storage::DYNAMIC8_UNSIGNED)
        .with_state3(Storage::DYNAMIC8_SIGNED)
}

/// Schedule-free AdamW with the package's defaults, everything f32: the reference.
pub fn schedule_free_adamw_f32(lr: f64) -> Preset<ScheduleFreeAdamW> {
    Preset::f32(ScheduleFreeAdamW::new(lr))
}

/// Schedule-free AdamW with the second moment 8-bit dynamic (blocks of 256) and the base
/// sequence `z` in bf16 with stochastic rounding; f32 parameters and gradients.
pub fn schedule_free_adamw_8bit(lr: f64) -> Preset<ScheduleFreeAdamW> {
    schedule_free_adamw_f32(lr)
        .with_state1(Storage::Bf16(StoreRounding::Stochastic))
        .with_state2(Storage::DYNAMIC8_UNSIGNED)
}

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

/// f32 LAMB with `torch_optimizer.Lamb`'s defaults: the reference for the LAMB presets (12 bytes
/// per parameter).
pub fn lamb_f32(lr: f64) -> Preset<Lamb> {
    Preset::f32(Lamb::new(lr))
}

/// 8-bit LAMB on an f32 model, in the layout of bitsandbytes' `LAMB8bit` states (first moment
/// 8-bit dynamic signed, second unsigned, blocks of 256; bitsandbytes' LAMB is AdamW whose update
/// is scaled down, never up, to at most the parameter's norm: docs/OPTIMIZERS.md, "LAMB").
pub fn lamb_8bit(lr: f64) -> Preset<Lamb> {
    lamb_f32(lr)
        .with_state1(Storage::DYNAMIC8_SIGNED)
        .with_state2(Storage::DYNAMIC8_UNSIGNED)
}

#[cfg(test)]
mod tests {
    use super::*;

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
