//! lpmm: train neural networks with the whole model memory in low precision.
//!
//! This facade re-exports the layers a user needs: [`formats`] (bf16/f16/fp8, code maps,
//! packing, split f32), [`quant`] (block-wise and rank-1 quantization, counter-based random
//! bits) and [`optim`] (the optimizer core and its CPU reference). Feature `candle`: `candle`, a
//! `candle_nn::Optimizer` for any lpmm configuration (feature `candle-cuda`: also on candle's CUDA
//! device, stepping the `Var`s in place with lpmm-cuda; building it needs nvcc). Feature `wgpu`: `wgpu`, the backend that
//! runs the optimizer step as compute shaders (`Optimizer::with_backend(lpmm::wgpu::Wgpu::new(..)?, ..)`).
//! Feature `cuda`: `cuda`, the CUDA backend (`Optimizer::with_backend(lpmm::cuda::Cuda::new(0)?, ..)`).
//! Feature `burn`: `burn`, lpmm's optimizers for burn modules
//! (`lpmm::burn::Lpmm8bitAdamWConfig::new().init()` where burn has `AdamWConfig::new().init()`).

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
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
