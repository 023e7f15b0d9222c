//! Order-free sums of squares by atomic max and add: the folds of the two-phase step (factorized
//! statistics, the rules' tensor-wide statistics) add `x^2` over many elements so that every
//! backend gets the same bits however it splits the work.
//!
//! A first fold takes the largest exponent `E` of the squares `q = x^2` (exact in f64) by atomic
//! max; a second adds `floor(q * 2^(F - E))` into a 64-bit integer by atomic add (`F = 62 -
//! bitlen(count)`, so `count` terms cannot overflow); the sum is then `S * 2^(E - F)`, rounded
//! once to f64. Each term loses less than `2^(E - F)`, so the relative error of the sum is below
//! `2^-F * max(q) / mean(q)`. Only finite non-zero values count. Atomic max and add on 32-bit
//! words exist on every device; the kernels' `fixed_*` functions mirror these.

use std::sync::atomic::{AtomicU32, Ordering};

/// Added to an exponent when stored (a stored 0: no element yet).
pub const EXP_BIAS: i32 = 1024;

/// Fractional bits of a sum over `count` terms.
pub fn frac_bits(count: usize) -> i32 {
    62 - (usize::BITS - count.leading_zeros()) as i32
}

/// The exponent of `q = x^2` (exact in f64) for a finite non-zero `x`.
fn exponent(x: f32) -> i32 {
    let q = f64::from(x) * f64::from(x);
    ((q.to_bits() >> 52) & 0x7FF) as i32 - 1023
}

/// `floor(x^2 * 2^(frac - e))`.
fn term(x: f32, e: i32, frac: i32) -> u64 {
    let q = f64::from(x) * f64::from(x);
    let bits = q.to_bits();
    let mantissa = bits & ((1 << 52) - 1) | 1 << 52;
    let shift = ((bits >> 52) & 0x7FF) as i32 - 1023 - 52 + frac - e;
    if shift >= 0 {
        mantissa << shift
    } else if shift > -64 {
        mantissa >> -shift
    } else {
        0
    }
}

/// Adds `t` to the 64-bit integer in words `2k` (low) and `2k + 1` (high): exact in any order,
/// as the kernels do it.
fn add64(words: &[AtomicU32], k: usize, t: u64) {
    let (lo, hi) = (t as u32, (t >> 32) as u32);
    let old = words[2 * k].fetch_add(lo, Ordering::Relaxed);
    let carry = u32::from(old.checked_add(lo).is_none());
    if hi + carry != 0 {
        words[2 * k + 1].fetch_add(hi + carry, Ordering::Relaxed);
    }
}

/// One element's part of fold `phase` (0: exponent, 1: sum) of the sum of squares with exponent word
/// `exp[k]` and sum words `sum[2k], sum[2k + 1]`, over `count` terms.
#[inline]
pub fn fold(exp: &[AtomicU32], sum: &[AtomicU32], k: usize, count: usize, phase: usize, x: f32) {
    if !x.is_finite() || x == 0.0 {
        return;
    }
    if phase == 0 {
        exp[k].fetch_max((exponent(x) + EXP_BIAS) as u32, Ordering::Relaxed);
    } else {
        let e = exp[k].load(Ordering::Relaxed) as i32 - EXP_BIAS;
        add64(sum, k, term(x, e, frac_bits(count)));
    }
}

/// [`fold`] of every value of `xs` into sum `k`, accumulated locally and applied with one atomic
/// operation (a max of the exponents; a wrapping 64-bit sum of the terms, which is the same
/// integer in any grouping), so a chunk pays one atomic per sum instead of one per element.
pub fn fold_many(
    exp: &[AtomicU32],
    sum: &[AtomicU32],
    k: usize,
    count: usize,
    phase: usize,
    xs: impl Iterator<Item = f32>,
) {
    let xs = xs.filter(|x| x.is_finite() && *x != 0.0);
    if phase == 0 {
        if let Some(m) = xs.map(|x| (exponent(x) + EXP_BIAS) as u32).max() {
            exp[k].fetch_max(m, Ordering::Relaxed);
        }
    } else {
        let e = exp[k].load(Ordering::Relaxed) as i32 - EXP_BIAS;
        let frac = frac_bits(count);
        let t = xs.fold(0u64, |a, x| a.wrapping_add(term(x, e, frac)));
        if t != 0 {
            add64(sum, k, t);
        }
    }
}

