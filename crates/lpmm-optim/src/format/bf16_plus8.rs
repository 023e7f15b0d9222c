//! bf16+8: 24-bit master weights, 3 bytes per element — a bf16 visible half that a bf16 forward
//! pass reads as the parameter, and an 8-bit correction of its rounding error (FlashOptim's
//! idea). The value is an f32 rounded to 24 bits (sign, 8 exponent bits, 15 mantissa bits: 256
//! times finer than bf16), to nearest even or stochastically, and split as split f32 splits an
//! f32 ([docs/FORMATS.md] §12). Parameters only.
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use super::{
    Codec, Cover, Dtype, Extent, HostSlot, Random, RegionSpec, Regions, RegionsMut, Storage,
    StoreRounding, fits, u16s,
};
use crate::vocab::SlotKind;

/// bf16 plus an 8-bit correction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bf16Plus8 {
    rounding: StoreRounding,
}

const HI: RegionSpec = RegionSpec::new("", Dtype::Bf16, Extent::Elements { bits: 16 });
const LO: RegionSpec = RegionSpec::new(".lo", Dtype::U8, Extent::Elements { bits: 8 });

/// The largest magnitude stored: the largest 24-bit value whose visible bf16 half is finite (from
/// `0x7F7F_8000` the half is ±Inf); a magnitude up to it rounds, either way, to at most itself.
const LIMIT: u32 = 0x7F7F_7F00;

/// `x` rounded to 24 bits: to nearest, ties to even, or up with probability `(bits & 0xFF) / 256`
/// when the top byte of `r` is below the discarded byte. NaN becomes a quiet NaN; nothing beyond
/// [`LIMIT`] is stored, so no rounding reaches ±Inf.
#[inline]
pub(crate) fn round24(x: f32, stochastic: bool, r: u32) -> u32 {
    let b = x.to_bits();
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        return (b | 0x0040_0000) & 0xFFFF_FF00;
    }
    let up = if stochastic {
        u32::from((r >> 24) < (b & 0xFF)) << 8
    } else {
        0x7F + ((b >> 8) & 1)
    };
    b.wrapping_add(up) & 0xFFFF_FF00
}

/// The visible bf16 half and the correction byte of a 24-bit value `w` (low byte zero): the half
/// is `w`'s top 16 bits rounded up when the byte is 0x80 or more, so it is a bf16 within half a
/// bf16 step of the value.
#[inline]
pub(crate) fn split24(w: u32) -> (u16, u8) {
    let lo = (w >> 8) & 0xFF;
    let hi = ((w >> 16) + u32::from(lo >= 0x80)) & 0xFFFF;
    (hi as u16, lo as u8)
}

/// The 24-bit value of a half and its correction byte, as an f32.
#[inline]
pub(crate) fn join24(hi: u16, lo: u8) -> f32 {
    let h = (u32::from(hi).wrapping_sub(u32::from(lo >= 0x80))) & 0xFFFF;
    f32::from_bits((h << 16) | (u32::from(lo) << 8))
}

impl Codec for Bf16Plus8 {
    const NAME: &'static str = "bf16_plus8";
    const COVER: Cover = Cover {
        params: &[Storage::Bf16Plus8(StoreRounding::Stochastic)],
        ..Cover::NONE
    };
    const LIMIT: u32 = LIMIT;

