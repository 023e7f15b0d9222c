use thiserror::Error;

/// Everything that can go wrong when building or using a numeric format.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Code widths are 1 to 8 bits.
    #[error("bit width {bits} is not supported: codes are 1 to 8 bits wide")]
    BitWidth { bits: u32 },
    /// The construction asked for has no map at this width (e.g. a signed linear map needs 2 bits).
    #[error("the {what} construction has no map at {bits} bits")]
    NoMapAtWidth { what: &'static str, bits: u32 },
    /// A code map must hold between 2 and 2^bits values.
    #[error("a {bits}-bit code map holds 2 to {max} values, got {len}", max = 1u32 << *bits)]
    CodeMapLength { bits: u32, len: usize },
    /// Code map values must be strictly increasing.
    #[error(
        "code map values must be strictly increasing: value {index} ({value}) is not above the one before it"
    )]
    CodeMapUnsorted { index: usize, value: f32 },
    /// Code map values must be finite and lie in [-1, 1] (they are multiplied by a scale).
    #[error("code map value {index} ({value}) is outside [-1, 1] or not finite")]
    CodeMapOutOfRange { index: usize, value: f32 },
    /// Neighbouring non-zero values whose exponents differ by more than 28 (their midpoint would
    /// not be exact in f64, and with it the nearest-code rule).
    #[error("code map values {index} and the one before it are more than 2^28 apart in magnitude")]
    CodeMapSpread { index: usize },
    /// Packed and unpacked buffers disagree in length.
    #[error("buffer length mismatch: {what} needs {expected} elements, got {actual}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A code does not fit in the bit width it is packed with.
    #[error("code {code} at index {index} does not fit in {bits} bits")]
    CodeTooWide { index: usize, code: u8, bits: u32 },
}
