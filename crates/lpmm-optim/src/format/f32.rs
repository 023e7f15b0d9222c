//! f32: 4 bytes per element, the reference storage.

use super::Storage;
use super::{
    Codec, Cover, Dtype, Extent, HostSlot, Lanes, Random, RegionSpec, Regions, RegionsMut, f32s,
};
use crate::vocab::SlotKind;

/// f32 values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct F32;

const VALUES: RegionSpec = RegionSpec::new("", Dtype::F32, Extent::Elements { bits: 32 });

impl Codec for F32 {
    const NAME: &'static str = "f32";
    const COVER: Cover = Cover {
        params: &[Storage::F32],
        grads: &[Storage::F32],
        states: &[(Storage::F32, Storage::F32)],
        ..Cover::NONE
    };

    fn from_storage(storage: Storage) -> Option<Self> {
        (storage == Storage::F32).then_some(F32)
    }

    fn describe(&self) -> String {
        "f32".into()
    }

    fn regions(&self, _shape: &[usize]) -> Vec<RegionSpec> {
        vec![VALUES]
    }

    fn allowed(&self, _slot: SlotKind) -> bool {
        true
    }

    fn lendable(&self) -> Option<Dtype> {
        Some(Dtype::F32)
    }

    fn holds_non_finite(&self) -> bool {
        true
    }

    fn plain_f32(&self) -> bool {
        true
    }

    fn lanes(&self) -> Option<Lanes> {
        Some(Lanes::F32)
    }

    fn validate(&self, host: &HostSlot, values: bool) -> Result<(), String> {
        if values && !f32s(&host.regions[0].bytes).all(f32::is_finite) {
            return Err("holds a non-finite value".into());
        }
        Ok(())
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        let n = out.len();
        lanes::decode(bytemuck::cast_slice(&r.elem[0][4 * at..4 * (at + n)]), out);
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], _random: Random) {
        let n = values.len();
        lanes::encode(
            values,
            bytemuck::cast_slice_mut(&mut r.elem[0][4 * at..4 * (at + n)]),
        );
    }

    fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
        lanes::clear(bytemuck::cast_slice_mut(
            &mut r.elem[0][4 * at..4 * (at + len)],
        ));
    }
}

/// The format's values on the CPU, a run of elements at a time: its one decode, encode and
/// clear (copies: the values are stored as they are), which the generic chunk path (the
/// [`Codec`] implementation above) and the specialized step kernels (`crate::cpu::tile`, through
/// [`Lanes::F32`], where a slot stored as f32 is also stepped in place) both call.
pub(crate) mod lanes {
    /// Decodes `values` into `out`.
    #[inline(always)]
    pub(crate) fn decode(values: &[f32], out: &mut [f32]) {
        out.copy_from_slice(values);
    }

    /// Stores `values` into `out`.
    #[inline(always)]
    pub(crate) fn encode(values: &[f32], out: &mut [f32]) {
        out.copy_from_slice(values);
    }

    /// Zeroes `values`.
    #[inline(always)]
    pub(crate) fn clear(values: &mut [f32]) {
        values.fill(0.0);
    }
}
