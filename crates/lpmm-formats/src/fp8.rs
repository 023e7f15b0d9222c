//! The two 8-bit floating-point formats of the OCP FP8 specification (and of torch, torchao and
//! TransformerEngine): E4M3FN (no infinities, NaN = S.1111.111, max 448) and E5M2 (IEEE-like, max
//! 57344).

use crate::FormatError;
use crate::float::{Grid, Rounding, pow2, round_to_grid};

/// An 8-bit floating-point format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8 {
    /// 4 exponent bits (bias 7), 3 mantissa bits, finite only: max 448, NaN = `0x7F`/`0xFF`.
    E4M3Fn,
    /// 5 exponent bits (bias 15), 2 mantissa bits, IEEE: max 57344, ±Inf = `0x7C`/`0xFC`, NaN
    /// = exponent 31 with a non-zero mantissa.
    E5M2,
}

/// What happens to finite values beyond the largest finite code when encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// Clamp to ±max finite; ±Inf inputs become ±max finite too (NaN stays NaN). This is what
    /// torch 2.15's `x.to(torch.float8_e4m3fn)` does (tested against it).
    Saturate,
    /// IEEE behaviour: values that round beyond max become ±Inf (E5M2; torch's
    /// `x.to(torch.float8_e5m2)`, tested) or NaN (E4M3FN, which has no infinity: the OCP
    /// specification's non-saturating mode).
    NonSaturating,
}

impl Fp8 {
    /// Every format this module knows, for tests and tables.
    pub const ALL: [Fp8; 2] = [Fp8::E4M3Fn, Fp8::E5M2];

    const fn grid(self) -> Grid {
        match self {
            Fp8::E4M3Fn => Grid {
                mantissa_bits: 3,
                min_normal_exp: -6,
            },
            Fp8::E5M2 => Grid {
                mantissa_bits: 2,
                min_normal_exp: -14,
            },
        }
    }

    const fn bias(self) -> i32 {
        match self {
            Fp8::E4M3Fn => 7,
            Fp8::E5M2 => 15,
        }
    }

    /// The largest finite value.
    pub const fn max_finite(self) -> f32 {
        match self {
            Fp8::E4M3Fn => 448.0,
            Fp8::E5M2 => 57344.0,
        }
    }

    /// The canonical positive NaN code, as torch writes it (the sign bit is set for negative NaN
    /// inputs).
    pub const fn nan_code(self) -> u8 {
        match self {
            Fp8::E4M3Fn => 0x7F,
            Fp8::E5M2 => 0x7F, // torch's choice
        }
    }

    const fn max_code(self) -> u8 {
        match self {
            Fp8::E4M3Fn => 0x7E,
            Fp8::E5M2 => 0x7B,
        }
    }

    /// Whether `code` is a NaN.
    pub const fn is_nan_code(self, code: u8) -> bool {
        match self {
            Fp8::E4M3Fn => code & 0x7F == 0x7F,
            Fp8::E5M2 => code & 0x7F > 0x7C,
        }
    }

    /// The f32 value of `code` (exact: every fp8 value is an f32).
    pub fn decode(self, code: u8) -> f32 {
        if self.is_nan_code(code) {
            return if code & 0x80 != 0 {
                -f32::NAN
            } else {
                f32::NAN
            };
        }
        let Grid {
            mantissa_bits: p,
            min_normal_exp: emin,
        } = self.grid();
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let field = i32::from((code & 0x7F) >> p);
        let mantissa = u32::from(code) & ((1 << p) - 1);
        if self == Fp8::E5M2 && field == 31 {
            return sign * f32::INFINITY;
        }
        let magnitude = if field == 0 {
            mantissa as f32 * pow2(emin - p as i32)
        } else {
            ((1 << p) | mantissa) as f32 * pow2(field - self.bias() - p as i32)
        };
        sign * magnitude
    }

