//! The presets of the comparison: each with its learning rate for the tasks, its reference and
//! what the comparison checks of it.

use lpmm_candle::LpmmConfig;
use lpmm_optim::{Hybrid, Hyper, MapKind, ParamConfig, Route, Storage, StoreRounding, presets};
use lpmm_quant::BlockSize;
use serde::Serialize;

/// A preset as the comparison runs it.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    /// Its name in the report.
    pub name: &'static str,
    /// The lpmm configuration for a learning rate.
    pub config: fn(f64) -> ParamConfig,
    /// Whether it is an SGD preset (takes the SGD learning rate of the task).
    pub sgd: bool,
    /// The preset its memory and quality are compared with.
    pub reference: &'static str,
    /// Micro-batches per step (LPMM's microbatching: gradients accumulated in the low-precision
    /// accumulator, one step per batch).
    pub micro_batches: usize,
    /// Schedule-free: the learning rate stays at its peak (the rule warms up and averages
    /// itself) and the model is evaluated at the optimizer's evaluation point
    /// (`LpmmOptimizer::eval`).
    pub schedule_free: bool,
    /// What the comparison checks of it ([`crate::judge`]).
    pub goal: Goal,
    /// Muon for the hidden matrices (from Muon's peak learning rate and AdamW's) and `config`
    /// for the rest: the configuration is the hybrid ([`Preset::lpmm_config`]).
    pub hybrid: Option<fn(f64, f64) -> Hybrid>,
}

impl Preset {
    /// A preset judged for quality against `reference`: not SGD, one micro-batch per step, not
    /// schedule-free.
    const fn quality(
        name: &'static str,
        config: fn(f64) -> ParamConfig,
        reference: &'static str,
    ) -> Self {
        Preset {
            name,
            config,
            sgd: false,
            reference,
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::Quality,
            hybrid: None,
        }
    }

    /// A Muon hybrid judged for quality against `reference`: `hybrid(muon_lr, adamw_lr)`, the
    /// char model's embeddings (`tokens`, `positions`) routed to AdamW with the head.
    const fn muon(
        name: &'static str,
        hybrid: fn(f64, f64) -> Hybrid,
        reference: &'static str,
        goal: Goal,
    ) -> Self {
        Preset {
            name,
            // What the schedule's peak is read from: the AdamW part's rate.
            config: |lr| presets::adamw_f32(lr).build(),
            sgd: false,
            reference,
            micro_batches: 1,
            schedule_free: false,
            goal,
            hybrid: Some(hybrid),
        }
    }

    /// The optimizer's configuration at the peak rates `lr` (the task's) and `muon_lr` (the
    /// Muon hybrids' matrices).
    pub fn lpmm_config(&self, lr: f64, muon_lr: f64) -> LpmmConfig {
        match self.hybrid {
            Some(h) => LpmmConfig::from(
                h(muon_lr, lr)
                    .route("tokens.*", Route::Others)
                    .route("positions.*", Route::Others),
            ),
            None => LpmmConfig::from((self.config)(lr)),
        }
    }
}

/// What the comparison checks of a preset ([`crate::judge::judge`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Goal {
    /// An f32 reference: three seeds, checked for stability; it judges the presets that name it.
    Reference,
    /// Within the reference's tolerance (validation loss and accuracy; accuracy for a
    /// classifier).
    Quality,
    /// Within the reference's tolerance, and model memory at least `reduction` (a fraction)
    /// below the reference's.
    QualityAndMemory {
        /// The least memory saving, a fraction of the reference's bytes per parameter.
        reduction: f64,
    },
    /// None in the main table: the naive round-to-nearest baseline, which the low-learning-rate
    /// condition checks to be visibly worse than its reference.
    NaiveBaseline,
}

