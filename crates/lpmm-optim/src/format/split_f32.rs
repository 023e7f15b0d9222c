//! Split f32: a bf16 visible half and a 16-bit remainder, exactly f32 in 4 bytes, whose bf16
//! half a bf16 forward pass reads as the parameter ([docs/FORMATS.md] §10). Parameters only.
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use lpmm_formats::{SplitF32 as Split, bf16};

use super::Storage;
use super::{
    Codec, Cover, Dtype, Extent, HostSlot, Lanes, Random, RegionSpec, Regions, RegionsMut, fits,
    u16s,
};
use crate::vocab::SlotKind;

/// Split f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitF32;

const HI: RegionSpec = RegionSpec::new("", Dtype::Bf16, Extent::Elements { bits: 16 });
const REM: RegionSpec = RegionSpec::new(".rem", Dtype::U16, Extent::Elements { bits: 16 });

impl Codec for SplitF32 {
    const NAME: &'static str = "split_f32";
    const COVER: Cover = Cover {
        params: &[Storage::SplitF32],
        ..Cover::NONE
    };
    /// Lossless for every f32, but the visible bf16 half of a value from `0x7F7F8000` up is ±Inf
    /// (a bf16 forward pass would read it): such values are refused as bf16 refuses them.
    const LIMIT: u32 = super::bf16::BF16_LIMIT;

    fn from_storage(storage: Storage) -> Option<Self> {
        (storage == Storage::SplitF32).then_some(SplitF32)
    }

    fn describe(&self) -> String {
        "split-f32".into()
    }

    fn regions(&self, _shape: &[usize]) -> Vec<RegionSpec> {
        vec![HI, REM]
    }

    fn allowed(&self, slot: SlotKind) -> bool {
        slot == SlotKind::Param
    }

    fn lendable(&self) -> Option<Dtype> {
        Some(Dtype::Bf16)
    }

    fn lanes(&self) -> Option<Lanes> {
        Some(Lanes::Split)
    }

    fn validate(&self, host: &HostSlot, values: bool) -> Result<(), String> {
        let within = u16s(&host.regions[0].bytes)
            .zip(u16s(&host.regions[1].bytes))
            .all(|(hi, rem)| {
                let x = Split {
                    hi: bf16::from_bits(hi),
                    rem,
                }
                .to_f32();
                fits(x, Self::LIMIT)
            });
        if values && !within {
            return Err("holds a non-finite value, or one whose visible bf16 half is ±Inf".into());
        }
        Ok(())
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        let n = out.len();
        let hi: &[u16] = bytemuck::cast_slice(&r.elem[0][2 * at..2 * (at + n)]);
        let rem: &[u16] = bytemuck::cast_slice(&r.elem[1][2 * at..2 * (at + n)]);
        lanes::decode(hi, rem, out);
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], _random: Random) {
        let n = values.len();
        let [hi, rem, _] = &mut r.elem;
        let hi: &mut [u16] = bytemuck::cast_slice_mut(&mut hi[2 * at..2 * (at + n)]);
        let rem: &mut [u16] = bytemuck::cast_slice_mut(&mut rem[2 * at..2 * (at + n)]);
        lanes::encode(values, hi, rem);
    }

    fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
        let [hi, rem, _] = &mut r.elem;
        lanes::clear(
            bytemuck::cast_slice_mut(&mut hi[2 * at..2 * (at + len)]),
            bytemuck::cast_slice_mut(&mut rem[2 * at..2 * (at + len)]),
        );
    }
}

/// The format's values on the CPU, a run of elements at a time: its one decode, encode and
/// clear, which the generic chunk path (the [`Codec`] implementation above) and the specialized
/// step kernels (`crate::cpu::tile`, through [`Lanes::Split`]) both call.
pub(crate) mod lanes {
    /// Joins the bf16 halves `hi` and the remainders `rem` into `out` (exact).
    #[inline(always)]
    pub(crate) fn decode(hi: &[u16], rem: &[u16], out: &mut [f32]) {
        lpmm_formats::join_f32_slice(hi, rem, out);
    }

    /// Splits `values` into their bf16 halves `hi` and remainders `rem` (exact).
    #[inline(always)]
    pub(crate) fn encode(values: &[f32], hi: &mut [u16], rem: &mut [u16]) {
        lpmm_formats::split_f32_slice(values, hi, rem);
    }

    /// Zeroes both halves.
    #[inline(always)]
    pub(crate) fn clear(hi: &mut [u16], rem: &mut [u16]) {
        hi.fill(0);
        rem.fill(0);
    }
}
