//! Master weights without an f32 copy: split f32 (bf16 + 16-bit remainder) and Kahan-compensated
//! bf16 addition.

use half::bf16;

use crate::float::bf16_nearest;

/// An f32 stored as a bf16 "visible" half plus a 16-bit remainder, TransformerEngine's
/// `store_param_remainders` layout (round-to-nearest variant). The bf16 half is what a forward pass
/// reads: it equals round-to-nearest(x) except at exact ties, which it rounds away from zero.
/// Together the two halves hold every non-NaN f32 bit pattern losslessly; a NaN is stored as the
/// quiet NaN with its sign (`0x7FC00000` / `0xFFC00000`), so the visible half of a NaN is a NaN
/// too (without this, the carry of `0x7FFF8000` would wrap the visible half to -0.0).
///
/// Split: `hi = bits >> 16; rem = bits & 0xFFFF; if rem as i16 < 0 { hi += 1 }`.
/// Join: `if rem as i16 < 0 { hi -= 1 }; bits = hi << 16 | rem` (wrapping, 16-bit).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SplitF32 {
    /// The visible bf16 half.
    pub hi: bf16,
    /// The low 16 bits of the f32, read as a signed correction to `hi`.
    pub rem: u16,
}

impl SplitF32 {
    /// Splits `x`.
    #[inline]
    pub fn from_f32(x: f32) -> Self {
        let bits = if x.is_nan() {
            x.to_bits() & 0x8000_0000 | 0x7FC0_0000
        } else {
            x.to_bits()
        };
        let rem = bits as u16;
        let hi = ((bits >> 16) as u16).wrapping_add(u16::from((rem as i16) < 0));
        Self {
            hi: bf16::from_bits(hi),
            rem,
        }
    }

    /// Joins the halves back into the f32 they were split from.
    #[inline]
    pub fn to_f32(self) -> f32 {
        let hi = self
            .hi
            .to_bits()
            .wrapping_sub(u16::from((self.rem as i16) < 0));
        f32::from_bits(u32::from(hi) << 16 | u32::from(self.rem))
    }
}

crate::multiversion! {
    /// [`SplitF32::from_f32`] of each value: the visible halves' bf16 bit patterns into `hi`,
    /// the remainders into `rem`. Writes `min(values.len(), hi.len(), rem.len())` pairs.
    /// Branch-free (the NaN case is a select), so that it vectorizes.
    pub fn split_f32_slice(values: &[f32], hi: &mut [u16], rem: &mut [u16]) {
        for ((h, r), &x) in hi.iter_mut().zip(rem.iter_mut()).zip(values) {
            let bits = x.to_bits();
            let nan = bits & 0x7FFF_FFFF > 0x7F80_0000;
            let bits = if nan { bits & 0x8000_0000 | 0x7FC0_0000 } else { bits };
            let low = bits as u16;
            *r = low;
            *h = ((bits >> 16) as u16).wrapping_add(low >> 15);
        }
    }
}

crate::multiversion! {
    /// [`SplitF32::to_f32`] of each pair (`hi` as bf16 bit patterns) into `out`. Writes
    /// `min(hi.len(), rem.len(), out.len())` values.
    pub fn join_f32_slice(hi: &[u16], rem: &[u16], out: &mut [f32]) {
        for ((o, &h), &r) in out.iter_mut().zip(hi).zip(rem) {
            let h = h.wrapping_sub(r >> 15);
            *o = f32::from_bits(u32::from(h) << 16 | u32::from(r));
        }
    }
}

