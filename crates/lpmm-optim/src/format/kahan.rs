//! bf16 plus a bf16 Kahan compensation: 4 bytes per element; updates are added as increments so
//! decay and steps below half an ulp are not lost (docs/FORMATS.md §10). Parameters only.

use lpmm_formats::{bf16, float, kahan_add, simd};

use super::{
    Codec, Dtype, Extent, HostSlot, Random, RegionSpec, Regions, RegionsMut, bf16_finite, u16s,
};
use crate::backend::SlotKind;
use crate::config::Storage;

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

impl Codec for Kahan {
    const NAME: &'static str = "kahan";

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
        Ok(())
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        // The parameter a model sees is the bf16 value; the compensation only feeds updates.
        let n = out.len();
        simd::bf16_to_f32(bytemuck::cast_slice(&r.elem[0][2 * at..2 * (at + n)]), out);
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
