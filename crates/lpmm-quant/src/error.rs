use lpmm_formats::FormatError;
use thiserror::Error;

/// Everything that can go wrong when quantizing.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum QuantError {
    /// Block sizes are powers of two from 32 to 4096.
    #[error("block size {size} is not supported: use a power of two from 32 to 4096")]
    BlockSize { size: usize },
    /// A buffer has the wrong length for the input.
    #[error("{what} buffer has {actual} elements, {expected} expected")]
    Length {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// Quantization refuses NaN and ±Inf: there is no scale that represents them.
    #[error("input element {index} is {value}: quantization needs finite values")]
    NonFinite { index: usize, value: f32 },
    /// A code map without negative values (bitsandbytes' unsigned dynamic map, a linear map
    /// without zero) cannot hold a negative input: it would be stored as the map's smallest value
    /// while its magnitude still set the block's scale. `-0.0` is not negative.
    #[error("input element {index} is {value}: the code map has no negative values")]
    Negative { index: usize, value: f32 },
    /// A tensor shape does not match its data, or has a zero dimension.
    #[error("shape {shape:?} does not fit {len} elements")]
    Shape { shape: Vec<usize>, len: usize },
    /// Rank-1 normalization needs 2 to 8 dimensions.
    #[error("rank-1 normalization needs a tensor of 2 to 8 dimensions, got {ndim}")]
    Rank1Dims { ndim: usize },
    /// An error from the formats layer (a bad code map or bit width).
    #[error(transparent)]
    Format(#[from] FormatError),
}
