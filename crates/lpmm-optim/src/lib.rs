//! The optimizer core of lpmm: optimizers (SGD with momentum, Adam/AdamW, Lion) whose parameters,
//! gradient accumulators and states can each be stored in low precision, stepped in one fused
//! pass per chunk. The CPU implementation here is the reference every backend must reproduce.
//!
//! `docs/OPTIMIZERS.md` documents every storage, update rule, policy and the evidence behind them.
//! Users need [`Optimizer`], a configuration ([`presets`], [`ParamConfig`]) and a backend ([`Cpu`]
//! here; lpmm-wgpu and lpmm-cuda for GPUs). Backend implementors work against [`backend`].

pub mod backend;
mod checkpoint;
mod config;
mod cpu;
mod error;
mod exact;
mod format;
#[cfg(feature = "testing")]
pub mod fuzzing;
mod memory;
mod optimizer;
pub mod presets;
mod rule;
#[cfg(feature = "testing")]
pub mod testing;

pub use backend::{Backend, BackendError, HostSlot, ParamId, SlotKind};
pub use checkpoint::{
    Canonical, CanonicalParam, FORMAT as CHECKPOINT_FORMAT, LoadPolicy,
    VERSION as CHECKPOINT_VERSION,
};
pub use config::{MapKind, ParamConfig, Storage, StoreRounding};
pub use cpu::Cpu;
pub use error::OptimError;
pub use exact::{EXACT_WORDS, ExactSum, NORM_RUN, add_squares};
pub use memory::{MemoryReport, ParamMemory};
pub use optimizer::{
    GradientSummary, Gradients, Lender, LrRule, MAX_COUNTER, NonFinitePolicy, Optimizer,
    OptimizerOptions, StepInProgress, StepReport, WithGradient,
};
pub use rule::{Adam, Hyper, Lion, Sgd};
