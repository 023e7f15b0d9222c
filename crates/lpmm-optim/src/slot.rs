//! One slot of model memory (a parameter, gradient accumulator or optimizer state) held by the
//! CPU backend, and the chunk-wise decode / encode the fused step is made of.

use lpmm_formats::packing;
use lpmm_formats::{CodeMap, SplitF32, bf16, float, kahan_add, simd};
use lpmm_quant::{BlockSize, Blockwise, QuantRounding, RandomStream, Rank1};

use crate::config::{Storage, StoreRounding};

/// Elements the fused step handles at a time: a multiple of every block size (all are powers of
/// two up to 4096), so every slot's blocks fall whole inside a chunk.
pub(crate) const CHUNK: usize = 4096;

/// The bytes of one slot, in the layout its storage defines (docs/OPTIMIZERS.md).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum SlotData {
    /// Slot not used (e.g. no momentum).
    Empty,
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    Kahan {
        value: Vec<bf16>,
        comp: Vec<bf16>,
    },
    Split(Vec<SplitF32>),
    /// Packed codes and one f32 absmax per block.
    Quantized {
        codes: Vec<u8>,
        absmax: Vec<f32>,
    },
    /// Packed codes of a rank-1 normalized state; its scales are tensor-wide and live in the
    /// parameter's bookkeeping (they span pieces).
    Rank1(Vec<u8>),
}

/// A slot: its storage, its code map if quantized, and its data.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub storage: Storage,
    pub map: Option<&'static CodeMap>,
    pub data: SlotData,
}

impl Slot {
    /// A slot of `n` zeros (a rank-1 slot's scales live in the parameter's bookkeeping).
    pub fn new(storage: Storage, n: usize) -> Self {
        let map = match storage {
            Storage::Quantized { map, .. } | Storage::Rank1 { map, .. } => Some(map.shared()),
            _ => None,
        };
        let data = match (storage, map) {
            (Storage::F32, _) => SlotData::F32(vec![0.0; n]),
            (Storage::Bf16(_), _) => SlotData::Bf16(vec![bf16::ZERO; n]),
            (Storage::Bf16Kahan, _) => SlotData::Kahan {
                value: vec![bf16::ZERO; n],
                comp: vec![bf16::ZERO; n],
            },
            (Storage::SplitF32, _) => SlotData::Split(vec![SplitF32::default(); n]),
            (Storage::Quantized { block, .. }, Some(map)) => SlotData::Quantized {
                codes: vec![map.nearest(0.0); lpmm_formats::packing::packed_len(n, map.bits())],
                absmax: vec![0.0; block.blocks(n)],
            },
            (Storage::Rank1 { .. }, Some(map)) => {
                SlotData::Rank1(vec![0; lpmm_formats::packing::packed_len(n, map.bits())])
            }
            _ => SlotData::Empty,
        };
        Slot { storage, map, data }
    }

    /// An unused slot.
    pub fn empty() -> Self {
        Slot {
            storage: Storage::F32,
            map: None,
            data: SlotData::Empty,
        }
    }

    /// Bytes this slot allocates.
    pub fn bytes(&self) -> usize {
        match &self.data {
            SlotData::Empty => 0,
            SlotData::F32(v) => 4 * v.len(),
            SlotData::Bf16(v) => 2 * v.len(),
            SlotData::Kahan { value, comp } => 2 * (value.len() + comp.len()),
            SlotData::Split(v) => 4 * v.len(),
            SlotData::Quantized { codes, absmax } => codes.len() + 4 * absmax.len(),
            SlotData::Rank1(codes) => codes.len(),
        }
    }

