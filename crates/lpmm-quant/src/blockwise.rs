//! Block-wise absmax quantization onto any code map (bitsandbytes' and torchao's state format,
//! and with a linear map the LPMM parameter format).

use lpmm_formats::{CodeMap, packing};
use rayon::prelude::*;

use crate::error::QuantError;
use crate::random::{RandomDraws, RandomStream};

/// Elements handed to one rayon task; also the size below which work stays on the calling thread.
const CHUNK_ELEMENTS: usize = 1 << 16;

/// The largest block size; per-block scratch lives on the stack at this size.
pub const MAX_BLOCK: usize = 4096;

/// A quantization block size: a power of two from 32 to 4096 elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockSize(u32);

impl BlockSize {
    /// bitsandbytes' and torchao's 8-bit optimizer block.
    pub const B256: BlockSize = BlockSize(256);
    /// lpmm's and torchao's 4-bit optimizer block.
    pub const B128: BlockSize = BlockSize(128);
    /// The LPMM parameter format's group.
    pub const B64: BlockSize = BlockSize(64);

    /// Validates `size`.
    pub fn new(size: usize) -> Result<Self, QuantError> {
        if size.is_power_of_two() && (32..=MAX_BLOCK).contains(&size) {
            Ok(Self(size as u32))
        } else {
            Err(QuantError::BlockSize { size })
        }
    }

    /// The size in elements.
    pub const fn get(self) -> usize {
        self.0 as usize
    }

    /// Blocks needed for `n` elements (the last one may be partial).
    pub const fn blocks(self, n: usize) -> usize {
        n.div_ceil(self.0 as usize)
    }
}

/// How a quantizer rounds onto the code map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantRounding {
    /// The exact nearest code ([`CodeMap::nearest`]: ties to the code of lower magnitude).
    Nearest,
    /// Stochastic rounding between neighbouring codes ([`CodeMap::stochastic`]), element `j` of
    /// the input using the draw of element `offset + j` (mod 2^64) of `stream`
    /// ([`RandomStream::draws_at`]: 16 random bits, two elements per ChaCha8 word). `offset` is
    /// the input's position in the whole tensor, so a shard or chunk draws the same bits as the
    /// whole.
    Stochastic {
        /// Where the random bits come from.
        stream: RandomStream,
        /// The global index of the input's first element.
        offset: u64,
    },
}

/// Elements a block is quantized in at a time (the whole block when smaller): the stack scratch
/// holds one span, so a call zeroes 1.25 KiB of scratch, not a largest block's 20 KiB.
const SPAN: usize = 256;

/// The scales of the span of `len` elements at `start` (a multiple of SPAN) of a run of blocks
/// of `block` elements, and the block size to read them with: the one block it lies in, or the
/// whole blocks it holds (blocks under SPAN elements).
fn span_scales(absmax: &[f32], block: usize, start: usize, len: usize) -> (&[f32], usize) {
    if block >= SPAN {
        (&absmax[start / block..][..1], len)
    } else {
        (&absmax[start / block..], block)
    }
}

/// The block quantizer's stack scratch for one span: unpacked codes (maps narrower than 8 bits)
/// and random draws (stochastic rounding), each present only when used.
struct Scratch {
    codes: Option<[u8; SPAN]>,
    random: Option<[u32; SPAN]>,
}

/// Block-wise absmax quantization: the input is cut into blocks of `block` consecutive elements
/// (the last one partial); each block stores `absmax = max |x|` as f32 and, per element, the code
/// of `y = x / absmax` (f32 division; `y = 0` for an all-zero block) in `map`, packed at
/// `map.bits()` bits per code ([`lpmm_formats::packing`] order). Dequantization gives
/// `map[code] * absmax`, so an all-zero block decodes to exact zeros with any map.
///
/// Non-finite inputs: a block holding NaN or ±Inf is refused with
/// [`QuantError::NonFinite`] naming the first such element; the input is never changed, and the
/// outputs (which may be partly written) never hold out-of-range codes.
#[derive(Debug, Clone, Copy)]
pub struct Blockwise<'m> {
    map: &'m CodeMap,
    block: BlockSize,
    sign_fix: bool,
}

impl<'m> Blockwise<'m> {
    /// A quantizer onto `map` with blocks of `block` elements.
    pub fn new(map: &'m CodeMap, block: BlockSize) -> Self {
        Self {
            map,
            block,
            sign_fix: false,
        }
    }

