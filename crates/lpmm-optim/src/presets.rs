//! Named configurations a user picks in one line. Each is a [`ParamConfig`]; change any field to
//! override it.

use crate::config::{ParamConfig, Storage, StoreRounding};
use crate::rule::Hyper;

/// f32 SGD with momentum: the reference for the SGDM presets (12 bytes per parameter).
pub fn sgdm_f32(lr: f64, momentum: f64) -> ParamConfig {
    ParamConfig::f32(Hyper::sgd(lr, momentum))
}

/// LPMM-SGDM: parameters, gradient accumulator and momentum all 8-bit linear in groups of 64 with
/// stochastic rounding (about 3.19 bytes per parameter), for every tensor however small (LPMM
/// keeps the whole model memory in 8 bits; there is no minimum size).
pub fn lpmm_sgdm(lr: f64, momentum: f64) -> ParamConfig {
    ParamConfig {
        param: Storage::LINEAR8_GROUP64_SR,
        grad: Storage::LINEAR8_GROUP64_SR,
        state1: Storage::LINEAR8_GROUP64_SR,
        min_quantized_size: 0,
        ..ParamConfig::f32(Hyper::sgd(lr, momentum))
    }
}

/// f32 AdamW: the reference for the AdamW presets (16 bytes per parameter).
pub fn adamw_f32(lr: f64) -> ParamConfig {
    ParamConfig::f32(Hyper::adamw(lr))
}

/// bitsandbytes' `AdamW8bit` on an f32 model: f32 parameters and gradients, 8-bit dynamic states
/// in blocks of 256 (a one-line swap for f32 AdamW; with gradients stepped where the framework
/// holds them, no accumulator is ever allocated).
pub fn adamw_8bit(lr: f64) -> ParamConfig {
    ParamConfig {
        state1: Storage::DYNAMIC8_SIGNED,
        state2: Storage::DYNAMIC8_UNSIGNED,
        ..ParamConfig::f32(Hyper::adamw(lr))
    }
}

/// bitsandbytes-like: bf16 parameters and gradients (round to nearest), 8-bit dynamic states in
/// blocks of 256.
pub fn adamw_8bit_bf16(lr: f64) -> ParamConfig {
    ParamConfig {
        param: Storage::Bf16(StoreRounding::Nearest),
        grad: Storage::Bf16(StoreRounding::Nearest),
        state1: Storage::DYNAMIC8_SIGNED,
        state2: Storage::DYNAMIC8_UNSIGNED,
        ..ParamConfig::f32(Hyper::adamw(lr))
    }
}

/// As [`adamw_8bit_bf16`] with stochastic rounding of the bf16 parameters and gradients.
pub fn adamw_8bit_bf16_sr(lr: f64) -> ParamConfig {
    ParamConfig {
        param: Storage::Bf16(StoreRounding::Stochastic),
        grad: Storage::Bf16(StoreRounding::Stochastic),
        ..adamw_8bit_bf16(lr)
    }
}

/// 4-bit AdamW (lpmm's maps, blocks of 128) with split-f32 parameters (exactly f32, bf16-readable)
/// and bf16 gradients.
pub fn adamw_4bit_split(lr: f64) -> ParamConfig {
    ParamConfig {
        param: Storage::SplitF32,
        grad: Storage::Bf16(StoreRounding::Nearest),
        state1: Storage::FOUR_BIT_SIGNED,
        state2: Storage::FOUR_BIT_UNSIGNED,
        ..ParamConfig::f32(Hyper::adamw(lr))
    }
}

/// Everything bf16 with round-to-nearest: the naive low-precision setup whose small updates
/// underflow.
pub fn bf16_nearest(hyper: Hyper) -> ParamConfig {
    let bf = Storage::Bf16(StoreRounding::Nearest);
    ParamConfig {
        param: bf,
        grad: bf,
        state1: bf,
        state2: bf,
        ..ParamConfig::f32(hyper)
    }
}

/// The smallest AdamW: bf16 parameters with stochastic rounding, 4-bit states, and no gradient
/// memory at all: gradients are released in the backward pass (`step_param`) or folded into the
/// states (`accumulate_states`).
pub fn adamw_4bit_bf16_sr_released(lr: f64) -> ParamConfig {
    ParamConfig {
        param: Storage::Bf16(StoreRounding::Stochastic),
        grad: Storage::None,
        state1: Storage::FOUR_BIT_SIGNED,
        state2: Storage::FOUR_BIT_UNSIGNED,
        ..ParamConfig::f32(Hyper::adamw(lr))
    }
}
