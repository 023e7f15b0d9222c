//! Activation memory: what the forward pass saves for the backward pass, made small.
//!
//! - [`fewbit`]: few-bit activations (GELU, SiLU, tanh, sigmoid; ReLU exactly with 1 bit): the
//!   forward saves a `b`-bit code of the input, the backward multiplies by the optimal
//!   piecewise-constant derivative ([`Table::solve`], lpmm's dynamic program).
//! - [`tempo`]: LayerNorm and GELU backward from their outputs (plus one rstd per row, plus one
//!   bit per element for GELU's branch), softmax·dropout from the softmax output and a 1-bit mask.
//! - [`compress`]: 2/4/8-bit block compression of any saved tensor with stochastic rounding.
//!
//! [docs/ACTIVATIONS.md] has the derivative-error table, the gradient checks and the memory
//! measurements.
//!
//! [docs/ACTIVATIONS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/ACTIVATIONS.md

pub mod compress;
pub mod fewbit;
pub mod tempo;

pub use compress::Compressed;
pub use fewbit::{Activation, Grid, Table, Weight};
pub use tempo::{
    BitMask, LayerNormGrads, LayerNormSaved, gelu_backward_from_output, gelu_forward, gelu_invert,
    layernorm_backward_from_output, layernorm_forward, softmax_dropout_backward,
    softmax_dropout_forward,
};

/// Why an activation operation refused its input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ActError {
    /// A bit width this operation does not offer.
    #[error("{0} bits is not offered here")]
    Bits(u32),
    /// A grid or format the solver cannot use.
    #[error("{0}")]
    Grid(String),
    /// A length that does not match.
    #[error("{what}: expected {expected} elements, got {actual}")]
    Length {
        /// What.
        what: &'static str,
        /// Expected.
        expected: usize,
        /// Given.
        actual: usize,
    },
    /// A probability outside [0, 1).
    #[error("dropout probability {0} is not in [0, 1)")]
    Probability(f32),
    /// A non-finite value where only finite ones can be stored.
    #[error("element {0} is not finite")]
    NonFinite(usize),
}
