//! The optimizer core of lpmm: optimizers (SGD with momentum, Adam/AdamW, Lion) whose parameters,
//! gradient accumulators and states can each be stored in low precision, stepped in one fused
//! pass per chunk. The CPU implementation here is the reference every backend must reproduce.
//!
//! `docs/OPTIMIZERS.md` documents every storage, update rule, policy and the evidence behind them;
//! [`Backend`] is the seam GPU backends implement.

pub mod backend;
mod checkpoint;
mod config;
mod cpu;
pub mod device;
mod error;
mod exact;
mod memory;
mod optimizer;
pub mod presets;
mod rule;
mod slot;
#[cfg(feature = "testing")]
pub mod testing;

pub use backend::{Backend, HostSlot, LrRule, ParamMeta, SlotKind};
pub use checkpoint::{
    Canonical, CanonicalParam, FORMAT as CHECKPOINT_FORMAT, VERSION as CHECKPOINT_VERSION,
};
pub use config::{Hyper, MapKind, ParamConfig, Storage, StoreRounding};
pub use cpu::Cpu;
pub use error::OptimError;
pub use exact::{EXACT_WORDS, ExactSum};
pub use memory::{MemoryReport, ParamMemory};
pub use optimizer::{
    GradientSummary, NonFinitePolicy, Optimizer, OptimizerOptions, ParamId, StepReport,
};
pub use rule::{Rule, Updated};
