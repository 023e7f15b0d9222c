//! lpmm for PyTorch: the Rust side of the Python package `lpmm` (`pip install crates/lpmm-python`;
//! docs/PYTHON.md). Its optimizers (`lpmm.torch.AdamW8bit`, `AdamW4bit`, `LPMMSGDM`, ... and
//! `lpmm.torch.LpmmOptimizer` for any preset) are `torch.optim.Optimizer` subclasses in Python over
//! the engine here: an lpmm-optim [`lpmm_optim::Optimizer`] on the CPU backend whose parameters
//! are torch's own tensors, stepped in place.
//!
//! - [`config`]: presets by name, hyperparameters as torch's param-group keys, the parameter's
//!   storage from the tensor's dtype.
//! - [`engine`]: registration, the step over host buffers (lent parameters and given gradients:
//!   no copy), gradient release, schedule-free evaluation mode.
//! - [`state`]: the state as torch state-dict entries (raw bytes, which torch's dtype cast of
//!   state leaves alone) and back; the only module that calls lpmm-optim's checkpoint and slot
//!   functions.
//! - `py` (feature `python`, what maturin builds): the extension module `lpmm._lpmm`, which lends
//!   torch's CPU tensors to the engine after checking each one (dtype, device, layout, extent,
//!   aliasing), and raises the package's typed exceptions.

pub mod config;
pub mod engine;
#[cfg(feature = "python")]
mod py;
pub mod state;

pub use engine::{Engine, GroupEntry, ParamEntry, Report};

/// What the engine refuses, by kind (the Python module raises one exception class per kind).
#[derive(Debug)]
pub enum EngineError {
    /// A configuration: preset, hyperparameter or storage name.
    Config(String),
    /// A state dict that does not load.
    State(String),
    /// lpmm-optim's own error (it names the parameter where one is at fault).
    Optim(lpmm_optim::OptimError),
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineError::Config(m) | EngineError::State(m) => f.write_str(m),
            EngineError::Optim(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for EngineError {}

impl From<lpmm_optim::OptimError> for EngineError {
    fn from(e: lpmm_optim::OptimError) -> Self {
        EngineError::Optim(e)
    }
}