    /// Encodes `x` with the given rounding and overflow behaviour.
    ///
    /// NaN gives the NaN code with `x`'s sign; ±0 keep their sign; ±Inf give ±Inf (E5M2) or NaN
    /// (E4M3FN) unless saturating. Stochastic rounding never overflows where nearest-even
    /// rounding would not: a stochastic result beyond max is replaced by the nearest-even one.
    pub fn encode(self, x: f32, rounding: Rounding, overflow: Overflow) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits >> 31) as u8) << 7;
        let abs = bits & 0x7FFF_FFFF;
        if abs > 0x7F80_0000 {
            return sign | self.nan_code();
        }
        let overflowed = || sign | self.overflow_code(overflow);
        if abs == 0x7F80_0000 {
            return overflowed();
        }
        let mut magnitude = round_to_grid(abs, self.grid(), rounding);
        if magnitude > self.max_finite() {
            let nearest = round_to_grid(abs, self.grid(), Rounding::NearestEven);
            if matches!(rounding, Rounding::Stochastic(_)) && nearest <= self.max_finite() {
                magnitude = nearest;
            } else {
                return overflowed();
            }
        }
        sign | self.encode_grid_magnitude(magnitude)
    }

    /// Encodes `values` into `out` rounding to nearest, ties to even: the same code as
    /// [`Fp8::encode`] with [`Rounding::NearestEven`] for every input (NaN, ±Inf, ±0, overflow
    /// and subnormals included), computed without branches so that it vectorizes (AVX-512 or
    /// AVX2 + FMA where the CPU has them, see [`crate::simd`]). Stochastic rounding stays element
    /// by element ([`Fp8::encode`]).
    ///
    /// ```
    /// use lpmm_formats::{Fp8, Overflow};
    /// let mut codes = [0u8; 3];
    /// Fp8::E4M3Fn.encode_nearest_slice(&[1.0, -1000.0, 0.3], Overflow::Saturate, &mut codes)?;
    /// assert_eq!(codes, [0x38, 0xFE, 0x2A]); // 1, -448 (saturated), 0.3 -> 0.3125
    /// # Ok::<(), lpmm_formats::FormatError>(())
    /// ```
    ///
    /// # Errors
    /// [`FormatError::LengthMismatch`] unless `out` holds one code per value (nothing written).
    pub fn encode_nearest_slice(
        self,
        values: &[f32],
        overflow: Overflow,
        out: &mut [u8],
    ) -> Result<(), FormatError> {
        if out.len() != values.len() {
            return Err(FormatError::LengthMismatch {
                what: "fp8 codes",
                expected: values.len(),
                actual: out.len(),
            });
        }
        let Grid {
            mantissa_bits: p,
            min_normal_exp: emin,
        } = self.grid();
        let k = NearestConsts {
            shift: 23 - p,
            offset: ((127 - self.bias()) as u32) << p,
            min_normal: pow2(emin).to_bits(),
            // Its f32 ulp is the format's subnormal step 2^(emin - p).
            magic: pow2(emin - p as i32 + 23),
            max_code: u32::from(self.max_code()),
            overflow_code: u32::from(self.overflow_code(overflow)),
            nan_code: u32::from(self.nan_code()),
        };
        encode_nearest(values, k, out);
        Ok(())
    }

    /// The (unsigned) code a finite value beyond the largest finite code, or ±Inf, becomes:
    /// ±max when saturating, else ±Inf (E5M2) or NaN (E4M3FN, which has no infinity).
    const fn overflow_code(self, overflow: Overflow) -> u8 {
        match (overflow, self) {
            (Overflow::Saturate, _) => self.max_code(),
            (Overflow::NonSaturating, Fp8::E5M2) => 0x7C,
            (Overflow::NonSaturating, Fp8::E4M3Fn) => self.nan_code(),
        }
    }

    /// The code of a non-negative value that lies exactly on this format's finite grid.
    fn encode_grid_magnitude(self, magnitude: f32) -> u8 {
        if magnitude == 0.0 {
            return 0;
        }
        let Grid {
            mantissa_bits: p,
            min_normal_exp: emin,
        } = self.grid();
        let b = magnitude.to_bits(); // a normal f32: the smallest fp8 subnormal is 2^-17
        let e = (b >> 23) as i32 - 127;
        let significand = (b & 0x007F_FFFF) | 0x0080_0000;
        if e >= emin {
            let field = (e + self.bias()) as u32;
            let mantissa = (significand >> (23 - p)) & ((1 << p) - 1);
            ((field << p) | mantissa) as u8
        } else {
            (significand >> (23 - p as i32 + (emin - e)) as u32) as u8
        }
    }
}

/// What the branch-free nearest encoder needs of a format ([`Fp8::encode_nearest_slice`]).
#[derive(Debug, Clone, Copy)]
struct NearestConsts {
    /// f32 mantissa bits dropped: 23 - p.
    shift: u32,
    /// The difference of the exponent biases, in code units: (127 - bias) << p.
    offset: u32,
    /// The bits of the smallest normal value 2^emin.
    min_normal: u32,
    /// 2^(emin - p + 23): adding it rounds a value below 2^emin to the subnormal step.
    magic: f32,
    max_code: u32,
    overflow_code: u32,
    nan_code: u32,
}

