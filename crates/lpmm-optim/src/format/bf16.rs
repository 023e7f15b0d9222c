//! bf16: 2 bytes per element, rounded to nearest even or stochastically ([docs/FORMATS.md] §2).
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use lpmm_formats::bf16;

use super::{
    Codec, Cover, Dtype, Extent, HostSlot, Lanes, Random, RegionSpec, Regions, RegionsMut,
    bf16_finite, u16s,
};
use super::{Storage, StoreRounding};
use crate::vocab::{SlotKind, TILE};

/// bf16 values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bf16 {
    rounding: StoreRounding,
}

#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))] // read by `testing`
const NEAREST: Storage = Storage::Bf16(StoreRounding::Nearest);
#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))] // read by `testing`
const STOCHASTIC: Storage = Storage::Bf16(StoreRounding::Stochastic);

const VALUES: RegionSpec = RegionSpec::new("", Dtype::Bf16, Extent::Elements { bits: 16 });

/// The largest f32 that does not round to ±Inf in bf16 (nearest: `0x7F7F8000` and above round
/// up to Inf; stochastic rounding falls back to nearest there, [docs/FORMATS.md] §2).
///
/// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
pub(crate) const BF16_LIMIT: u32 = 0x7F7F_7FFF;

impl Codec for Bf16 {
    const NAME: &'static str = "bf16";
    const COVER: Cover = Cover {
        params: &[NEAREST, STOCHASTIC],
        grads: &[NEAREST, STOCHASTIC],
        states: &[(NEAREST, NEAREST), (STOCHASTIC, STOCHASTIC)],
        ..Cover::NONE
    };
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
        lanes::decode(bytemuck::cast_slice(&r.elem[0][2 * at..2 * (at + n)]), out);
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], random: Random) {
        let n = values.len();
        let out: &mut [bf16] = bytemuck::cast_slice_mut(&mut r.elem[0][2 * at..2 * (at + n)]);
        match self.rounding {
            StoreRounding::Stochastic => {
                let mut draws = random.stream.draws_at(random.index);
                lanes::encode(values, out, Some((&mut draws, &mut [0; TILE])));
            }
            StoreRounding::Nearest => lanes::encode(values, out, None),
        }
    }

    fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
        lanes::clear(bytemuck::cast_slice_mut(
            &mut r.elem[0][2 * at..2 * (at + len)],
        ));
    }
}

/// The format's values on the CPU, a run of elements at a time: its one decode, encode and
/// clear, which the generic chunk path (the [`Codec`] implementation above, and Kahan's value)
/// and the specialized step kernels (`crate::cpu::tile`, through [`Lanes::Bf16`]) both call.
pub(crate) mod lanes {
    use lpmm_formats::{bf16, simd};
    use lpmm_quant::RandomDraws;

    use crate::vocab::TILE;

    /// Decodes `values` into `out` (exact).
    #[inline(always)]
    pub(crate) fn decode(values: &[bf16], out: &mut [f32]) {
        simd::bf16_to_f32(values, out);
    }

    /// Rounds `values` into `out`: to nearest even, or stochastically ([docs/FORMATS.md] §2)
    /// with `draws` (positioned at the run's first element; the array: scratch for a span's
    /// draws).
    ///
    /// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
    #[inline(always)]
    pub(crate) fn encode(
        values: &[f32],
        out: &mut [bf16],
        draws: Option<(&mut RandomDraws, &mut [u32; TILE])>,
    ) {
        match draws {
            Some((draws, words)) => {
                for (xs, out) in values.chunks(TILE).zip(out.chunks_mut(TILE)) {
                    let words = &mut words[..xs.len()];
                    draws.fill(words);
                    simd::f32_to_bf16_stochastic(xs, words, out);
                }
            }
            None => simd::f32_to_bf16_nearest(values, out),
        }
    }

    /// Zeroes `values`.
    #[inline(always)]
    pub(crate) fn clear(values: &mut [bf16]) {
        values.fill(bf16::ZERO);
    }
}
