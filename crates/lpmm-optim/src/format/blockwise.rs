//! Block-wise absmax quantization onto a code map (bitsandbytes' and torchao's 8-bit and 4-bit
//! states, and with the signed linear map the LPMM parameter format): packed codes and one f32
//! absmax per block ([docs/FORMATS.md] §4–§7).
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use lpmm_formats::packing::packed_len;
use lpmm_quant::{BlockSize, Blockwise as Quantizer, QuantRounding};

use super::{
    Codec, Dtype, Extent, HostSlot, Lanes, Random, RegionSpec, Regions, RegionsMut, check_scales,
};
use super::{MapKind, Storage, StoreRounding};
use crate::vocab::SlotKind;

/// Block-quantized codes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Blockwise {
    map: MapKind,
    block: BlockSize,
    rounding: StoreRounding,
}

impl Blockwise {
    fn quantizer(&self) -> Quantizer<'static> {
        Quantizer::new(self.map.shared(), self.block)
    }

    fn bits(&self) -> usize {
        self.map.shared().bits() as usize
    }
}

impl Codec for Blockwise {
    const NAME: &'static str = "blockwise";

    fn from_storage(storage: Storage) -> Option<Self> {
        match storage {
            Storage::Quantized {
                map,
                block,
                rounding,
            } => Some(Blockwise {
                map,
                block,
                rounding,
            }),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        let sr = if self.stochastic() { "-sr" } else { "" };
        format!("{}/b{}{sr}", self.map.name(), self.block.get())
    }

    fn regions(&self, _shape: &[usize]) -> Vec<RegionSpec> {
        vec![
            RegionSpec::new(
                "",
                Dtype::U8,
                Extent::Elements {
                    bits: self.map.shared().bits(),
                },
            ),
            RegionSpec::new(
                ".absmax",
                Dtype::F32,
                Extent::Blocks {
                    block: self.block.get(),
                },
            ),
        ]
    }

    fn allowed(&self, slot: SlotKind) -> bool {
        // Only second moments are never negative.
        slot == SlotKind::State2 || self.map.signed()
    }

    fn quantized(&self) -> bool {
        true
    }

    fn alignment(&self) -> usize {
        self.block.get()
    }

    fn stochastic(&self) -> bool {
        self.rounding == StoreRounding::Stochastic
    }

    fn map(&self) -> Option<MapKind> {
        Some(self.map)
    }

    fn kernel_aux(&self) -> u32 {
        self.map.id()
            | self.block.get().trailing_zeros() << 8
            | u32::from(self.stochastic()) << 16
            | self.map.shared().bits() << 24
    }

    fn lanes(&self) -> Option<Lanes> {
        // Blocks up to the specialized kernels' tile (every shipped block size).
        (self.block.get() <= crate::vocab::TILE).then(|| Lanes::Quantized {
            map: self.map.shared(),
            block: self.block.get(),
            stochastic: self.stochastic(),
        })
    }

    fn validate(&self, host: &HostSlot, _values: bool) -> Result<(), String> {
        check_scales(host, ".absmax")
    }

    fn fresh(&self, k: usize, words: &mut [u32], n: usize) {
        words.fill(0);
        if k == 0 {
            // Every byte of the packed codes the code of 0, as a fresh CPU slot holds them.
            let zero = self.map.shared().nearest(0.0);
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(words);
            bytes[..packed_len(n, self.map.shared().bits())].fill(zero);
        }
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        let (end, bits, block) = (at + out.len(), self.bits(), self.block.get());
        let codes = &r.elem[0][at * bits / 8..(end * bits).div_ceil(8)];
        let absmax: &[f32] =
            bytemuck::cast_slice(&r.elem[1][4 * (at / block)..4 * end.div_ceil(block)]);
        // Lengths agree by construction (`at` is block-aligned).
        let _ = self.quantizer().dequantize(codes, absmax, out);
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], random: Random) {
        let (end, bits, block) = (at + values.len(), self.bits(), self.block.get());
        let [codes, absmax, _] = &mut r.elem;
        let codes = &mut codes[at * bits / 8..(end * bits).div_ceil(8)];
        let absmax: &mut [f32] =
            bytemuck::cast_slice_mut(&mut absmax[4 * (at / block)..4 * end.div_ceil(block)]);
        let rounding = match self.rounding {
            StoreRounding::Nearest => QuantRounding::Nearest,
            StoreRounding::Stochastic => QuantRounding::Stochastic {
                stream: random.stream,
                offset: random.index,
            },
        };
        // Values are finite (the step never stores a non-finite value) and lengths agree.
        let _ = self.quantizer().quantize(values, codes, absmax, rounding);
    }

    fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
        let (end, block) = (at + len, self.block.get());
        // A zero absmax makes the decoded values exact zeros whatever the codes are; 8-bit codes
        // also get the code of 0 (narrower ones are left as they are).
        if self.bits() == 8 {
            r.elem[0][at..end].fill(self.map.shared().nearest(0.0));
        }
        r.elem[1][4 * (at / block)..4 * end.div_ceil(block)].fill(0);
    }
}