/// The presets of the comparison, references first.
pub fn presets() -> Vec<Preset> {
    vec![
        Preset {
            name: "f32 AdamW",
            config: |lr| presets::adamw_f32(lr).build(),
            sgd: false,
            reference: "f32 AdamW",
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::Reference,
            hybrid: None,
        },
        Preset {
            name: "f32 SGDM",
            config: |lr| presets::sgdm_f32(lr, 0.9).build(),
            sgd: true,
            reference: "f32 SGDM",
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::Reference,
            hybrid: None,
        },
        Preset::quality(
            "8-bit AdamW, bf16",
            |lr| presets::adamw_8bit_bf16(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdamW, bf16 SR",
            |lr| presets::adamw_8bit_bf16_sr(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "4-bit AdamW, split f32",
            |lr| presets::adamw_4bit_split(lr).build(),
            "f32 AdamW",
        ),
        Preset {
            name: "LPMM-SGDM",
            config: |lr| presets::lpmm_sgdm(lr, 0.9).build(),
            sgd: true,
            reference: "f32 SGDM",
            micro_batches: 4,
            schedule_free: false,
            goal: Goal::QualityAndMemory { reduction: 0.70 },
            hybrid: None,
        },
        Preset {
            name: "bf16 AdamW, round to nearest",
            config: |lr| presets::bf16_nearest(Hyper::adamw(lr)).build(),
            sgd: false,
            reference: "f32 AdamW",
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::NaiveBaseline,
            hybrid: None,
        },
        Preset::quality(
            "f32 Adafactor",
            |lr| {
                presets::adafactor_f32()
                    .beta1(0.9)
                    .lr(lr)
                    .scale_parameter(false)
                    .build()
            },
            "f32 AdamW",
        ),
        Preset {
            name: "Adafactor, LPMM",
            config: |lr| {
                presets::adafactor_lpmm()
                    .lr(lr)
                    .scale_parameter(false)
                    .build()
            },
            sgd: false,
            reference: "f32 Adafactor",
            micro_batches: 4,
            schedule_free: false,
            goal: Goal::Quality,
            hybrid: None,
        },
        Preset::quality(
            "f32 CAME",
            |lr| presets::came_f32(lr / 3.0).build(),
            "f32 AdamW",
        ),
        Preset {
            name: "CAME, LPMM",
            config: |lr| presets::came_lpmm(lr / 3.0).build(),
            sgd: false,
            reference: "f32 CAME",
            micro_batches: 4,
            schedule_free: false,
            goal: Goal::Quality,
            hybrid: None,
        },
        Preset {
            name: "f32 schedule-free AdamW",
            config: |lr| {
                presets::schedule_free_adamw_f32(lr)
                    .warmup_steps(50)
                    .build()
            },
            sgd: false,
            reference: "f32 AdamW",
            micro_batches: 1,
            schedule_free: true,
            goal: Goal::Quality,
            hybrid: None,
        },
        Preset {
            name: "8-bit schedule-free AdamW",
            config: |lr| {
                presets::schedule_free_adamw_8bit(lr)
                    .warmup_steps(50)
                    .build()
            },
            sgd: false,
            reference: "f32 schedule-free AdamW",
            micro_batches: 1,
            schedule_free: true,
            goal: Goal::Quality,
            hybrid: None,
        },
    ]
}

/// [`presets::muon_adamw_4bit_bf16_sr`] with its momentum's 4-bit map in blocks of `block`,
/// rounded by `rounding`.
fn four_bit_momentum(muon_lr: f64, lr: f64, block: BlockSize, rounding: StoreRounding) -> Hybrid {
    let mut h = presets::muon_adamw_4bit_bf16_sr(muon_lr, lr);
    h.matrices.state1 = Storage::Quantized {
        map: MapKind::DynamicExponentSigned4,
        block,
        rounding,
    };
    h
}

/// AdaLomo's learning rate over the task's AdamW rate: 0.1 at the char model's 6e-3 (its step is
/// `lr * RMS(p)`). Swept with `char_lm -- --preset "f32 AdaLomo" --lr X` (X the rate itself,
/// before this ratio was set), seed 0: 0.03 2.1118, 0.06 1.8492, 0.1 1.8184, 0.15 1.9320, 0.3
/// 2.4153, 1.0 4.3307.
const ADALOMO_LR_RATIO: f64 = 50.0 / 3.0;

/// Presets outside the comparison's default run, for [`run_char_lm`](super::run_char_lm)
/// (`examples/char_lm.rs --preset NAME`): bitsandbytes' `AdamW8bit`, `Lion8bit` and
/// `AdEMAMix8bit` equivalents on f32 parameters, the 4-bit AdamW twin, the f32 Lion and
/// AdEMAMix references, RMSprop, Adagrad and LAMB in f32 and with 8-bit states, and Adafactor
/// with transformers' defaults (a step size relative to the step count and the parameters' RMS,
/// which ignores the schedule), AdaLomo, and the Muon hybrids with their 4-bit diagnostics
/// (docs/RESULTS.md). Lion steps at a tenth of the AdamW learning rate (its authors advise 3 to
/// 10 times smaller).
pub fn more_presets() -> Vec<Preset> {
    vec![
        Preset {
            name: "f32 Adafactor, relative step",
            config: |_| presets::adafactor_f32().build(),
            sgd: false,
            reference: "f32 AdamW",
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::Reference,
            hybrid: None,
        },
        Preset::quality(
            "f32 AdEMAMix",
            |lr| presets::ademamix_f32(lr).build(),
            "f32 AdamW",
        ),
        // AdaLomo (no first moment, the factored second moment, the step `lr * RMS(p)`) at
        // ADALOMO_LR_RATIO times the AdamW rate.
        Preset::quality(
            "f32 AdaLomo",
            |lr| presets::adalomo_f32(lr * ADALOMO_LR_RATIO).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "AdaLomo, bf16 SR",
            |lr| presets::adalomo_bf16_sr(lr * ADALOMO_LR_RATIO).build(),
            "f32 AdaLomo",
        ),
        Preset::quality(
            "8-bit AdEMAMix, f32",
            |lr| presets::ademamix_8bit(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdamW, f32",
            |lr| presets::adamw_8bit(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "4-bit AdamW, f32",
            |lr| presets::adamw_4bit(lr).build(),
            "f32 AdamW",
        ),
        // The parameter storages beside 8-bit states, for the low-learning-rate condition
        // (`char_lm -- --preset NAME --lr 6e-4`): bf16 to nearest and stochastically are the
        // main table's; Kahan-compensated bf16 and 24-bit master weights (bf16+8) here.
        Preset::quality(
            "8-bit AdamW, bf16 Kahan",
            |lr| {
                presets::adamw_8bit_bf16(lr)
                    .with_param(lpmm_optim::Storage::Bf16Kahan)
                    .build()
            },
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdamW, bf16+8",
            |lr| presets::adamw_8bit_bf16_plus8(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdamW, bf16+8 SR",
            |lr| {
                presets::adamw_8bit_bf16_plus8(lr)
                    .with_param(lpmm_optim::Storage::Bf16Plus8(
                        lpmm_optim::StoreRounding::Stochastic,
                    ))
                    .build()
            },
            "f32 AdamW",
        ),
        Preset::quality(
            "f32 Lion",
            |lr| presets::lion_f32(lr / 10.0).build(),
            "f32 Lion",
        ),
        Preset::quality(
            "8-bit Lion, f32",
            |lr| presets::lion_8bit(lr / 10.0).build(),
            "f32 Lion",
        ),
        // RMSprop at half the AdamW rate (3e-3) and Adagrad at five times it (3e-2), the best
        // of a sweep (`char_lm -- --preset "f32 RMSprop" --lr X`, seed 0): RMSprop 1e-3 1.9788,
        // 2e-3 1.9621, 3e-3 1.8717, 4e-3 1.9266, 6e-3 2.2224, 1e-2 2.4527; Adagrad 1e-2 2.1401,
        // 2e-2 2.1015, 3e-2 1.9485, 5e-2 1.9929, 1e-1 2.4559.
        Preset::quality(
            "f32 RMSprop",
            |lr| presets::rmsprop_f32(lr / 2.0).build(),
            "f32 RMSprop",
        ),
        Preset::quality(
            "8-bit RMSprop, f32",
            |lr| presets::rmsprop_8bit(lr / 2.0).build(),
            "f32 RMSprop",
        ),
        Preset::quality(
            "f32 Adagrad",
            |lr| presets::adagrad_f32(lr * 5.0).build(),
            "f32 Adagrad",
        ),
        Preset::quality(
            "8-bit Adagrad, f32",
            |lr| presets::adagrad_8bit(lr * 5.0).build(),
            "f32 Adagrad",
        ),
        // LAMB at 10/3 of the AdamW rate (0.02): its trust ratio makes each tensor's step `lr`
        // times its norm. Swept with `char_lm -- --preset "f32 LAMB" --lr X`, seed 0: 0.01 1.9078,
        // 0.015 1.7890, 0.02 1.7646, 0.03 1.8215, 0.05 1.8688, 0.1 1.9517.
        Preset::quality(
            "f32 LAMB",
            |lr| presets::lamb_f32(lr * 10.0 / 3.0).build(),
            "f32 LAMB",
        ),
        Preset::quality(
            "8-bit LAMB, f32",
            |lr| presets::lamb_8bit(lr * 10.0 / 3.0).build(),
            "f32 LAMB",
        ),
        // Muon for the hidden matrices (`LmRecipe::muon_lr`), AdamW for the embeddings, the
        // head and the norms at the task's rate, the same storages in both (docs/RESULTS.md,
        // "Muon").
        Preset::muon(
            "f32 Muon",
            presets::muon_adamw_f32,
            "f32 Muon",
            Goal::Reference,
        ),
        Preset::muon(
            "8-bit Muon, bf16 SR",
            presets::muon_adamw_8bit_bf16_sr,
            "f32 Muon",
            Goal::Quality,
        ),
        Preset::muon(
            "4-bit Muon, bf16 SR",
            presets::muon_adamw_4bit_bf16_sr,
            "f32 Muon",
            Goal::Quality,
        ),
        Preset::muon(
            "8-bit Muon, f32",
            |muon_lr, lr| Hybrid::new(presets::muon_8bit(muon_lr), presets::adamw_8bit(lr)),
            "f32 Muon",
            Goal::Quality,
        ),
        // Diagnostics of the 4-bit miss (docs/RESULTS.md, "Muon"): the momentum's map in blocks
        // of 64, or rounded stochastically, and 4-bit momentum with f32 parameters.
        Preset::muon(
            "4-bit Muon B64, bf16 SR",
            |muon_lr, lr| four_bit_momentum(muon_lr, lr, BlockSize::B64, StoreRounding::Nearest),
            "f32 Muon",
            Goal::Quality,
        ),
        Preset::muon(
            "4-bit Muon SR, bf16 SR",
            |muon_lr, lr| {
                four_bit_momentum(muon_lr, lr, BlockSize::B128, StoreRounding::Stochastic)
            },
            "f32 Muon",
            Goal::Quality,
        ),
        Preset::muon(
            "4-bit Muon, f32",
            |muon_lr, lr| Hybrid::new(presets::muon_4bit(muon_lr), presets::adamw_8bit(lr)),
            "f32 Muon",
            Goal::Quality,
        ),
    ]
}
