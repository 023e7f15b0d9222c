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
//! This crate knows nothing of optimizers. Every rule is specified in `docs/FORMATS.md`.

mod blockwise;
mod error;
mod group;
mod random;
mod rank1;

pub use blockwise::{BlockSize, Blockwise, MAX_BLOCK, QuantRounding};
pub use error::QuantError;
pub use group::LinearGroup;
pub use random::{RandomBits, RandomStream};
pub use rank1::{MAX_DIMS as RANK1_MAX_DIMS, Rank1, Rank1OrBlock};
