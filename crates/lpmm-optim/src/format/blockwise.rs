//! Block-wise absmax quantization onto a code map (bitsandbytes' and torchao's 8-bit and 4-bit
//! states, and with the signed linear map the LPMM parameter format): packed codes and one f32
//! absmax per block ([docs/FORMATS.md] §4–§7).
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use lpmm_formats::packing::packed_len;
use lpmm_quant::BlockSize;

use super::{
    Codec, Cover, Dtype, Extent, HostSlot, Lanes, Random, RegionSpec, Regions, RegionsMut,
    check_scales,
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
    /// How its codes are read and written ([`lanes::Codes`]).
    fn codes(&self) -> lanes::Codes {
        lanes::Codes {
            map: self.map.shared(),
            block: self.block.get(),
        }
    }
}

impl Codec for Blockwise {
    const NAME: &'static str = "blockwise";
    const COVER: Cover = Cover {
        params: &[Storage::LINEAR8_GROUP64_SR],
        grads: &[Storage::LINEAR8_GROUP64_SR],
        states: &[
            (Storage::DYNAMIC8_SIGNED, Storage::DYNAMIC8_UNSIGNED),
            (Storage::FOUR_BIT_SIGNED, Storage::FOUR_BIT_UNSIGNED),
            (
                Storage::LINEAR8_GROUP64_SR,
                Storage::Quantized {
                    map: MapKind::DynamicUnsigned8,
                    block: BlockSize::B256,
                    rounding: StoreRounding::Stochastic,
                },
            ),
        ],
        ..Cover::NONE
    };

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
            codes: self.codes(),
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
        let (codes, end) = (self.codes(), at + out.len());
        let absmax: &[f32] = bytemuck::cast_slice(&r.elem[1][codes.scale_bytes(at, end)]);
        let packed = &r.elem[0][codes.code_bytes(at, end)];
        codes.decode(packed, absmax, &mut lanes::Scratch::new(), out);
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], random: Random) {
        let (codes, end) = (self.codes(), at + values.len());
        let [packed, absmax, _] = &mut r.elem;
        let packed = &mut packed[codes.code_bytes(at, end)];
        let absmax: &mut [f32] = bytemuck::cast_slice_mut(&mut absmax[codes.scale_bytes(at, end)]);
        let mut draws = self
            .stochastic()
            .then(|| random.stream.draws_at(random.index));
        let scratch = &mut lanes::Scratch::new();
        codes.encode(values, packed, absmax, draws.as_mut(), scratch);
    }

    fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
        let (codes, end) = (self.codes(), at + len);
        let [packed, absmax, _] = &mut r.elem;
        let absmax: &mut [f32] = bytemuck::cast_slice_mut(&mut absmax[codes.scale_bytes(at, end)]);
        codes.clear(&mut packed[codes.code_bytes(at, end)], absmax);
    }
}

/// The format's codes on the CPU, a run of elements at a time: its one decode, encode and clear,
/// which the generic chunk path (the [`Codec`] implementation above) and the specialized step
/// kernels (`crate::cpu::tile`, through [`Lanes::Quantized`]) both call.
pub(crate) mod lanes {
    use lpmm_formats::CodeMap;
    use lpmm_formats::packing::{pack, packed_len, unpack};
    use lpmm_quant::RandomDraws;

    use crate::vocab::TILE;