    /// bitsandbytes' first-moment sign fix: if the chosen code's sign bit differs from the value's,
    /// move one code toward the value, so a small negative momentum never decodes as zero or
    /// positive. Zero counts as positive (its sign bit is clear), so a small positive value may
    /// still decode as zero. Unlike bitsandbytes, an exact zero (of either sign) keeps its code.
    pub fn with_sign_fix(mut self, on: bool) -> Self {
        self.sign_fix = on;
        self
    }

    /// The code map.
    pub fn map(&self) -> &CodeMap {
        self.map
    }

    /// The block size.
    pub fn block(&self) -> BlockSize {
        self.block
    }

    /// Bytes of packed codes for `n` elements.
    pub fn codes_len(&self, n: usize) -> usize {
        packing::packed_len(n, self.map.bits())
    }

    /// Number of absmax scales for `n` elements.
    pub fn scales_len(&self, n: usize) -> usize {
        self.block.blocks(n)
    }

    fn check_lengths(&self, n: usize, codes: usize, scales: usize) -> Result<(), QuantError> {
        let want_codes = self.codes_len(n);
        if codes != want_codes {
            return Err(QuantError::Length {
                what: "codes",
                expected: want_codes,
                actual: codes,
            });
        }
        let want_scales = self.scales_len(n);
        if scales != want_scales {
            return Err(QuantError::Length {
                what: "absmax",
                expected: want_scales,
                actual: scales,
            });
        }
        Ok(())
    }

    /// Quantizes `x` into `codes` (`codes_len(x.len())` bytes) and `absmax`
    /// (`scales_len(x.len())` values). Multi-threaded over chunks of blocks; the result does not
    /// depend on the number of threads. A non-finite value is [`QuantError::NonFinite`] (the
    /// outputs may then be partly written); a negative one, when the map has no negative values,
    /// is [`QuantError::Negative`], found before anything is written.
    pub fn quantize(
        &self,
        x: &[f32],
        codes: &mut [u8],
        absmax: &mut [f32],
        rounding: QuantRounding,
    ) -> Result<(), QuantError> {
        self.check_lengths(x.len(), codes.len(), absmax.len())?;
        crate::check_sign(self.map, x)?;
        let block = self.block.get();
        let blocks_per_chunk = (CHUNK_ELEMENTS / block).max(1);
        let chunk = blocks_per_chunk * block;
        let chunk_bytes = packing::packed_len(chunk, self.map.bits());
        let run = |index: usize, (x, (codes, absmax)): (&[f32], (&mut [u8], &mut [f32]))| {
            let start = index * chunk;
            let mut bits = match rounding {
                QuantRounding::Nearest => None,
                QuantRounding::Stochastic { stream, offset } => {
                    Some(stream.draws_at(offset.wrapping_add(start as u64)))
                }
            };
            // Scratch zeroed once per call, and only what this map and rounding use.
            let mut scratch = Scratch {
                codes: if self.map.bits() < 8 {
                    Some([0u8; SPAN])
                } else {
                    None
                },
                random: if bits.is_some() {
                    Some([0u32; SPAN])
                } else {
                    None
                },
            };
            // Blocks smaller than a span are quantized a span (several blocks) at a time.
            let group = (SPAN / block).max(1);
            let group_bytes = packing::packed_len(group * block, self.map.bits());
            for ((x, codes), absmax) in x
                .chunks(group * block)
                .zip(codes.chunks_mut(group_bytes))
                .zip(absmax.chunks_mut(group))
            {
                self.quantize_blocks(x, codes, absmax, bits.as_mut(), &mut scratch)
                    .ok_or(())?;
            }
            Ok::<(), ()>(())
        };
        let result = if x.len() <= chunk {
            run(0, (x, (codes, absmax)))
        } else {
            x.par_chunks(chunk)
                .zip(
                    codes
                        .par_chunks_mut(chunk_bytes)
                        .zip(absmax.par_chunks_mut(blocks_per_chunk)),
                )
                .enumerate()
                .try_for_each(|(i, parts)| run(i, parts))
        };
        result.map_err(|()| {
            let index = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
            QuantError::NonFinite {
                index,
                value: x.get(index).copied().unwrap_or(f32::NAN),
            }
        })
    }

