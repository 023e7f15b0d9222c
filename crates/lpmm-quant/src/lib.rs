//! Quantization of tensors onto the code maps of `lpmm-formats`.
//!
//! - [`Blockwise`]: block-wise absmax quantization (blocks of 32..=4096), nearest or stochastic
//!   rounding, optional first-moment sign fix, packed 1- to 8-bit codes.
//! - [`LinearGroup`]: linear signed group quantization, the LPMM parameter format.
//! - [`Rank1`]: rank-1 normalization of matrices and N-d tensors ([`Rank1OrBlock`] falls back to
//!   blocks for vectors).
//! - [`RandomStream`]: counter-based random bits, a pure function of (seed, tensor, step,
//!   element), so stochastic rounding gives the same bits for any thread count or chunking.
//!
//! This crate knows nothing of optimizers. Every rule is specified in [docs/FORMATS.md].
//!
//! ```
//! use lpmm_formats::CodeMap;
//! use lpmm_quant::{BlockSize, Blockwise, QuantRounding, RandomStream};
//!
//! let map = CodeMap::dynamic(true, 8)?; // bitsandbytes' signed 8-bit map
//! let q = Blockwise::new(&map, BlockSize::B256);
//! let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.01).sin()).collect();
//! let mut codes = vec![0u8; q.codes_len(x.len())];
//! let mut absmax = vec![0f32; q.scales_len(x.len())];
//! // Stochastic rounding with random bits that depend only on (seed, tensor, step, element).
//! let sr = QuantRounding::Stochastic { stream: RandomStream::new(42, 0, 0), offset: 0 };
//! q.quantize(&x, &mut codes, &mut absmax, sr)?;
//! let mut back = vec![0f32; x.len()];
//! q.dequantize(&codes, &absmax, &mut back)?;
//! assert_eq!((codes.len(), absmax.len()), (1000, 4)); // one byte per element, one scale per block
//! assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() < 0.05));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

mod blockwise;
mod error;
mod group;
mod random;
mod rank1;

pub use blockwise::{BlockSize, Blockwise, MAX_BLOCK, QuantRounding};
pub use error::QuantError;
pub use group::LinearGroup;
pub use random::{RandomBits, RandomDraws, RandomStream};
pub use rank1::{MAX_DIMS as RANK1_MAX_DIMS, Rank1, Rank1OrBlock};

use lpmm_formats::CodeMap;

/// [`QuantError::Negative`] for the first finite value below zero when `map` has no negative
/// values (`-inf` is left to the quantizer's [`QuantError::NonFinite`]). It runs only for such
/// maps, as one maximum of the bit patterns ([`lpmm_formats::simd::max_bits`], compiled for the
/// CPU's vector level: a plain fold here is not, and cost 7% of an 8-bit AdamW step), and looks
/// for the element only when that finds one.
fn check_sign(map: &CodeMap, x: &[f32]) -> Result<(), QuantError> {
    if map.values().first().is_none_or(|&v| v < 0.0) {
        return Ok(());
    }
    let high = lpmm_formats::simd::max_bits(x);
    if high <= (-0.0f32).to_bits() {
        return Ok(());
    }
    match x.iter().position(|&v| v < 0.0 && v > f32::NEG_INFINITY) {
        Some(index) => Err(QuantError::Negative {
            index,
            value: x[index],
        }),
        None => Ok(()),
    }
}
