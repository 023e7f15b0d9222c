//! Linear signed group quantization: the LPMM parameter format (8-bit, group 64, stochastic
//! rounding), and its narrower variants.

use lpmm_formats::CodeMap;

use crate::blockwise::{BlockSize, Blockwise, QuantRounding};
use crate::error::QuantError;

/// Linear signed group quantization: groups of `group` elements, each with an f32
/// `absmax`; element value `q * absmax / L` with the integer `q` in `[-L, L]`,
/// `L = 2^(bits-1) - 1`. The code stored is `q + L` (offset binary, `map.bits()` bits per code),
/// so this is block-wise quantization onto [`CodeMap::linear_signed`] and shares its rounding
/// rules exactly; use [`LinearGroup::integer`] for `q`.
#[derive(Debug, Clone)]
pub struct LinearGroup {
    map: CodeMap,
    group: BlockSize,
}

impl LinearGroup {
    /// `bits`-bit codes (2..=8) in groups of `group` elements.
    pub fn new(bits: u32, group: BlockSize) -> Result<Self, QuantError> {
        Ok(Self {
            map: CodeMap::linear_signed(bits)?,
            group,
        })
    }

    /// The LPMM parameter format: 8 bits, groups of 64 (use it with stochastic rounding).
    pub fn lpmm_parameter() -> Self {
        Self {
            map: CodeMap::linear_signed(8).expect("8 bits is a valid width"),
            group: BlockSize::B64,
        }
    }

    /// `L`: the largest integer level.
    pub fn levels(&self) -> i32 {
        (1 << (self.map.bits() - 1)) - 1
    }

    /// The signed integer level `q` of a stored code.
    pub fn integer(&self, code: u8) -> i32 {
        i32::from(code) - self.levels()
    }

    /// The block-wise quantizer this format is.
    pub fn quantizer(&self) -> Blockwise<'_> {
        Blockwise::new(&self.map, self.group)
    }

    /// Quantizes `x` (see [`Blockwise::quantize`]).
    pub fn quantize(
        &self,
        x: &[f32],
        codes: &mut [u8],
        absmax: &mut [f32],
        rounding: QuantRounding,
    ) -> Result<(), QuantError> {
        self.quantizer().quantize(x, codes, absmax, rounding)
    }

    /// Dequantizes (see [`Blockwise::dequantize`]).
    pub fn dequantize(
        &self,
        codes: &[u8],
        absmax: &[f32],
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        self.quantizer().dequantize(codes, absmax, out)
    }
}
