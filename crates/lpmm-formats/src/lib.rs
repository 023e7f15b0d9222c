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
//! is written down in [docs/FORMATS.md] so that GPU kernels can reproduce it.
//!
//! ```
//! use lpmm_formats::{CodeMap, Fp8, Overflow, Rounding, float};
//!
//! // An update below half a bf16 ulp (2^-7 at 1.0) is lost to round-to-nearest...
//! let w = 1.0f32 + 2f32.powi(-10);
//! assert_eq!(float::bf16_nearest(w).to_f32(), 1.0);
//! // ...and kept on average by stochastic rounding: up with probability 2^-10 / 2^-7 = 1/8.
//! let ups = (0..1024u32)
//!     .filter(|&i| float::bf16_stochastic(w, i << 22).to_f32() > 1.0)
//!     .count();
//! assert_eq!(ups, 128);
//!
//! // FP8 E4M3FN saturates at 448; bitsandbytes' signed dynamic 8-bit map holds 256 codes.
//! let code = Fp8::E4M3Fn.encode(1000.0, Rounding::NearestEven, Overflow::Saturate);
//! assert_eq!(Fp8::E4M3Fn.decode(code), 448.0);
//! let map = CodeMap::dynamic(true, 8)?;
//! assert_eq!(map.values().len(), 256);
//! let c = map.encode(0.5, Rounding::NearestEven);
//! assert!((map.value(c) - 0.5).abs() < 0.01);
//! # Ok::<(), lpmm_formats::FormatError>(())
//! ```
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

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
pub use split::{SplitF32, join_f32_slice, kahan_add, split_f32_slice};