    /// Decodes elements `start ..` of a rank-1 slot; `global` is the first element's index in
    /// the tensor, `scales` the tensor's per-dimension maxima.
    pub fn decode_rank1(
        &self,
        start: usize,
        global: usize,
        out: &mut [f32],
        q: &Rank1<'_>,
        scales: &[f32],
    ) {
        let (SlotData::Rank1(codes), Some(map)) = (&self.data, self.map) else {
            return;
        };
        let bits = map.bits() as usize;
        let mut unpacked = [0u8; CHUNK];
        let unpacked = &mut unpacked[..out.len()];
        let bytes = &codes[start * bits / 8..((start + out.len()) * bits).div_ceil(8)];
        // Lengths agree by construction (start is a multiple of CHUNK).
        let _ = packing::unpack(bytes, map.bits(), unpacked);
        q.for_each_scale(scales, global, out.len(), |e, s| {
            let j = e - global;
            out[j] = map.value(unpacked[j]) * s;
        });
    }

    /// Stores `values` as elements `start ..` of a rank-1 slot with the (new) `scales`: the code
    /// nearest to `value / scale` (0 when the scale is 0).
    pub fn encode_rank1(
        &mut self,
        start: usize,
        global: usize,
        values: &[f32],
        q: &Rank1<'_>,
        scales: &[f32],
    ) {
        let Some(map) = self.map else { return };
        let SlotData::Rank1(codes) = &mut self.data else {
            return;
        };
        let bits = map.bits() as usize;
        let mut unpacked = [0u8; CHUNK];
        let unpacked = &mut unpacked[..values.len()];
        q.for_each_scale(scales, global, values.len(), |e, s| {
            let j = e - global;
            unpacked[j] = map.nearest(if s == 0.0 { 0.0 } else { values[j] / s });
        });
        let bytes = &mut codes[start * bits / 8..((start + values.len()) * bits).div_ceil(8)];
        let _ = packing::pack(unpacked, map.bits(), bytes);
    }

    fn quantizer(&self) -> Option<(Blockwise<'_>, StoreRounding)> {
        match (self.storage, &self.map) {
            (
                Storage::Quantized {
                    block, rounding, ..
                },
                Some(map),
            ) => Some((Blockwise::new(map, block), rounding)),
            _ => None,
        }
    }

    fn block(&self) -> BlockSize {
        match self.storage {
            Storage::Quantized { block, .. } => block,
            _ => BlockSize::B64,
        }
    }

    /// Decodes elements `start .. start + out.len()` (`start` a multiple of [`CHUNK`]).
    pub fn decode(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match &self.data {
            // Rank-1 slots need their tensor's scales: callers use `decode_rank1`.
            SlotData::Empty | SlotData::Rank1(_) => out.fill(0.0),
            SlotData::F32(v) => out.copy_from_slice(&v[start..end]),
            SlotData::Bf16(v) => simd::bf16_to_f32(&v[start..end], out),
            // The parameter a model sees is the bf16 value; the compensation only feeds updates.
            SlotData::Kahan { value, .. } => simd::bf16_to_f32(&value[start..end], out),
            SlotData::Split(v) => out
                .iter_mut()
                .zip(&v[start..end])
                .for_each(|(o, s)| *o = s.to_f32()),
            SlotData::Quantized { codes, absmax } => {
                if let Some((q, _)) = self.quantizer() {
                    let bits = q.map().bits() as usize;
                    let block = self.block().get();
                    let codes = &codes[start * bits / 8..(end * bits).div_ceil(8)];
                    let absmax = &absmax[start / block..end.div_ceil(block)];
                    // Lengths agree by construction (start is block-aligned).
                    let _ = q.dequantize(codes, absmax, out);
                }
            }
        }
    }

