//! Rounding f32 onto narrower binary floating-point grids: bf16, f16 and the fp8 formats.
//!
//! One routine, `round_to_grid`, defines round-to-nearest-even and stochastic rounding for every
//! format narrower than f32, in integer arithmetic on the f32 bit pattern, so a WGSL or CUDA
//! kernel can reproduce it bit for bit ([docs/FORMATS.md], "Rounding"). bf16 has a fast path that
//! is tested equal to it; f16 round-to-nearest uses the `half` crate, also tested equal to it.
//!
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use half::{bf16, f16};

/// How a value is rounded onto a coarser grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// Round to the nearest representable value; exact ties go to the even significand.
    NearestEven,
    /// Round to one of the two neighbours `lo <= |x| < hi` (by magnitude): away from zero iff
    /// `bits < floor(frac * 2^32)`, where `frac = (|x| - lo) / (hi - lo)`. With uniformly
    /// distributed `bits` the result is unbiased: `E[round(x)] = x` (up to 2^-32 of a grid step).
    Stochastic(u32),
}

/// A binary floating-point grid narrower than f32: `mantissa_bits` explicit significand bits and
/// normal numbers down to `2^min_normal_exp` (subnormals below, with spacing
/// `2^(min_normal_exp - mantissa_bits)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grid {
    pub mantissa_bits: u32,
    pub min_normal_exp: i32,
}

#[cfg(test)]
pub(crate) const BF16_GRID: Grid = Grid {
    mantissa_bits: 7,
    min_normal_exp: -126,
};
pub(crate) const F16_GRID: Grid = Grid {
    mantissa_bits: 10,
    min_normal_exp: -14,
};

