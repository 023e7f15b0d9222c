//! Rank-1 normalized quantization of a second moment (lpmm's best 4-bit setting): packed codes
//! and, for the whole tensor, one max vector per dimension; element `(i_0, ..)` is scaled by
//! `min_k max_k[i_k]` ([docs/FORMATS.md] §8). The maxima of the *updated* state span the tensor,
//! so a step takes two passes: a fold of every element's updated second moment into the next maxima
//! (the rule applied, nothing stored; a max, so the order does not matter), then the fused pass,
//! which decodes with the current maxima and encodes with the next ones.
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use std::sync::atomic::Ordering;

use lpmm_formats::packing;
use lpmm_quant::{BlockSize, RANK1_MAX_DIMS, Rank1 as Quantizer};

use super::{
    Codec, Cover, Dtype, Extent, FoldInput, HostSlot, Random, RegionSpec, Regions, RegionsMut,
    check_scales, wide_f32,
};
use super::{MapKind, Storage, StoreRounding};
use crate::vocab::CHUNK;
use crate::vocab::SlotKind;

/// Rank-1 normalized codes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rank1 {
    map: MapKind,
    fallback: BlockSize,
}

/// Wide regions: the current maxima (saved) and the next step's (folded during a step).
const SCALES: usize = 0;
const NEXT: usize = 1;

impl Rank1 {
    fn quantizer(&self, shape: &[usize]) -> Option<Quantizer<'static>> {
        Quantizer::new(self.map.shared(), shape).ok()
    }
}

impl Codec for Rank1 {
    const NAME: &'static str = "rank1";
    const COVER: Cover = Cover {
        tensor_wide: &[(
            "rank-1",
            Storage::Rank1 {
                map: MapKind::LinearWithoutZero4,
                fallback: BlockSize::B128,
            },
        )],
        ..Cover::NONE
    };

    fn from_storage(storage: Storage) -> Option<Self> {
        match storage {
            Storage::Rank1 { map, fallback } => Some(Rank1 { map, fallback }),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        format!("{}/rank1", self.map.name())
    }

    fn regions(&self, shape: &[usize]) -> Vec<RegionSpec> {
        let scales: usize = shape.iter().sum();
        vec![
            RegionSpec::new(
                "",
                Dtype::U8,
                Extent::Elements {
                    bits: self.map.shared().bits(),
                },
            ),
            RegionSpec::new(".scales", Dtype::F32, Extent::Tensor { len: scales }),
            RegionSpec::scratch("~next", Dtype::F32, scales),
        ]
    }

    fn allowed(&self, slot: SlotKind) -> bool {
        slot == SlotKind::State2
    }

    fn quantized(&self) -> bool {
        true
    }

    fn resolve(&self, shape: &[usize]) -> Option<Storage> {
        // Vectors (and tensors of too many dimensions) fall back to blocks.
        (shape.len() < 2 || shape.len() > RANK1_MAX_DIMS).then_some(Storage::Quantized {
            map: self.map,
            block: self.fallback,
            rounding: StoreRounding::Nearest,
        })
    }

    fn map(&self) -> Option<MapKind> {
        Some(self.map)
    }

    fn kernel_aux(&self) -> u32 {
        self.map.id() | self.map.shared().bits() << 24
    }

    fn folds(&self) -> &'static [FoldInput] {
        &[FoldInput::UpdatedState2]
    }

    fn validate(&self, host: &HostSlot, _values: bool) -> Result<(), String> {
        check_scales(host, ".scales")
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        let Some(q) = self.quantizer(r.shape) else {
            return;
        };
        let map = self.map.shared();
        let bits = map.bits() as usize;
        let mut unpacked = [0u8; CHUNK];
        let unpacked = &mut unpacked[..out.len()];
        let bytes = &r.elem[0][at * bits / 8..((at + out.len()) * bits).div_ceil(8)];
        // Lengths agree by construction (`at` is a multiple of the chunk).
        let _ = packing::unpack(bytes, map.bits(), unpacked);
        let first = r.global + at;
        let scales = &r.wide[SCALES];
        q.for_each_scale_with(
            |k| wide_f32(scales, k),
            first,
            out.len(),
            |e, s| {
                let j = e - first;
                out[j] = map.value(unpacked[j]) * s;
            },
        );
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], _random: Random) {
        let Some(q) = self.quantizer(r.shape) else {
            return;
        };
        let map = self.map.shared();
        let bits = map.bits() as usize;
        let mut unpacked = [0u8; CHUNK];
        let unpacked = &mut unpacked[..values.len()];
        let first = r.global + at;
        // The codes of the updated state, nearest to `v / s` with the next step's maxima.
        let next = &r.wide[NEXT];
        q.for_each_scale_with(
            |k| wide_f32(next, k),
            first,
            values.len(),
            |e, s| {
                let j = e - first;
                unpacked[j] = map.nearest(if s == 0.0 { 0.0 } else { values[j] / s });
            },
        );
        let bytes = &mut r.elem[0][at * bits / 8..((at + values.len()) * bits).div_ceil(8)];
        let _ = packing::pack(unpacked, map.bits(), bytes);
    }

    fn fold_targets(&self) -> &'static [usize] {
        &[NEXT]
    }

    fn fold(
        &self,
        r: &Regions<'_>,
        _pass: usize,
        at: usize,
        values: &[f32],
        _local: &mut crate::fixed::Local,
    ) {
        let Some(q) = self.quantizer(r.shape) else {
            return;
        };
        // A max of non-negative floats is a max of their bit patterns: the same in any order.
        let next = &r.wide[NEXT];
        q.fold_maxima_with(values, r.global + at, |k, v| {
            next[k].fetch_max(v.to_bits(), Ordering::Relaxed);
        });
    }

    fn swap_after_step(&self) -> Option<(usize, usize)> {
        Some((SCALES, NEXT))
    }
}
