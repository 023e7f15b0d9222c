//! burn integration for lpmm: lpmm's optimizers for burn modules.
//!
//! [`LpmmOptimizer`] is a burn optimizer for any lpmm configuration — 8-bit and 4-bit AdamW,
//! LPMM-SGDM, Lion, bf16 with stochastic rounding or Kahan compensation, ... — used as burn's own
//! `ModuleOptimizer` is:
//!
//! ```ignore
//! // burn:  let mut optim = AdamWConfig::new().init();
//! let mut optim = lpmm_burn::Lpmm8bitAdamWConfig::new().init();
//! // or any lpmm configuration:
//! let mut optim = LpmmOptimizerConfig::from(lpmm_optim::presets::adamw_4bit_split(0.0)).init();
//!
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! model = optim.step(scheduler.step(), model, grads)?;
//! ```
//!
//! - The step takes the whole module's `GradientsParams`, so global-norm clipping and the
//!   all-or-nothing skip of a step with a non-finite gradient mean what they mean in lpmm (burn's
//!   per-tensor optimizers cannot express either).
//! - A parameter whose storage is a burn float dtype (f32; bf16 where the backend has bf16
//!   tensors) is the module's own tensor, stepped in place: one copy of each parameter. On burn's
//!   wgpu device lpmm-wgpu runs on burn's own wgpu device and queue and steps burn's buffers
//!   where they are (no host round trip per step: [`LpmmStats::host_reads`]).
//! - Parameters stored below 16 bits live in lpmm and are materialised one layer at a time by
//!   [`LpmmLinear`].
//! - Every step checks that each parameter that requires a gradient received one, and reports
//!   those that did not (`StepReport::missing_gradients`); by default a warning names them (on
//!   stderr where no `tracing` subscriber records lpmm's warnings), and
//!   [`LpmmOptimizerConfig::with_missing_gradient`] makes it an error or silences it. Freeze
//!   parameters on purpose with burn's `Param::set_require_grad(false)`.
//! - State is keyed by burn's `ParamId`s; [`LpmmOptimizer::to_record`] /
//!   [`LpmmOptimizer::load_record`] put lpmm's canonical slots in a burn record (burnpack), and
//!   lpmm's own safetensors checkpoint works too ([`LpmmOptimizer::save_lpmm`]).
//!
//! Backends (features): `ndarray` and `flex` (burn's CPU backends, with lpmm's CPU backend;
//! default), `wgpu` (burn's wgpu device with lpmm-wgpu; see the `wgpu` module), `cuda` (burn's CUDA
//! device with lpmm-cuda). [docs/BURN.md] has the design and the measured memory.
//!
//! [docs/BURN.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/BURN.md

#[macro_use]
mod optimizer;
mod config;
mod core;
mod error;
mod lane;
mod linear;
mod record;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use config::{Lpmm8bitAdamWConfig, LpmmOptimizerConfig};
pub use error::BurnError;
pub use linear::{LpmmLinear, LpmmWeight};
pub use optimizer::{LpmmOptimizer, LpmmStats};
pub use record::{FORMAT as RECORD_FORMAT, VERSION as RECORD_VERSION};