crate::multiversion! {
    /// Nearest-even fp8 codes of `values` (equal lengths): at or above 2^emin the f32 mantissa is
    /// rounded to p bits with the carry into the exponent (integer arithmetic) and rebiased;
    /// below it one f32 addition rounds to the subnormal step; codes above the largest finite one
    /// (±Inf included) take the overflow code, NaN the NaN code, and the sign is kept.
    fn encode_nearest(values: &[f32], k: NearestConsts, out: &mut [u8]) {
        out.iter_mut().zip(values).for_each(|(o, &x)| {
            let bits = x.to_bits();
            let abs = bits & 0x7FFF_FFFF;
            // abs <= 0x7FFF_FFFF, so the sum stays below 2^32.
            let half = (1u32 << (k.shift - 1)) - 1 + ((abs >> k.shift) & 1);
            let normal = ((abs + half) >> k.shift).wrapping_sub(k.offset);
            let subnormal = (f32::from_bits(abs) + k.magic)
                .to_bits()
                .wrapping_sub(k.magic.to_bits());
            let code = if abs < k.min_normal { subnormal } else { normal };
            let code = if code > k.max_code { k.overflow_code } else { code };
            let code = if abs > 0x7F80_0000 { k.nan_code } else { code };
            *o = ((bits >> 24) & 0x80) as u8 | code as u8;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for fmt in Fp8::ALL {
            for code in 0..=255u8 {
                let v = fmt.decode(code);
                for rounding in [Rounding::NearestEven, Rounding::Stochastic(0x1234_5678)] {
                    for overflow in [Overflow::Saturate, Overflow::NonSaturating] {
                        let back = fmt.encode(v, rounding, overflow);
                        if fmt.is_nan_code(code) {
                            assert!(fmt.is_nan_code(back), "{fmt:?} {code:#04x}");
                            assert_eq!(back & 0x80, code & 0x80);
                        } else if v.is_infinite() && overflow == Overflow::Saturate {
                            assert_eq!(fmt.decode(back), v.signum() * fmt.max_finite());
                        } else {
                            assert_eq!(back, code, "{fmt:?} {code:#04x} {v} {rounding:?}");
                        }
                    }
                }
            }
        }
    }

    /// The vectorized nearest encoder against [`Fp8::encode`], on every level this CPU has: every
    /// pattern of the top 19 bits (sign, exponent, the mantissa bits that decide the rounding)
    /// with low bits that make ties, just-below and just-above cases and random ones.
    #[test]
    fn the_nearest_slice_encoder_equals_encode() {
        use crate::simd::{Level, force};
        let mut xs = Vec::with_capacity(7 << 19);
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for high in 0..1u32 << 19 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            for low in [0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, state as u32 & 0x1FFF] {
                xs.push(f32::from_bits(high << 13 | low));
            }
        }
        let mut out = vec![0u8; xs.len()];
        for level in Level::ALL {
            force(Some(level));
            for fmt in Fp8::ALL {
                for overflow in [Overflow::Saturate, Overflow::NonSaturating] {
                    fmt.encode_nearest_slice(&xs, overflow, &mut out).unwrap();
                    for (x, o) in xs.iter().zip(&out) {
                        let want = fmt.encode(*x, Rounding::NearestEven, overflow);
                        assert_eq!(
                            *o,
                            want,
                            "{level:?} {fmt:?} {overflow:?} {:#x}",
                            x.to_bits()
                        );
                    }
                }
            }
        }
        force(None);
        let e = Fp8::E5M2.encode_nearest_slice(&[1.0; 3], Overflow::Saturate, &mut [0; 2]);
        assert!(
            matches!(e, Err(FormatError::LengthMismatch { .. })),
            "{e:?}"
        );
    }

    #[test]
    fn decoded_values_are_sorted_and_span_the_documented_range() {
        for fmt in Fp8::ALL {
            let positives: Vec<f32> = (0..0x80u8)
                .map(|c| fmt.decode(c))
                .filter(|v| v.is_finite())
                .collect();
            assert!(positives.windows(2).all(|w| w[0] < w[1]), "{fmt:?}");
            assert_eq!(*positives.last().unwrap(), fmt.max_finite());
        }
        assert_eq!(Fp8::E4M3Fn.decode(1), pow2(-9));
        assert_eq!(Fp8::E5M2.decode(1), pow2(-16));
        assert_eq!(Fp8::E5M2.decode(0x7C), f32::INFINITY);
    }

    #[test]
    fn overflow_rules() {
        let e4 = Fp8::E4M3Fn;
        // 464 is the midpoint of 448 and (the NaN slot) 480: ties to even keep 448.
        assert_eq!(
            e4.encode(464.0, Rounding::NearestEven, Overflow::NonSaturating),
            0x7E
        );
        assert_eq!(
            e4.encode(465.0, Rounding::NearestEven, Overflow::NonSaturating),
            0x7F
        );
        assert_eq!(
            e4.encode(1e9, Rounding::NearestEven, Overflow::Saturate),
            0x7E
        );
        assert_eq!(
            e4.encode(f32::NEG_INFINITY, Rounding::NearestEven, Overflow::Saturate),
            0xFE
        );
        // Stochastic rounding of 450 may not produce NaN: nearest gives 448, so 448.
        assert_eq!(
            e4.encode(450.0, Rounding::Stochastic(0), Overflow::NonSaturating),
            0x7E
        );
        let e5 = Fp8::E5M2;
        assert_eq!(
            e5.encode(61440.0, Rounding::NearestEven, Overflow::NonSaturating),
            0x7C
        );
        assert_eq!(
            e5.encode(61439.0, Rounding::NearestEven, Overflow::NonSaturating),
            0x7B
        );
        assert_eq!(
            e5.encode(-1e30, Rounding::Stochastic(7), Overflow::NonSaturating),
            0xFC
        );
    }
}
