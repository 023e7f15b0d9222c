//! bf16 plus a bf16 Kahan compensation: 4 bytes per element; updates are added as increments so
//! decay and steps below half an ulp are not lost ([docs/FORMATS.md] §10). Parameters only.
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use lpmm_formats::{bf16, float, kahan_add};

use super::Storage;
use super::{
    Codec, Cover, Dtype, Extent, HostSlot, Random, RegionSpec, Regions, RegionsMut, bf16_finite,
    u16s,
};
use crate::vocab::SlotKind;

/// Kahan-compensated bf16.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Kahan;

const VALUE: RegionSpec = RegionSpec::new("", Dtype::Bf16, Extent::Elements { bits: 16 });
const COMP: RegionSpec = RegionSpec::new(".comp", Dtype::Bf16, Extent::Elements { bits: 16 });

fn pair<'a>(r: &'a mut RegionsMut<'_>, at: usize, n: usize) -> (&'a mut [bf16], &'a mut [bf16]) {
    let [value, comp, _] = &mut r.elem;
    (
        bytemuck::cast_slice_mut(&mut value[2 * at..2 * (at + n)]),
        bytemuck::cast_slice_mut(&mut comp[2 * at..2 * (at + n)]),
    )
}

/// The compensation's headroom: every value a step stores is at most [`Kahan::LIMIT`] = 2^127,
/// and a compensation is the bf16 rounding error of its value, at most half a bf16 ulp (2^119)
/// however large the value. So `value + (comp + delta)` for any update whose result is within the
/// limit, and `value + comp` for an element left unchanged, stay far below bf16's overflow
/// threshold (2^128 - 2^119): the increment path never rounds to ±Inf. A loaded slot must keep
/// these bounds (a value at most 2^127 + 2^120, one bf16 ulp above the limit; a compensation at
/// most 2^119).
const VALUE_MAX: u16 = 0x7F01;
const COMP_MAX: u16 = 0x7B00;

impl Codec for Kahan {
    const NAME: &'static str = "kahan";
    const COVER: Cover = Cover {
        params: &[Storage::Bf16Kahan],
        ..Cover::NONE
    };
    /// 2^127: half of bf16's range, the rest is the compensation's headroom (see `VALUE_MAX`).
    const LIMIT: u32 = 0x7F00_0000;

    fn from_storage(storage: Storage) -> Option<Self> {
        (storage == Storage::Bf16Kahan).then_some(Kahan)
    }

    fn describe(&self) -> String {
        "bf16+kahan".into()
    }

    fn regions(&self, _shape: &[usize]) -> Vec<RegionSpec> {
        vec![VALUE, COMP]
    }

    fn allowed(&self, slot: SlotKind) -> bool {
        slot == SlotKind::Param
    }

    fn lendable(&self) -> Option<Dtype> {
        Some(Dtype::Bf16)
    }

    fn validate(&self, host: &HostSlot, values: bool) -> Result<(), String> {
        let finite = host.regions.iter().all(|r| u16s(&r.bytes).all(bf16_finite));
        if values && !finite {
            return Err("holds a non-finite value".into());
        }
        let within = |r: usize, max: u16| u16s(&host.regions[r].bytes).all(|h| h & 0x7FFF <= max);
        if values && !(within(0, VALUE_MAX) && within(1, COMP_MAX)) {
            return Err(
                "holds a value above 2^127 + 2^120 or a compensation above 2^119 (a step could overflow)"
                    .into(),
            );
        }
        Ok(())
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        // The parameter a model sees is the bf16 value; the compensation only feeds updates.
        let n = out.len();
        super::bf16::lanes::decode(bytemuck::cast_slice(&r.elem[0][2 * at..2 * (at + n)]), out);
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], _random: Random) {
        // (Re-)initialisation: the value itself, no compensation beyond its rounding.
        let (value, comp) = pair(r, at, values.len());
        for ((v, c), &x) in value.iter_mut().zip(comp.iter_mut()).zip(values) {
            *v = float::bf16_nearest(x);
            *c = float::bf16_nearest(x - v.to_f32());
        }
    }

    fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
        r.elem[0][2 * at..2 * (at + len)].fill(0);
        r.elem[1][2 * at..2 * (at + len)].fill(0);
    }

    fn add(&self, r: &mut RegionsMut<'_>, at: usize, d: &[f32]) -> bool {
        let (value, comp) = pair(r, at, d.len());
        for ((v, c), &x) in value.iter_mut().zip(comp.iter_mut()).zip(d) {
            kahan_add(v, c, x);
        }
        true
    }
}