/// The sum of squares `k` as an f64, after both folds.
pub fn total(exp: &[AtomicU32], sum: &[AtomicU32], k: usize, count: usize) -> f64 {
    let e = exp[k].load(Ordering::Relaxed) as i32;
    if e == 0 {
        return 0.0;
    }
    let s = u64::from(sum[2 * k].load(Ordering::Relaxed))
        | u64::from(sum[2 * k + 1].load(Ordering::Relaxed)) << 32;
    let scale = e - EXP_BIAS - frac_bits(count);
    // 2^scale: between 2^-360 and 2^256, a normal f64, so the product rounds only once.
    s as f64 * f64::from_bits(((scale + 1023) as u64) << 52)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum_of(values: &[f32], order: &[usize]) -> f64 {
        let exp = [AtomicU32::new(0)];
        let sum = [AtomicU32::new(0), AtomicU32::new(0)];
        for phase in 0..2 {
            for &i in order {
                fold(&exp, &sum, 0, values.len(), phase, values[i]);
            }
        }
        total(&exp, &sum, 0, values.len())
    }

    #[test]
    fn the_sum_does_not_depend_on_the_order_and_is_close_to_the_exact_one() {
        let values: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3 * (1 + i % 13) as f32)
            .chain([f32::NAN, f32::INFINITY, 0.0])
            .collect();
        let forward: Vec<usize> = (0..values.len()).collect();
        let backward: Vec<usize> = forward.iter().rev().copied().collect();
        let strided: Vec<usize> = (0..7).flat_map(|r| (r..values.len()).step_by(7)).collect();
        let a = sum_of(&values, &forward);
        assert_eq!(a.to_bits(), sum_of(&values, &backward).to_bits());
        assert_eq!(a.to_bits(), sum_of(&values, &strided).to_bits());
        let exact: f64 = values
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| f64::from(x) * f64::from(x))
            .sum();
        // Below 2^-F * max/mean relative (F = 62 - 13 here).
        assert!((a - exact).abs() <= exact * 1e-12, "{a} vs {exact}");
        assert!(a <= exact, "terms are truncated, never rounded up");
    }

    /// Folding runs of values at once gives the words of folding them one by one.
    #[test]
    fn folding_runs_equals_folding_elements() {
        let values: Vec<f32> = (0..5000)
            .map(|i| (i as f32 * 0.377).sin() * 10f32.powi(i % 9 - 4))
            .chain([0.0, f32::NAN, f32::INFINITY, 1e-45, 3e38])
            .collect();
        let words = || (0..4).map(|_| AtomicU32::new(0)).collect::<Vec<_>>();
        let (e1, s1, e2, s2) = (words(), words(), words(), words());
        for phase in 0..2 {
            for &x in &values {
                fold(&e1, &s1, 1, values.len(), phase, x);
            }
            for run in values.chunks(333) {
                fold_many(&e2, &s2, 1, values.len(), phase, run.iter().copied());
            }
        }
        let read = |w: &[AtomicU32]| {
            w.iter()
                .map(|a| a.load(Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        assert_eq!(read(&e1), read(&e2));
        assert_eq!(read(&s1), read(&s2));
        assert_ne!(read(&s1), vec![0; 4]);
    }

    #[test]
    fn an_empty_or_all_zero_fold_is_zero() {
        assert_eq!(sum_of(&[0.0, 0.0], &[0, 1]), 0.0);
        assert_eq!(sum_of(&[], &[]), 0.0);
    }
}
