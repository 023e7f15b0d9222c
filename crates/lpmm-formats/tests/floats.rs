//! Float formats: exhaustive and brute-force checks that need no reference files.

use lpmm_formats::{Fp8, Overflow, Rounding, SplitF32, bf16, float};
use proptest::prelude::*;
use rayon::prelude::*;

/// All 2^32 bit patterns split and join back to the same bits, except NaNs, which come back as a
/// NaN and show a NaN in the visible half. Takes a few seconds on 2 cores in release (the README's
/// test command), minutes in debug.
#[test]
fn split_f32_is_lossless_for_every_bit_pattern() {
    let failures: u64 = (0..=u16::MAX)
        .into_par_iter()
        .map(|hi| {
            let mut bad = 0u64;
            for lo in 0..=u16::MAX {
                let bits = u32::from(hi) << 16 | u32::from(lo);
                // black_box keeps the optimizer from proving split-then-join the identity and
                // deleting the loop: the halves are really stored and read back.
                let s = std::hint::black_box(SplitF32::from_f32(f32::from_bits(bits)));
                let x = f32::from_bits(bits);
                let ok = if x.is_nan() {
                    s.to_f32().is_nan()
                        && s.hi.is_nan()
                        && s.to_f32().is_sign_negative() == x.is_sign_negative()
                } else {
                    s.to_f32().to_bits() == bits
                };
                bad += u64::from(!ok);
            }
            bad
        })
        .sum();
    assert_eq!(failures, 0);
}

/// The nearest fp8 value by brute force over every finite code; ties to the even code (an even
/// code has an even mantissa, since the mantissa is the code's low bits).
fn brute_force_nearest(fmt: Fp8, x: f32) -> u8 {
    let mut best: Option<(f64, u8)> = None;
    for code in 0..=255u8 {
        let v = fmt.decode(code);
        if !v.is_finite() || (v == 0.0 && v.is_sign_negative() != x.is_sign_negative()) {
            continue;
        }
        let d = (f64::from(x) - f64::from(v)).abs();
        best = match best {
            Some((bd, bc)) if bd < d || (bd == d && bc % 2 == 0) => Some((bd, bc)),
            _ => Some((d, code)),
        };
    }
    best.unwrap().1
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, .. ProptestConfig::default() })]

    #[test]
    fn fp8_nearest_is_the_brute_force_nearest(bits in any::<u32>(), fmt in prop_oneof![Just(Fp8::E4M3Fn), Just(Fp8::E5M2)]) {
        // Map random bits into the format's finite range, both signs, all binades.
        let x = f32::from_bits(bits);
        let x = if x.is_finite() && x.abs() <= fmt.max_finite() { x } else { (x.to_bits() % 100_000) as f32 * 1e-3 * fmt.max_finite() / 100.0 };
        prop_assume!(x.abs() <= fmt.max_finite());
        prop_assert_eq!(fmt.encode(x, Rounding::NearestEven, Overflow::Saturate), brute_force_nearest(fmt, x), "x = {}", x);
    }

    #[test]
    fn bf16_stochastic_rounds_to_a_neighbour(x in any::<f32>(), r in any::<u32>()) {
        prop_assume!(x.is_finite());
        let s = float::bf16_stochastic(x, r).to_f32();
        let down = float::bf16_stochastic(x, u32::MAX).to_f32();
        let up = float::bf16_stochastic(x, 0).to_f32();
        prop_assert!(s == down || s == up);
        prop_assert_eq!(down, bf16::from_bits((x.to_bits() >> 16) as u16).to_f32(), "all ones truncates");
    }
}