    /// How a slot's codes are laid out: the code map (its width: 8 bits, or fewer packed
    /// little-endian) and the elements per block, each with one f32 absmax.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub(crate) struct Codes {
        /// The code map.
        pub map: &'static CodeMap,
        /// Elements per block (a power of two from 32 to 4096).
        pub block: usize,
    }

    /// Stack scratch for one span of [`TILE`] elements: codes before packing (or after
    /// unpacking) and random draws.
    #[derive(Debug)]
    pub(crate) struct Scratch {
        codes: [u8; TILE],
        draws: [u32; TILE],
    }

    impl Scratch {
        /// Zeroed scratch.
        pub(crate) fn new() -> Self {
            Scratch {
                codes: [0; TILE],
                draws: [0; TILE],
            }
        }
    }

    impl Codes {
        /// The bytes of packed codes that hold elements `a .. b` (`a` a multiple of 8).
        #[inline(always)]
        pub(crate) fn code_bytes(&self, a: usize, b: usize) -> std::ops::Range<usize> {
            let bits = self.map.bits();
            packed_len(a, bits)..packed_len(b, bits)
        }

        /// The block of element `a` (blocks are powers of two: a shift, not a division).
        #[inline(always)]
        fn block_of(&self, a: usize) -> usize {
            a >> self.block.trailing_zeros()
        }

        /// The absmax values of the blocks that hold elements `a .. b` (`a` at a block's start).
        #[inline(always)]
        pub(crate) fn scales(&self, a: usize, b: usize) -> std::ops::Range<usize> {
            self.block_of(a)..self.block_of(b + self.block - 1)
        }

        /// [`Codes::scales`] as bytes of the absmax region.
        #[inline(always)]
        pub(crate) fn scale_bytes(&self, a: usize, b: usize) -> std::ops::Range<usize> {
            let s = self.scales(a, b);
            4 * s.start..4 * s.end
        }

        /// Decodes a run of elements starting at a block's start: `codes`, its packed codes
        /// ([`Codes::code_bytes`]), and `absmax`, its blocks' scales ([`Codes::scales`]), into
        /// `out` (`map[code] * absmax`).
        #[inline(always)]
        pub(crate) fn decode(
            &self,
            codes: &[u8],
            absmax: &[f32],
            scratch: &mut Scratch,
            out: &mut [f32],
        ) {
            let (bits, block) = (self.map.bits(), self.block);
            if bits == 8 {
                // 8-bit codes are read in place, every block of the run in one call.
                self.map.decode_blocks(codes, absmax, block, out);
                return;
            }
            // Spans of a multiple of 8 codes start on a byte boundary of the packed stream; a
            // span holds whole blocks or lies in one (whose scale is then its first).
            for (k, out) in out.chunks_mut(TILE).enumerate() {
                let (start, n) = (k * TILE, out.len());
                let unpacked = &mut scratch.codes[..n];
                // Lengths agree by construction.
                let _ = unpack(&codes[self.code_bytes(start, start + n)], bits, unpacked);
                self.map
                    .decode_blocks(unpacked, &absmax[self.block_of(start)..], block, out);
            }
        }

        /// Stores `values`, a run of elements starting at a block's start, as codes
        /// ([docs/FORMATS.md] §6): each block's absmax (the largest `|x|`), the exact quotient,
        /// the nearest code or, with `draws` (positioned at the run's first element), stochastic
        /// rounding onto the map, then packing. The values are finite (the step stores finite
        /// values only) and not negative on a map without negative values (only second
        /// moments, never negative, use one): nothing here can fail.
        ///
        /// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
        #[inline(always)]
        pub(crate) fn encode(
            &self,
            values: &[f32],
            codes: &mut [u8],
            absmax: &mut [f32],
            mut draws: Option<&mut RandomDraws>,
            scratch: &mut Scratch,
        ) {
            let (bits, block) = (self.map.bits(), self.block);
            block_maxima(values, block, absmax);
            let absmax = &*absmax;
            for (k, xs) in values.chunks(TILE).enumerate() {
                let (start, n) = (k * TILE, xs.len());
                let scales = &absmax[self.block_of(start)..];
                // 8-bit codes are written in place; narrower ones are packed afterwards.
                let out = if bits == 8 {
                    &mut codes[start..start + n]
                } else {
                    &mut scratch.codes[..n]
                };
                match draws.as_deref_mut() {
                    Some(draws) => {
                        // Always drawn, also for all-zero blocks, so each element keeps its own.
                        let words = &mut scratch.draws[..n];
                        draws.fill(words);
                        self.map.stochastic_blocks(xs, scales, block, words, out);
                    }
                    None => self.map.nearest_blocks(xs, scales, block, out),
                }
                if bits < 8 {
                    let packed = &mut codes[self.code_bytes(start, start + n)];
                    // Codes come from the map, so they fit its width; lengths match by
                    // construction.
                    let _ = pack(&scratch.codes[..n], bits, packed);
                }
            }
        }

        /// Zeroes a run of elements starting at a block's start (a consumed gradient
        /// accumulator): a zero absmax makes the decoded values exact zeros whatever the codes
        /// are; 8-bit codes also get the code of 0 (narrower ones are left as they are).
        #[inline(always)]
        pub(crate) fn clear(&self, codes: &mut [u8], absmax: &mut [f32]) {
            if self.map.bits() == 8 {
                codes.fill(self.map.nearest(0.0));
            }
            absmax.fill(0.0);
        }
    }

    lpmm_formats::multiversion! {
        /// `absmax[b]` = the largest `|x|` of block `b` of `xs` (blocks of `block` elements, the
        /// last one possibly partial): the largest magnitude's bits.
        #[inline]
        fn block_maxima(xs: &[f32], block: usize, absmax: &mut [f32]) {
            for (a, b) in absmax.iter_mut().zip(xs.chunks(block)) {
                *a = f32::from_bits(b.iter().fold(0, |m, x| m.max(x.to_bits() & 0x7FFF_FFFF)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use lpmm_quant::{BlockSize, Blockwise as Quantizer, QuantRounding, RandomStream};

    use super::MapKind;
    use super::lanes::{Codes, Scratch};
    use crate::vocab::TILE;

    /// The format's codec stores and reads exactly what lpmm-quant's block quantizer does
    /// (without the sign fix), for every map, block size and rounding, on runs with partial
    /// blocks, on a whole chunk (the generic path) and on a chunk cut into tiles (the specialized
    /// kernels, whose blocks are at most a tile).
    #[test]
    fn the_codec_is_lpmm_quants_block_quantizer() {
        let stream = RandomStream::new(7, 3, 2);
        let offset = 3 * 4096;
        for map in MapKind::ALL {
            let unsigned = !map.signed();
            for block in [32, 64, 128, 256, 512, 1024, 4096] {
                let codes = Codes {
                    map: map.shared(),
                    block,
                };
                let q = Quantizer::new(map.shared(), BlockSize::new(block).unwrap());
                for stochastic in [false, true] {
                    for n in [1, 31, 100, 512, 1000, 4096] {
                        let x: Vec<f32> = (0..n)
                            .map(|i| {
                                let v = ((i * 7919) % 2003) as f32 * 1e-3 - 1.0;
                                let v = v * 10f32.powi((i % 5) as i32 - 2);
                                if unsigned { v.abs() } else { v }
                            })
                            .collect();
                        let rounding = if stochastic {
                            QuantRounding::Stochastic { stream, offset }
                        } else {
                            QuantRounding::Nearest
                        };
                        let (mut want, mut want_max) =
                            (vec![0u8; q.codes_len(n)], vec![0f32; q.scales_len(n)]);
                        q.quantize(&x, &mut want, &mut want_max, rounding).unwrap();
                        let what = format!("{map:?}, block {block}, {n} values, sr {stochastic}");

                        let (mut got, mut got_max) =
                            (vec![0u8; want.len()], vec![0f32; want_max.len()]);
                        let mut draws = stochastic.then(|| stream.draws_at(offset));
                        let scratch = &mut Scratch::new();
                        codes.encode(&x, &mut got, &mut got_max, draws.as_mut(), scratch);
                        assert_eq!((&got, &got_max), (&want, &want_max), "{what}");

                        let (mut back, mut want_back) = (vec![0f32; n], vec![0f32; n]);
                        q.dequantize(&want, &want_max, &mut want_back).unwrap();
                        codes.decode(&got, &got_max, scratch, &mut back);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&back), bits(&want_back), "{what}: decode");

                        if block > TILE {
                            continue;
                        }
                        // Tile by tile, the draws running on: the same codes.
                        let (mut tiled, mut tiled_max) =
                            (vec![0u8; want.len()], vec![0f32; want_max.len()]);
                        let mut draws = stochastic.then(|| stream.draws_at(offset));
                        for at in (0..n).step_by(TILE) {
                            let end = n.min(at + TILE);
                            codes.encode(
                                &x[at..end],
                                &mut tiled[codes.code_bytes(at, end)],
                                &mut tiled_max[codes.scales(at, end)],
                                draws.as_mut(),
                                scratch,
                            );
                            codes.decode(
                                &got[codes.code_bytes(at, end)],
                                &got_max[codes.scales(at, end)],
                                scratch,
                                &mut back[at..end],
                            );
                        }
                        assert_eq!((&tiled, &tiled_max), (&want, &want_max), "{what}: tiled");
                        assert_eq!(bits(&back), bits(&want_back), "{what}: tiled decode");
                    }
                }
            }
        }
    }
}