    fn from_storage(storage: Storage) -> Option<Self> {
        match storage {
            Storage::Bf16Plus8(rounding) => Some(Bf16Plus8 { rounding }),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        if self.stochastic() {
            "bf16+8-sr"
        } else {
            "bf16+8"
        }
        .into()
    }

    fn regions(&self, _shape: &[usize]) -> Vec<RegionSpec> {
        vec![HI, LO]
    }

    fn allowed(&self, slot: SlotKind) -> bool {
        slot == SlotKind::Param
    }

    fn stochastic(&self) -> bool {
        self.rounding == StoreRounding::Stochastic
    }

    fn lendable(&self) -> Option<Dtype> {
        Some(Dtype::Bf16)
    }

    fn kernel_aux(&self) -> u32 {
        u32::from(self.stochastic())
    }

    fn validate(&self, host: &HostSlot, values: bool) -> Result<(), String> {
        let lo = &host.regions[1].bytes;
        let within = u16s(&host.regions[0].bytes)
            .zip(lo.iter())
            .all(|(hi, &lo)| fits(join24(hi, lo), LIMIT));
        if values && !within {
            return Err(
                "holds a non-finite value, or one whose visible bf16 half is ±Inf or not its value's"
                    .into(),
            );
        }
        // A half and byte that no 24-bit value splits into (the byte's rounding of the half
        // undone wrongly) would read back as another value: refused as corrupt.
        let canonical = u16s(&host.regions[0].bytes)
            .zip(lo.iter())
            .all(|(hi, &lo)| split24(join24(hi, lo).to_bits()) == (hi, lo));
        if !canonical {
            return Err("a bf16 half and its correction byte do not form a 24-bit value".into());
        }
        Ok(())
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        let n = out.len();
        let hi: &[u16] = bytemuck::cast_slice(&r.elem[0][2 * at..2 * (at + n)]);
        let lo = &r.elem[1][at..at + n];
        for ((o, &h), &l) in out.iter_mut().zip(hi).zip(lo) {
            *o = join24(h, l);
        }
    }

    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], random: Random) {
        let n = values.len();
        let [hi, lo, _] = &mut r.elem;
        let hi: &mut [u16] = bytemuck::cast_slice_mut(&mut hi[2 * at..2 * (at + n)]);
        let lo = &mut lo[at..at + n];
        let mut put = |k: usize, x: f32, word: u32| {
            let (h, l) = split24(round24(x, self.stochastic(), word));
            hi[k] = h;
            lo[k] = l;
        };
        if self.stochastic() {
            let mut draws = random.stream.draws_at(random.index);
            let mut words = [0u32; 256];
            for (c, xs) in values.chunks(words.len()).enumerate() {
                let words = &mut words[..xs.len()];
                draws.fill(words);
                for (k, (&x, &w)) in xs.iter().zip(words.iter()).enumerate() {
                    put(c * 256 + k, x, w);
                }
            }
        } else {
            for (k, &x) in values.iter().enumerate() {
                put(k, x, 0);
            }
        }
    }

    fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
        r.elem[0][2 * at..2 * (at + len)].fill(0);
        r.elem[1][at..at + len].fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_24_bit_value_splits_and_joins_exactly() {
        // Every sign, exponent and 15-bit mantissa would be 2^24 values: walk a stride that
        // visits every byte value and every half's low bits, plus the edges.
        let mut seen = 0;
        for top in (0u32..=0xFFFF)
            .step_by(7)
            .chain([0x7F7F, 0xFF7F, 0x0000, 0x8000])
        {
            for byte in 0u32..=0xFF {
                let w = (top << 16) | (byte << 8);
                let x = f32::from_bits(w);
                if !fits(x, LIMIT) {
                    continue;
                }
                let (h, l) = split24(w);
                assert_eq!(join24(h, l).to_bits(), w, "{w:#010x}");
                assert_eq!(round24(x, false, 0), w, "24-bit values round to themselves");
                assert_eq!(round24(x, true, 0xFFFF_FFFF), w);
                seen += 1;
            }
        }
        assert!(seen > 2_000_000);
    }

    #[test]
    fn nearest_is_ties_to_even_and_stochastic_is_unbiased() {
        let base = 1.0f32.to_bits(); // 0x3F800000: its 24-bit neighbours are 0x100 apart
        let at = |low: u32| f32::from_bits(base + low);
        assert_eq!(round24(at(0x7F), false, 0), base);
        assert_eq!(round24(at(0x80), false, 0), base, "tie to even (down)");
        assert_eq!(
            round24(at(0x180), false, 0),
            base + 0x200,
            "tie to even (up)"
        );
        assert_eq!(round24(at(0x81), false, 0), base + 0x100);
        // Stochastic: up exactly when the top byte of the word is below the discarded byte.
        let ups = (0u32..256)
            .filter(|&t| round24(at(0x40), true, t << 24) != base)
            .count();
        assert_eq!(ups, 0x40, "P(up) = 0x40 / 256");
        // Every magnitude up to the limit keeps its visible half finite both ways; one above
        // it does not.
        for bits in [LIMIT, LIMIT - 1, LIMIT - 0x80, 0x7F7F_7E01] {
            for (stochastic, r) in [(false, 0), (true, 0), (true, u32::MAX)] {
                let w = round24(f32::from_bits(bits), stochastic, r);
                assert_ne!(split24(w).0 & 0x7F80, 0x7F80, "{bits:#x} -> {w:#x}");
            }
        }
        assert_eq!(
            split24(round24(f32::from_bits(LIMIT + 1), true, 0)).0,
            0x7F80
        );
    }

    #[test]
    fn the_visible_half_is_within_half_a_bf16_step() {
        for w in [
            0x3F80_7F00u32,
            0x3F80_8000,
            0x3F80_FF00,
            0xBF80_8100,
            0x0000_8000,
        ] {
            let (h, _) = split24(w);
            let half = f32::from_bits(u32::from(h) << 16);
            let x = f32::from_bits(w);
            let step =
                f32::from_bits((w & 0xFFFF_0000) + 0x1_0000) - f32::from_bits(w & 0xFFFF_0000);
            assert!(
                (half - x).abs() <= step.abs() / 2.0,
                "{w:#x}: {half} vs {x}"
            );
        }
    }
}