/// `2^e` as an f32, exact for `-149 <= e <= 127`.
pub(crate) fn pow2(e: i32) -> f32 {
    debug_assert!((-149..=127).contains(&e));
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

/// Rounds the magnitude `abs_bits` (the bit pattern of a finite, non-negative f32) onto `grid`,
/// with no upper exponent limit (the caller handles overflow). Returns the rounded magnitude,
/// which is exactly representable in f32 for every grid used here (their smallest step is
/// `>= 2^-149`).
///
/// Definition ([docs/FORMATS.md]): write `|x| = M * 2^(e - 23)` with the 24-bit integer significand
/// `M` (f32 subnormals: `e = -126`, no hidden bit). The grid step at `x` is
/// `2^s`, `s = max(e, min_normal_exp) - mantissa_bits`, so `d = s - (e - 23)` low bits of `M`
/// are dropped: `q = M >> d`, `rem = M mod 2^d`. Nearest-even rounds `q` up iff `rem > 2^(d-1)`
/// or (`rem == 2^(d-1)` and `q` is odd). Stochastic rounds `q` up iff
/// `bits < F`, `F = floor(rem * 2^(32 - d))` (that is `rem << (32 - d)` for `d <= 32`,
/// `rem >> (d - 32)` otherwise). The result is `q * 2^s`.
///
/// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
pub(crate) fn round_to_grid(abs_bits: u32, grid: Grid, rounding: Rounding) -> f32 {
    let e_field = (abs_bits >> 23) as i32;
    let hidden = if e_field != 0 { 1u32 << 23 } else { 0 };
    let m = u64::from((abs_bits & 0x007F_FFFF) | hidden);
    let e = e_field.max(1) - 127;
    let s = e.max(grid.min_normal_exp) - grid.mantissa_bits as i32;
    let d = (s - (e - 23)) as u32; // >= 23 - mantissa_bits > 0
    // M < 2^24, so for d >= 25 the quotient is 0 and the remainder is M itself.
    let (q, rem) = if d >= 25 {
        (0, m)
    } else {
        (m >> d, m & ((1u64 << d) - 1))
    };
    let up = match rounding {
        Rounding::NearestEven => {
            if d >= 26 {
                false // rem < 2^24 <= 2^(d-2) < half a step
            } else {
                let half = 1u64 << (d - 1);
                rem > half || (rem == half && q & 1 == 1)
            }
        }
        Rounding::Stochastic(bits) => {
            let threshold = if d <= 32 {
                rem << (32 - d)
            } else if d - 32 < 64 {
                rem >> (d - 32)
            } else {
                0
            };
            u64::from(bits) < threshold
        }
    };
    let q = q + u64::from(up);
    // q <= 2^24 and s >= -149 for every grid here, so the product is exact.
    q as f32 * pow2(s)
}

/// f32 -> bf16 rounding to nearest, ties to even. NaN stays NaN (quieted, sign kept), ±Inf stays
/// ±Inf, and finite values at or above `bf16::MAX + half an ulp` become ±Inf (IEEE overflow).
#[inline]
pub fn bf16_nearest(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// f32 -> bf16 with stochastic rounding: away from zero iff `(bits >> 16) < (x.to_bits() & 0xFFFF)`,
/// so only the high 16 of the caller's random bits matter. Unbiased for finite `x`. NaN and
/// ±Inf pass through as for [`bf16_nearest`]; a finite value becomes ±Inf only where
/// [`bf16_nearest`] would overflow too.
#[inline]
pub fn bf16_stochastic(x: f32, bits: u32) -> bf16 {
    let b = x.to_bits();
    if b & 0x7FFF_FFFF >= 0x7F80_0000 {
        return bf16::from_f32(x);
    }
    let up = (bits >> 16) < (b & 0xFFFF);
    let r = (b >> 16) + u32::from(up);
    if r & 0x7FFF == 0x7F80 {
        // Rounded up past bf16::MAX: keep what round-to-nearest gives (MAX, or Inf if it overflows).
        return bf16::from_f32(x);
    }
    bf16::from_bits(r as u16)
}

/// f32 -> bf16 with the given rounding.
#[inline]
pub fn to_bf16(x: f32, rounding: Rounding) -> bf16 {
    match rounding {
        Rounding::NearestEven => bf16_nearest(x),
        Rounding::Stochastic(bits) => bf16_stochastic(x, bits),
    }
}

/// f32 -> f16 rounding to nearest, ties to even (IEEE; overflow to ±Inf, NaN stays NaN).
#[inline]
pub fn f16_nearest(x: f32) -> f16 {
    f16::from_f32(x)
}

/// f32 -> f16 with stochastic rounding (the rule of [`Rounding::Stochastic`], including the f16
/// subnormal range where more than 13 bits are dropped). NaN and ±Inf pass through; a finite
/// value becomes ±Inf only where [`f16_nearest`] would overflow too.
pub fn f16_stochastic(x: f32, bits: u32) -> f16 {
    let b = x.to_bits();
    if b & 0x7FFF_FFFF >= 0x7F80_0000 {
        return f16::from_f32(x);
    }
    let magnitude = round_to_grid(b & 0x7FFF_FFFF, F16_GRID, Rounding::Stochastic(bits));
    if magnitude > f16::MAX.to_f32() {
        return f16::from_f32(x);
    }
    let signed = if b >> 31 == 1 { -magnitude } else { magnitude };
    // `signed` lies on the f16 grid, so this conversion is exact.
    f16::from_f32(signed)
}

/// f32 -> f16 with the given rounding.
#[inline]
pub fn to_f16(x: f32, rounding: Rounding) -> f16 {
    match rounding {
        Rounding::NearestEven => f16_nearest(x),
        Rounding::Stochastic(bits) => f16_stochastic(x, bits),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cheap deterministic sweep over f32 bit patterns (every 4093rd), plus edge values.
    fn sweep() -> impl Iterator<Item = u32> {
        (0..=u32::MAX / 4093).map(|i| i.wrapping_mul(4093)).chain([
            0x7F7F_FFFF,
            0x7F7F_8000,
            0x7F7F_7FFF,
            0x0000_0001,
            0x477F_F000,
            0x477F_EFFF,
        ])
    }

    #[test]
    fn bf16_nearest_equals_the_generic_grid_rounding() {
        for b in sweep() {
            let x = f32::from_bits(b);
            if !x.is_finite() {
                continue;
            }
            let g = round_to_grid(b & 0x7FFF_FFFF, BF16_GRID, Rounding::NearestEven);
            let want = bf16_nearest(x).to_f32().abs();
            assert_eq!(g.to_bits(), want.to_bits(), "{b:#010x}");
        }
    }

    #[test]
    fn bf16_stochastic_fast_path_equals_the_generic_grid_rounding() {
        for (k, b) in sweep().enumerate() {
            let x = f32::from_bits(b);
            if !x.is_finite() {
                continue;
            }
            let bits = (k as u32).wrapping_mul(0x9E37_79B9);
            let g = round_to_grid(b & 0x7FFF_FFFF, BF16_GRID, Rounding::Stochastic(bits));
            let fast = bf16_stochastic(x, bits).to_f32().abs();
            if g > bf16::MAX.to_f32() {
                assert_eq!(fast.to_bits(), bf16_nearest(x).to_f32().abs().to_bits());
            } else {
                assert_eq!(g.to_bits(), fast.to_bits(), "{b:#010x} bits {bits:#x}");
            }
        }
    }

    #[test]
    fn f16_nearest_equals_the_generic_grid_rounding() {
        for b in sweep() {
            let x = f32::from_bits(b);
            let want = f16_nearest(x).to_f32().abs();
            if !x.is_finite() || !want.is_finite() {
                continue;
            }
            let g = round_to_grid(b & 0x7FFF_FFFF, F16_GRID, Rounding::NearestEven);
            assert_eq!(g.to_bits(), want.to_bits(), "{b:#010x}");
        }
    }

    #[test]
    fn stochastic_rounding_never_overflows_where_nearest_does_not() {
        for bits in [0u32, 1, u32::MAX / 2, u32::MAX] {
            // Just below the point where nearest-even overflows.
            assert!(
                bf16_stochastic(f32::from_bits(0x7F7F_7FFF), bits)
                    .to_f32()
                    .is_finite()
            );
            assert!(f16_stochastic(65519.0, bits).to_f32().is_finite());
            assert!(f16_stochastic(-65519.0, bits).to_f32().is_finite());
        }
        // Where nearest overflows, stochastic may overflow too.
        assert!(f16_stochastic(65520.0, 0).to_f32().is_infinite());
    }

    #[test]
    fn nan_and_infinity_pass_through() {
        for bits in [0u32, u32::MAX] {
            assert!(bf16_stochastic(f32::NAN, bits).is_nan());
            assert!(f16_stochastic(f32::NAN, bits).is_nan());
            assert_eq!(
                bf16_stochastic(f32::NEG_INFINITY, bits).to_f32(),
                f32::NEG_INFINITY
            );
            assert_eq!(f16_stochastic(f32::INFINITY, bits).to_f32(), f32::INFINITY);
        }
    }

    #[test]
    fn stochastic_rounding_keeps_the_sign_of_zero_and_tiny_values() {
        assert_eq!(bf16_stochastic(-0.0, u32::MAX).to_bits(), 0x8000);
        // 2^-30 is far below f16's smallest subnormal (2^-24): 0 or 2^-24, never negative.
        let tiny = pow2(-30);
        assert_eq!(f16_stochastic(-tiny, u32::MAX).to_bits(), 0x8000);
        assert_eq!(f16_stochastic(-tiny, 0).to_f32(), -pow2(-24));
    }
}
