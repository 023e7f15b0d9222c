//! lpmm: train neural networks with the whole model memory in low precision.
//!
//! This facade re-exports the layers a user needs: [`formats`] (bf16/f16/fp8, code maps,
//! packing, split f32), [`quant`] (block-wise and rank-1 quantization, counter-based random
//! bits) and [`optim`] (the optimizer core and its CPU reference).
//!
//! ```
//! use lpmm::optim::{Accumulated, Optimizer, OptimizerOptions, SlotKind, presets};
//!
//! // 8-bit AdamW states over bf16 parameters (bitsandbytes' AdamW8bit with bf16 weights).
//! let mut opt = Optimizer::new(OptimizerOptions::default())?;
//! let group = opt.add_group(presets::adamw_8bit_bf16(1e-3))?;
//! let w = opt.add_param("layer.weight", &[256, 256], &vec![0.02; 256 * 256], group)?;
//! opt.accumulate(w, &vec![1e-3; 256 * 256])?;
//! let report = opt.step(Accumulated)?;
//! assert!(!report.skipped);
//! let mut weight = vec![0f32; 256 * 256];
//! opt.read(w, SlotKind::Param, &mut weight)?;
//! assert!(weight[0] < 0.02);
//! # Ok::<(), lpmm::optim::OptimError>(())
//! ```
//!
//! Optional features, each a module re-exporting a crate:
//!
//! - `candle`: `lpmm::candle` (lpmm-candle), a `candle_nn::Optimizer` for any lpmm configuration.
//! - `candle-cuda`: the same on candle's CUDA device, stepping the `Var`s in place with lpmm-cuda
//!   (building it needs nvcc, as candle's CUDA kernels do).
//! - `wgpu`: `lpmm::wgpu` (lpmm-wgpu), the backend that runs the optimizer step as compute
//!   shaders (`Optimizer::with_backend(lpmm::wgpu::Wgpu::new(..)?, ..)`).
//! - `cuda`: `lpmm::cuda` (lpmm-cuda), the CUDA backend
//!   (`Optimizer::with_backend(lpmm::cuda::Cuda::new(0)?, ..)`); builds without a CUDA toolkit.
//! - `burn`: `lpmm::burn` (lpmm-burn), lpmm's optimizers for burn modules
//!   (`lpmm::burn::Lpmm8bitAdamWConfig::new().init()` where burn has `AdamWConfig::new().init()`).
//!
//! The crate builds with Rust 1.89; feature `candle` needs 1.94 (candle-core 0.11) and feature
//! `burn` 1.95 (burn 0.22).

#[cfg(feature = "burn")]
pub use lpmm_burn as burn;
#[cfg(feature = "candle")]
pub use lpmm_candle as candle;
#[cfg(feature = "cuda")]
pub use lpmm_cuda as cuda;
pub use lpmm_formats as formats;
pub use lpmm_optim as optim;
pub use lpmm_quant as quant;
#[cfg(feature = "wgpu")]
pub use lpmm_wgpu as wgpu;

/// The README's code examples, compiled and run as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
