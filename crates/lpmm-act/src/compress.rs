//! Block-wise compression of any saved tensor (ActNN / Mesa): 2, 4 or 8 bits per element with a
//! per-block f32 scale, stochastically rounded so that the decompressed tensor is an unbiased
//! estimate of the original (`E[decompress(compress(x))] = x` elementwise). It is lpmm-quant's
//! block-wise quantizer on the symmetric linear map `k / L` (`L = 2^(bits-1) - 1`: at 2 bits the
//! levels are -1, 0, 1 times the block's absmax).

use lpmm_formats::CodeMap;
use lpmm_quant::{BlockSize, Blockwise, QuantRounding, RandomStream};
use std::sync::OnceLock;

use crate::ActError;

/// A compressed tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Compressed {
    bits: u32,
    block: BlockSize,
    len: usize,
    codes: Vec<u8>,
    absmax: Vec<f32>,
}

/// The symmetric linear map of `bits` (2, 4 or 8), built once per process: building one fills
/// a 64 KiB search table (about 1.5 ms), which per call cost more than compressing 262,144
/// elements.
fn map(bits: u32) -> Result<&'static CodeMap, ActError> {
    static MAPS: [OnceLock<Result<CodeMap, String>>; 3] = [const { OnceLock::new() }; 3];
    let slot = match bits {
        2 => &MAPS[0],
        4 => &MAPS[1],
        8 => &MAPS[2],
        _ => return Err(ActError::Bits(bits)),
    };
    slot.get_or_init(|| CodeMap::linear_signed(bits).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| ActError::Grid(e.clone()))
}

impl Compressed {
    /// `x` at `bits` (2, 4 or 8) per element in blocks of `block`, rounded stochastically with
    /// the draws of `stream` (element `i` uses draw `i`: 16 bits, half of word `i / 2`,
    /// [`RandomStream::draws_at`]). Non-finite inputs are an error.
    pub fn new(
        x: &[f32],
        bits: u32,
        block: BlockSize,
        stream: RandomStream,
    ) -> Result<Self, ActError> {
        let m = map(bits)?;
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return Err(ActError::NonFinite(i));
        }
        let q = Blockwise::new(m, block);
        let mut codes = vec![0u8; q.codes_len(x.len())];
        let mut absmax = vec![0f32; q.scales_len(x.len())];
        q.quantize(
            x,
            &mut codes,
            &mut absmax,
            QuantRounding::Stochastic { stream, offset: 0 },
        )
        .map_err(|e| ActError::Grid(e.to_string()))?;
        Ok(Self {
            bits,
            block,
            len: x.len(),
            codes,
            absmax,
        })
    }

    /// The decompressed tensor.
    pub fn decompress(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len];
        // The map and the lengths were checked when compressing.
        let m = map(self.bits).expect("checked at construction");
        Blockwise::new(m, self.block)
            .dequantize(&self.codes, &self.absmax, &mut out)
            .expect("lengths checked at construction");
        out
    }

    /// Bytes held (codes and scales).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.absmax.len()
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