    /// Stores `values` as elements `start ..` of this slot (`start` a multiple of [`CHUNK`]).
    /// Stochastic storages draw the bits of element `j` from word `global + j` of `stream`
    /// (`global`: the element's index in the whole tensor).
    pub fn encode_keyed(
        &mut self,
        start: usize,
        values: &[f32],
        stream: RandomStream,
        global: u64,
    ) {
        let end = start + values.len();
        let storage = self.storage;
        let block = self.block().get();
        let bits_for = |j: usize| stream.at(global + j as u64);
        match &mut self.data {
            // Rank-1 slots need their tensor's scales: callers use `encode_rank1`.
            SlotData::Empty | SlotData::Rank1(_) => {}
            SlotData::F32(v) => v[start..end].copy_from_slice(values),
            SlotData::Bf16(v) => match storage {
                Storage::Bf16(StoreRounding::Stochastic) => {
                    let mut bits = bits_for(0);
                    v[start..end]
                        .iter_mut()
                        .zip(values)
                        .for_each(|(o, &x)| *o = float::bf16_stochastic(x, bits.next()));
                }
                _ => simd::f32_to_bf16_nearest(values, &mut v[start..end]),
            },
            SlotData::Kahan { value, comp } => {
                // Re-initialisation: the value itself, no compensation.
                for ((v, c), &x) in value[start..end]
                    .iter_mut()
                    .zip(&mut comp[start..end])
                    .zip(values)
                {
                    *v = float::bf16_nearest(x);
                    *c = float::bf16_nearest(x - v.to_f32());
                }
            }
            SlotData::Split(v) => v[start..end]
                .iter_mut()
                .zip(values)
                .for_each(|(o, &x)| *o = SplitF32::from_f32(x)),
            SlotData::Quantized { codes, absmax } => {
                let Storage::Quantized { rounding, .. } = storage else {
                    return;
                };
                let Some(map) = self.map else { return };
                let q = Blockwise::new(map, BlockSize::new(block).unwrap_or(BlockSize::B64));
                let bits = map.bits() as usize;
                let codes = &mut codes[start * bits / 8..(end * bits).div_ceil(8)];
                let absmax = &mut absmax[start / block..end.div_ceil(block)];
                let rounding = match rounding {
                    StoreRounding::Nearest => QuantRounding::Nearest,
                    StoreRounding::Stochastic => QuantRounding::Stochastic {
                        stream,
                        offset: global,
                    },
                };
                // Values are finite (the step never stores a non-finite value) and lengths agree.
                let _ = q.quantize(values, codes, absmax, rounding);
            }
        }
    }

    /// Adds `deltas` to a Kahan-compensated parameter (elements `start ..`).
    pub fn kahan_add(&mut self, start: usize, deltas: &[f32]) {
        if let SlotData::Kahan { value, comp } = &mut self.data {
            let end = start + deltas.len();
            for ((v, c), &d) in value[start..end]
                .iter_mut()
                .zip(&mut comp[start..end])
                .zip(deltas)
            {
                kahan_add(v, c, d);
            }
        }
    }

    /// Sets elements `start ..` to zero (a consumed gradient accumulator).
    pub fn clear(&mut self, start: usize, len: usize) {
        let end = start + len;
        let block = self.block().get();
        match &mut self.data {
            SlotData::Empty | SlotData::Rank1(_) => {}
            SlotData::F32(v) => v[start..end].fill(0.0),
            SlotData::Bf16(v) => v[start..end].fill(bf16::ZERO),
            SlotData::Kahan { value, comp } => {
                value[start..end].fill(bf16::ZERO);
                comp[start..end].fill(bf16::ZERO);
            }
            SlotData::Split(v) => v[start..end].fill(SplitF32::default()),
            SlotData::Quantized { codes, absmax } => {
                let bits = self.map.map_or(8, |m| m.bits() as usize);
                let zero = self.map.map_or(0, |m| m.nearest(0.0));
                // Every byte of an all-zero-code block: codes of `zero` packed, which for the
                // signed linear map (code 127) is not the byte 127 at widths below 8; a zero absmax
                // makes the decoded values exact zeros whatever the codes are.
                if bits == 8 {
                    codes[start..end].fill(zero);
                }
                absmax[start / block..end.div_ceil(block)].fill(0.0);
            }
        }
    }
}
