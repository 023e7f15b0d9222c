//! The optimizer core of lpmm: optimizers (one update rule per variant of [`Hyper`]; the list
//! with each rule's presets is docs/REGISTRIES.md, generated from the registry) whose parameters,
//! gradient accumulators and states can each be stored in low precision, stepped in one fused pass
//! per chunk. The CPU implementation here is the reference every backend must reproduce.
//!
//! [docs/OPTIMIZERS.md] documents every storage, update rule, policy and the evidence behind them.
//! Users need [`Optimizer`], a configuration ([`presets`], [`ParamConfig`]) and a backend ([`Cpu`]
//! here; lpmm-wgpu and lpmm-cuda for GPUs). Backend implementors work against [`backend`].
//!
//! ```
//! use lpmm_optim::{Accumulated, Optimizer, OptimizerOptions, SlotKind, presets};
//!
//! // AdamW with bf16 parameters and 8-bit block-wise states, on the CPU reference backend.
//! let mut opt = Optimizer::new(OptimizerOptions::default())?;
//! let group = opt.add_group(presets::adamw_8bit_bf16(1e-3))?;
//! let n = 64 * 128;
//! let w = opt.add_param("w", &[64, 128], &vec![0.5; n], group)?;
//! for _ in 0..10 {
//!     opt.accumulate(w, &vec![1e-2; n])?; // one micro-batch's gradient (more may follow)
//!     opt.step(Accumulated)?;
//! }
//! let mut values = vec![0f32; n];
//! opt.read(w, SlotKind::Param, &mut values)?;
//! assert!(values.iter().all(|&v| v < 0.5)); // a positive gradient moves the weights down
//! // Parameters, gradient accumulator and states: bytes per element (f32 AdamW holds 16).
//! let bytes = opt.memory_report().bytes_per_param();
//! assert!(bytes < 16.0, "{bytes}");
//! println!("{bytes} bytes per parameter");
//! # Ok::<(), lpmm_optim::OptimError>(())
//! ```
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

pub mod backend;
pub mod checkpoint;
mod config;
mod coverage;
mod cpu;
mod error;
mod exact;
mod exec;
mod fixed;
mod format;
#[cfg(feature = "testing")]
pub mod fuzzing;
mod lent;
mod memory;
mod optimizer;
mod plan;
pub mod presets;
mod routing;
mod rule;
#[cfg(feature = "testing")]
pub mod testing;
mod vocab;

pub use backend::{HostSlot, ParamId, SlotKind};
pub use checkpoint::{
    Checkpoint, FORMAT as CHECKPOINT_FORMAT, LoadPolicy, VERSION as CHECKPOINT_VERSION,
};
pub use config::ParamConfig;
pub use coverage::{
    CoverageCheck, MISSING_NAMES, MissingGradientHelp, MissingGradientPolicy, MissingGradients,
    user_warning,
};
pub use cpu::Cpu;
pub use error::OptimError;
pub use format::{MapKind, Storage, StoreRounding};
pub use memory::{MemoryReport, ParamMemory};
pub use optimizer::{
    Accumulated, Grad, GradientSummary, Gradients, Lender, Lent, LrRule, MAX_COUNTER, Mode,
    NonFinitePolicy, Optimizer, OptimizerOptions, Out, ParamInfo, ParamKey, Parts, PartsMut,
    Settings, Status, Step, StepReport, WithGradient,
};
pub use routing::{DEFAULT_OTHERS, Hybrid, Route, name_matches};
pub use rule::configs::*;
pub use rule::{AdjustLr, Hyper, RuleState};