/// Adds `delta` to a bf16 value with a bf16 Kahan compensation term (optimi's `kahan_sum`):
/// `c = compensation + delta; new = bf16(value + c); compensation = bf16(c + (value - new))`,
/// all in f32 with round-to-nearest-even to bf16. The compensation carries the part of the sum
/// that the bf16 value cannot hold, so small updates accumulate instead of vanishing.
/// Fold weight decay into `delta` (optimi applies it outside and loses it for `lr*wd <= 1e-3`).
#[inline]
pub fn kahan_add(value: &mut bf16, compensation: &mut bf16, delta: f32) {
    let c = compensation.to_f32() + delta;
    let old = value.to_f32();
    let new = bf16_nearest(old + c);
    // `old - new` is exact: both are bf16 values within a few ulps of each other.
    *compensation = bf16_nearest(c + (old - new.to_f32()));
    *value = new;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_half_is_round_to_nearest_except_ties() {
        for bits in (0..=u32::MAX).step_by(65_521) {
            let x = f32::from_bits(bits);
            if !x.is_finite() {
                continue;
            }
            let s = SplitF32::from_f32(x);
            if bits & 0xFFFF != 0x8000 {
                assert_eq!(s.hi.to_bits(), bf16_nearest(x).to_bits(), "{bits:#x}");
            }
        }
    }

    /// The slice functions are the scalar split and join, bit for bit, at every SIMD level: a
    /// sweep over f32 bit patterns (NaNs of both signs and any payload, infinities, subnormals,
    /// remainders on both sides of the carry) and every 16-bit pair.
    #[test]
    fn slices_equal_the_scalar_split_and_join() {
        use crate::simd::{Level, force};
        let mut values: Vec<f32> = (0..=u32::MAX).step_by(4_099).map(f32::from_bits).collect();
        values.extend(
            [
                0x7F80_0001,
                0xFFFF_FFFF,
                0x7FFF_8000,
                0x3F80_8000,
                0x3F80_7FFF,
            ]
            .map(f32::from_bits),
        );
        let pairs: Vec<(u16, u16)> = (0..=u32::MAX)
            .step_by(257)
            .map(|b| ((b >> 16) as u16, b as u16))
            .collect();
        for level in Level::ALL {
            force(Some(level));
            let (mut hi, mut rem) = (vec![0u16; values.len()], vec![0u16; values.len()]);
            split_f32_slice(&values, &mut hi, &mut rem);
            for (k, &x) in values.iter().enumerate() {
                let s = SplitF32::from_f32(x);
                assert_eq!(
                    (hi[k], rem[k]),
                    (s.hi.to_bits(), s.rem),
                    "{:#x} {level:?}",
                    x.to_bits()
                );
            }
            let (h, r): (Vec<u16>, Vec<u16>) = pairs.iter().copied().unzip();
            let mut out = vec![0f32; pairs.len()];
            join_f32_slice(&h, &r, &mut out);
            for (k, &(h, r)) in pairs.iter().enumerate() {
                let want = SplitF32 {
                    hi: bf16::from_bits(h),
                    rem: r,
                }
                .to_f32();
                assert_eq!(out[k].to_bits(), want.to_bits(), "{h:#x} {r:#x} {level:?}");
            }
        }
        force(None);
    }

    #[test]
    fn kahan_accumulates_updates_far_below_half_an_ulp() {
        let (mut value, mut comp) = (bf16::from_f32(1.0), bf16::ZERO);
        let mut naive = bf16::from_f32(1.0);
        let delta = 1e-4f32; // bf16 ulp at 1.0 is 2^-7 = 7.8e-3: 1e-4 is 1/78 of it
        for _ in 0..10_000 {
            kahan_add(&mut value, &mut comp, delta);
            naive = bf16_nearest(naive.to_f32() + delta);
        }
        let exact = 1.0 + 10_000.0 * 1e-4;
        assert_eq!(naive.to_f32(), 1.0, "round-to-nearest drops every update");
        // The bf16 compensation itself rounds (its ulp near half a value ulp is 1.5e-5, against
        // increments of 1e-4), so Kahan keeps the sum to within a few percent of the total update
        // (measured: 2.026 for 2.0) where round-to-nearest loses all of it.
        let kahan = value.to_f32() + comp.to_f32();
        assert!(
            (kahan - exact).abs() < 0.05 * (exact - 1.0),
            "kahan {kahan} vs {exact}"
        );
    }
}
