//! burn integration for lpmm: lpmm's optimizers for burn modules.
//!
//! Any lpmm configuration — 8-bit and 4-bit AdamW, LPMM-SGDM, Lion, bf16 with stochastic
//! rounding or Kahan compensation, ... — comes in two forms.
//!
//! **burn's per-tensor `Optimizer`** ([`LpmmTensorOptimizer`]), the common case: what burn's
//! `ModuleOptimizer`, and so burn-train's `Learner`, takes unchanged. The swap is the optimizer
//! line:
//!
//! ```ignore
//! // burn:  let optim = AdamWConfig::new().init();
//! let optim = lpmm_burn::Lpmm8bitAdamWConfig::new().init()?;
//! // or any lpmm configuration:
//! let optim = LpmmOptimizerConfig::from(lpmm_optim::presets::adamw_4bit_split(0.0)).init()?;
//! // burn's groups mix them with each other and with burn's own optimizers:
//! let optim = AdamWConfig::new().init()
//!     .with_group(ParamGroup::from_predicate("linear"), Lpmm8bitAdamWConfig::new().build()?, None);
//!
//! let learner = Learner::new(model, optim, lr_scheduler);
//! SupervisedTraining::new(dir, train, valid).with_default_checkpointers().launch(learner);
//! ```
//!
//! burn's schedulers, per-group learning rates and gradient clipping reach each step; the states
//! (lpmm's codes, block scales, compensations and counters, [`LpmmState`]) stay in lpmm's storage
//! on the parameter's device, stepped in place, and go into burn's records under readable names,
//! so burn-train's checkpointer saves them and resumes bit for bit.
//!
//! **The whole-module optimizer** ([`LpmmOptimizer`], `init_whole_module()`), for a training loop
//! written by hand, does what a per-tensor optimizer cannot: global-norm clipping, the
//! all-or-nothing skip of a step with a non-finite gradient, layers whose weights live only in
//! lpmm's storage below 16 bits ([`LpmmLinear`]), and a report naming the parameters that
//! received no gradient ([`check_gradients`] gives that report to a per-tensor loop):
//!
//! ```ignore
//! let mut optim = lpmm_burn::Lpmm8bitAdamWConfig::new().with_max_grad_norm(Some(1.0)).init_whole_module();
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! model = optim.step(scheduler.step(), model, grads)?;
//! ```
//!
//! In both forms a parameter whose storage is a burn float dtype (f32; bf16 where the backend has
//! bf16 tensors) is the module's own tensor, stepped in place: one copy of each parameter. On
//! burn's wgpu device lpmm-wgpu runs on burn's own wgpu device and queue (create it with
//! [`wgpu::init`]) and steps burn's buffers where they are: no parameter, gradient or state
//! crosses to the host ([`LpmmTensorStats::host_reads`], [`LpmmStats::host_reads`]).
//!
//! Backends (features): `ndarray` and `flex` (burn's CPU backends, with lpmm's CPU backend;
//! default), `wgpu` (burn's wgpu device with lpmm-wgpu; see the `wgpu` module), `cuda` (burn's CUDA
//! device with lpmm-cuda), `cuda-nvrtc` (`cuda` with cubecl-cuda's CUDA C++ backend, compiled by
//! NVRTC at run time, instead of its LLVM backend: what a build without cubecl's LLVM bundle
//! runs). [docs/BURN.md] has the design and the measured memory and time.
//!
//! [docs/BURN.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/BURN.md

#[macro_use]
mod optimizer;
mod config;
mod core;
mod coverage;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
mod error;
mod lane;
mod linear;
mod persist;
mod tensor;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use config::{Lpmm8bitAdamWConfig, LpmmOptimizerConfig};
pub use coverage::check_gradients;
pub use error::BurnError;
pub use linear::{LpmmLinear, LpmmWeight};
pub use optimizer::{LpmmOptimizer, LpmmStats};
pub use persist::record::{FORMAT as RECORD_FORMAT, VERSION as RECORD_VERSION};
pub use persist::state::{FORMAT as STATE_FORMAT, VERSION as STATE_VERSION};
pub use tensor::state::LpmmState;
pub use tensor::{LpmmTensorOptimizer, LpmmTensorStats};

/// A warning users must see: to `tracing` where a subscriber records it, to stderr otherwise
/// (lpmm cannot know whether a user installed a subscriber).
pub(crate) fn warn(message: &str) {
    lpmm_optim::user_warning("lpmm-burn", message);
}
