//! Numeric formats for keeping a model's whole memory in low precision.
//!
//! - [`float`]: f32 to bf16 and f16 with round-to-nearest-even and stochastic rounding.
//! - [`Fp8`]: E4M3FN and E5M2, encode (nearest or stochastic, saturating or not) and decode.
//! - [`CodeMap`]: sorted code tables (bitsandbytes' dynamic maps bit for bit, the 4-bit
//!   dynamic-exponent map, NF4, linear maps with and without zero) and their exact nearest and
//!   stochastic rounding.
//! - [`packing`]: 1- to 8-bit codes in bytes.
//! - [`SplitF32`] and [`kahan_add`]: bf16 master weights that do not lose small updates.
//! - [`simd`]: slice kernels with an AVX-512 path picked at run time, bit-identical to the
//!   portable one.
//!
//! This crate knows nothing of tensors, blocks or optimizers; every bit-level rule it implements
//! is written down in `docs/FORMATS.md` so that GPU kernels can reproduce it.

mod codemap;
mod error;
pub mod float;
mod fp8;
pub mod packing;
pub mod simd;
mod split;

pub use codemap::CodeMap;
pub use error::FormatError;
pub use float::Rounding;
pub use fp8::{Fp8, Overflow};
pub use half::{bf16, f16};
pub use split::{SplitF32, kahan_add};