    /// Quantizes a run of whole blocks (the last one may be partial) into `out` and their scales
    /// into `absmax`; `None` if a block holds a non-finite value.
    fn quantize_blocks(
        &self,
        x: &[f32],
        out: &mut [u8],
        absmax: &mut [f32],
        mut bits: Option<&mut RandomDraws>,
        scratch: &mut Scratch,
    ) -> Option<()> {
        let block = self.block.get();
        for (x, a) in x.chunks(block).zip(absmax.iter_mut()) {
            let max_bits = lpmm_formats::simd::abs_max_bits(x);
            if max_bits >= 0x7F80_0000 {
                return None;
            }
            *a = f32::from_bits(max_bits);
        }
        let absmax = &*absmax;
        let map = self.map;
        let width = map.bits();
        // Spans of a multiple of 8 codes start on a byte boundary of the packed stream. A span
        // is one block, part of one, or (blocks under SPAN elements) several whole blocks.
        for (k, x) in x.chunks(SPAN).enumerate() {
            let start = k * SPAN;
            let (scales, span_block) = span_scales(absmax, block, start, x.len());
            let packed = &mut out[packing::packed_len(start, width)..]
                [..packing::packed_len(x.len(), width)];
            // 8-bit codes are written in place; narrower ones are packed afterwards.
            let codes = match &mut scratch.codes {
                Some(buffer) => &mut buffer[..x.len()],
                None => &mut packed[..],
            };
            match (bits.as_deref_mut(), &mut scratch.random) {
                (Some(bits), Some(random)) => {
                    // Always drawn, also for all-zero blocks, so each element keeps its own bits.
                    bits.fill(&mut random[..x.len()]);
                    map.stochastic_blocks(x, scales, span_block, &random[..x.len()], codes);
                }
                _ => map.nearest_blocks(x, scales, span_block, codes),
            }
            if self.sign_fix {
                for ((x, codes), &a) in x
                    .chunks(span_block)
                    .zip(codes.chunks_mut(span_block))
                    .zip(scales)
                {
                    if a != 0.0 {
                        self.fix_signs(x, a, codes);
                    }
                }
            }
            if let Some(buffer) = &scratch.codes {
                // Codes come from the map, so they fit its width; lengths match by construction.
                packing::pack(&buffer[..x.len()], width, packed).ok()?;
            }
        }
        Some(())
    }

    /// The sign fix: a code whose value's sign differs from a non-zero input's moves one code
    /// toward the input.
    fn fix_signs(&self, x: &[f32], absmax: f32, codes: &mut [u8]) {
        let map = self.map;
        let last = (map.len() - 1) as u8;
        for (c, &v) in codes.iter_mut().zip(x) {
            // The quotient the code was chosen for (it may underflow to zero).
            let y = v / absmax;
            if y != 0.0 && map.value(*c).is_sign_negative() != y.is_sign_negative() {
                *c = if y > 0.0 {
                    (*c + 1).min(last)
                } else {
                    c.saturating_sub(1)
                };
            }
        }
    }

    /// Dequantizes `codes` and `absmax` into `out` (`map[code] * absmax`).
    pub fn dequantize(
        &self,
        codes: &[u8],
        absmax: &[f32],
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        self.check_lengths(out.len(), codes.len(), absmax.len())?;
        let block = self.block.get();
        let bits = self.map.bits();
        let blocks_per_chunk = (CHUNK_ELEMENTS / block).max(1);
        let chunk = blocks_per_chunk * block;
        let run = |(out, (codes, absmax)): (&mut [f32], (&[u8], &[f32]))| {
            if bits == 8 {
                // 8-bit codes are read in place, every block of the chunk in one call.
                self.map.decode_blocks(codes, absmax, block, out);
                return Ok(());
            }
            let mut unpacked = [0u8; SPAN];
            // Spans of a multiple of 8 codes start on a byte boundary of the packed stream. A
            // span is one block, part of one, or (blocks under SPAN elements) several.
            for (k, out) in out.chunks_mut(SPAN).enumerate() {
                let start = k * SPAN;
                let (scales, span_block) = span_scales(absmax, block, start, out.len());
                let packed = &codes[packing::packed_len(start, bits)..]
                    [..packing::packed_len(out.len(), bits)];
                let unpacked = &mut unpacked[..out.len()];
                if packing::unpack(packed, bits, unpacked).is_err() {
                    return Err(());
                }
                self.map.decode_blocks(unpacked, scales, span_block, out);
            }
            Ok(())
        };
        let result = if out.len() <= chunk {
            run((out, (codes, absmax)))
        } else {
            let chunk_bytes = packing::packed_len(chunk, bits);
            out.par_chunks_mut(chunk)
                .zip(
                    codes
                        .par_chunks(chunk_bytes)
                        .zip(absmax.par_chunks(blocks_per_chunk)),
                )
                .try_for_each(run)
        };
        // Unreachable after the length check: every chunk's byte count matches its elements.
        result.map_err(|()| QuantError::Length {
            what: "codes",
            expected: self.codes_len(out.len()),
            actual: codes.len(),
        })
    }
}
