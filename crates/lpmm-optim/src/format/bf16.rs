//! bf16: 2 bytes per element, rounded to nearest even or stochastically ([docs/FORMATS.md] §2).
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use lpmm_formats::{bf16, simd};

use super::{
    Codec, Dtype, Extent, HostSlot, Lanes, Random, RegionSpec, Regions, RegionsMut, bf16_finite,
    u16s,
};
use super::{Storage, StoreRounding};
use crate::vocab::SlotKind;

/// bf16 values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bf16 {
    rounding: StoreRounding,
}

const VALUES: RegionSpec = RegionSpec::new("", Dtype::Bf16, Extent::Elements { bits: 16 });

/// The largest f32 that does not round to ±Inf in bf16 (nearest: `0x7F7F8000` and above round
/// up to Inf; stochastic rounding falls back to nearest there, [docs/FORMATS.md] §2).
///
/// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
pub(crate) const BF16_LIMIT: u32 = 0x7F7F_7FFF;

impl Codec for Bf16 {
    const NAME: &'static str = "bf16";
    const LIMIT: u32 = BF16_LIMIT;

    fn from_storage(storage: Storage) -> Option<Self> {
        match storage {
            Storage::Bf16(rounding) => Some(Bf16 { rounding }),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        if self.stochastic() { "bf16-sr" } else { "bf16" }.into()
    }

    fn regions(&self, _shape: &[usize]) -> Vec<RegionSpec> {
        vec![VALUES]
    }

    fn allowed(&self, _slot: SlotKind) -> bool {
        true
    }

    fn stochastic(&self) -> bool {
        self.rounding == StoreRounding::Stochastic
    }

    fn lendable(&self) -> Option<Dtype> {
        Some(Dtype::Bf16)
    }

    fn holds_non_finite(&self) -> bool {
        true
    }

    fn kernel_aux(&self) -> u32 {
        u32::from(self.stochastic())
    }

    fn lanes(&self) -> Option<Lanes> {
        Some(Lanes::Bf16 {
            stochastic: self.stochastic(),
        })
    }

    fn validate(&self, host: &HostSlot, values: bool) -> Result<(), String> {
        if values && !u16s(&host.regions[0].bytes).all(bf16_finite) {
            return Err("holds a non-finite value".into());
        }
        Ok(())
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        let n = out.len();
        simd::bf16_to_f32(bytemuck::cast_slice(&r.elem[0][2 * at..2 * (at + n)]), out);
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], random: Random) {
        let n = values.len();
        let out: &mut [bf16] = bytemuck::cast_slice_mut(&mut r.elem[0][2 * at..2 * (at + n)]);
        match self.rounding {
            StoreRounding::Stochastic => {
                let mut draws = random.stream.draws_at(random.index);
                let mut words = [0u32; 256];
                for (xs, out) in values.chunks(words.len()).zip(out.chunks_mut(words.len())) {
                    let words = &mut words[..xs.len()];
                    draws.fill(words);
                    simd::f32_to_bf16_stochastic(xs, words, out);
                }
            }
            StoreRounding::Nearest => simd::f32_to_bf16_nearest(values, out),
        }
    }

    fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
        r.elem[0][2 * at..2 * (at + len)].fill(0);
    }
}
