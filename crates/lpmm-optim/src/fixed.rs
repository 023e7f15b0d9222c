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
    xs: &[f32],
) {
    if phase == 0 {
        let m = max_biased_exponent(xs);
        if m != 0 {
            exp[k].fetch_max(m as u32, Ordering::Relaxed);
        }
    } else {
        let e = exp[k].load(Ordering::Relaxed) as i32 - EXP_BIAS;
        let t = sum_of_terms(xs, e, frac_bits(count));
        if t != 0 {
            add64(sum, k, t);
        }
    }
}

/// `exponent(x) + EXP_BIAS` of a finite non-zero `x`, 0 otherwise; branch-free. `x^2` is a
/// normal f64 for every finite non-zero f32 (between 2^-298 and 2^256), so its exponent field is
/// neither 0 (zero) nor 2047 (Inf and NaN) exactly when `x` counts.
#[inline(always)]
fn biased_exponent(x: f32) -> u64 {
    let q = f64::from(x) * f64::from(x);
    let field = (q.to_bits() >> 52) & 0x7FF;
    // 1..=0x7FE (`field - 1` below 0x7FE) exactly when x counts; the mask keeps the loops over
    // it free of selects on the accumulator, so they vectorize.
    let counts = u64::from(field.wrapping_sub(1) < 0x7FE);
    // exponent(x) + EXP_BIAS = field - 1023 + 1024
    (field + 1) & counts.wrapping_neg()
}

/// [`term`] of a finite non-zero `x`, 0 otherwise; branch-free (shift amounts clamped, the
/// choices selects), so that loops over it vectorize.
#[inline(always)]
fn term_or_zero(x: f32, e: i32, frac: i32) -> u64 {
    let q = f64::from(x) * f64::from(x);
    let bits = q.to_bits();
    let field = (bits >> 52) & 0x7FF;
    let mantissa = bits & ((1 << 52) - 1) | 1 << 52;
    let shift = field as i64 - 1023 - 52 + i64::from(frac - e);
    let left = mantissa << shift.clamp(0, 63);
    let right = mantissa >> (-shift).clamp(0, 63);
    let t = if shift >= 0 {
        left
    } else if shift > -64 {
        right
    } else {
        0
    };
    let counts = field != 0 && field != 0x7FF;
    if counts { t } else { 0 }
}

lpmm_formats::multiversion! {
    /// The largest [`biased_exponent`] of `xs` (0 if none counts).
    fn max_biased_exponent(xs: &[f32]) -> u64 {
        // Sixteen running maxima (a vector's lanes: written as a fold over single values, the
        // compiler keeps one scalar maximum with conditional moves).
        let mut lanes = [0u64; 16];
        let whole = xs.chunks_exact(16);
        let tail = whole.remainder();
        for chunk in whole {
            for (m, &x) in lanes.iter_mut().zip(chunk) {
                *m = (*m).max(biased_exponent(x));
            }
        }
        let m = tail.iter().fold(0, |m, &x| m.max(biased_exponent(x)));
        lanes.into_iter().fold(m, u64::max)
    }
}

lpmm_formats::multiversion! {
    /// The wrapping sum of [`term_or_zero`] over `xs`.
    fn sum_of_terms(xs: &[f32], e: i32, frac: i32) -> u64 {
        xs.iter().fold(0u64, |a, &x| a.wrapping_add(term_or_zero(x, e, frac)))
    }
}

lpmm_formats::multiversion! {
    /// `words[i] = max(words[i], biased_exponent(xs[i]))`.
    fn max_exponents_into<const AVX512: bool>(words: &mut [u64], xs: &[f32]) {
        // `| zero`: below AVX-512 a zero the compiler cannot see, so that the store of the
        // maximum stays a plain store (not a masked one, microcoded on AMD's cores at AVX2; see
        // `rule::apply_run`).
        let zero = if AVX512 { 0 } else { std::hint::black_box(0u64) };
        for (w, &x) in words.iter_mut().zip(xs) {
            *w = (*w).max(biased_exponent(x)) | zero;
        }
    }
}

lpmm_formats::multiversion! {
    /// `words[i] += term_or_zero(xs[i], exps[i], frac)` (wrapping).
    fn add_terms_into(words: &mut [u64], xs: &[f32], exps: &[i32], frac: i32) {
        for ((w, &x), &e) in words.iter_mut().zip(xs).zip(exps) {
            *w = w.wrapping_add(term_or_zero(x, e, frac));
        }
    }
}

/// The most sums a [`Local`] holds (the columns of a factored state it serves).
pub const LOCAL_SUMS: usize = 8192;

/// Sums of squares `base .. base + n` folded by one thread into local words and applied to the
/// shared ones with one atomic operation per sum ([`Local::flush`]): the same bits as folding
/// every element atomically, since a max and a wrapping 64-bit sum do not depend on the grouping.
/// For sums whose elements are spread over a piece (the column sums of a factored state: each
/// chunk holds a few elements of every column) instead of one atomic operation per sum and chunk.
/// Fixed-size (on the stack: the step allocates nothing), at most [`LOCAL_SUMS`] sums.
pub struct Local {
    /// How many sums are ready; 0 before [`Local::ready`].
    n: usize,
    /// Per sum: fold 0 the largest biased exponent so far (0: none), fold 1 the wrapping sum of
    /// the terms.
    words: [u64; LOCAL_SUMS],
    /// Fold 1: each sum's exponent (from fold 0, read once).
    exps: [i32; LOCAL_SUMS],
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").field("n", &self.n).finish()
    }
}

impl Default for Local {
    fn default() -> Self {
        Self {
            n: 0,
            words: [0; LOCAL_SUMS],
            exps: [0; LOCAL_SUMS],
        }
    }
}

impl Local {
    /// Readies the words for sums `base .. base + n` in fold `phase` (a no-op once ready); false
    /// if `n` is more than [`LOCAL_SUMS`] (fold those sums directly).
    pub fn ready(&mut self, exp: &[AtomicU32], base: usize, n: usize, phase: usize) -> bool {
        if n > LOCAL_SUMS {
            return false;
        }
        if self.n != n {
            self.n = n;
            self.words[..n].fill(0);
            if phase != 0 {
                for (e, w) in self.exps[..n].iter_mut().zip(&exp[base..base + n]) {
                    *e = w.load(Ordering::Relaxed) as i32 - EXP_BIAS;
                }
            }
        }
        true
    }

    /// [`fold`] of `xs[i]` into local sum `from + i` (of `count` terms) for every `i`.
    pub fn fold_run(&mut self, from: usize, count: usize, phase: usize, xs: &[f32]) {
        let words = &mut self.words[from..from + xs.len()];
        if phase == 0 {
            max_exponents_into(words, xs);
        } else {
            add_terms_into(
                words,
                xs,
                &self.exps[from..from + xs.len()],
                frac_bits(count),
            );
        }
    }

    /// Applies the local words to shared sums `base ..` (as [`Local::ready`] was given them).
    pub fn flush(&self, exp: &[AtomicU32], sum: &[AtomicU32], base: usize, phase: usize) {
        for (i, &w) in self.words[..self.n].iter().enumerate() {
            if w == 0 {
                continue;
            }
            if phase == 0 {
                exp[base + i].fetch_max(w as u32, Ordering::Relaxed);
            } else {
                add64(sum, base + i, w);
            }
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

    /// Folding runs of values at once (`fold_many`), or into local words flushed once
    /// (`Local`), gives the words of folding them one by one, at every SIMD level: zeros, NaN,
    /// infinities, subnormals, and magnitudes far enough apart that small terms shift out.
    #[test]
    fn folding_runs_equals_folding_elements() {
        use lpmm_formats::simd::{Level, force};
        let values: Vec<f32> = (0..5000)
            .map(|i| (i as f32 * 0.377).sin() * 10f32.powi(i % 9 - 4))
            .chain([
                0.0,
                -0.0,
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                1e-45,
                -3e38,
                3e38,
            ])
            .chain((0..64).map(|i| {
                f32::from_bits(0x0000_0001 << (i % 23)) * if i % 2 == 0 { 1.0 } else { -1.0 }
            }))
            .collect();
        let words = |n: usize| (0..n).map(|_| AtomicU32::new(0)).collect::<Vec<_>>();
        let read = |w: &[AtomicU32]| {
            w.iter()
                .map(|a| a.load(Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        // Columns: element i of each row of 4 goes to sum 1 + i (of `rows` terms).
        let rows = values.len().div_ceil(4);
        for level in Level::ALL {
            force(Some(level));
            let (e1, s1, e2, s2) = (words(4), words(8), words(4), words(8));
            let (ec, sc, el, sl) = (words(5), words(10), words(5), words(10));
            for phase in 0..2 {
                for &x in &values {
                    fold(&e1, &s1, 1, values.len(), phase, x);
                }
                for run in values.chunks(333) {
                    fold_many(&e2, &s2, 1, values.len(), phase, run);
                }
                for (i, &x) in values.iter().enumerate() {
                    fold(&ec, &sc, 1 + i % 4, rows, phase, x);
                }
                let mut local = Local::default();
                for row in values.chunks(4) {
                    local.ready(&el, 1, 4, phase);
                    local.fold_run(0, rows, phase, row);
                }
                local.flush(&el, &sl, 1, phase);
            }
            assert_eq!(read(&e1), read(&e2), "{level:?}");
            assert_eq!(read(&s1), read(&s2), "{level:?}");
            assert_ne!(read(&s1), vec![0; 8]);
            assert_eq!(read(&ec), read(&el), "{level:?}");
            assert_eq!(read(&sc), read(&sl), "{level:?}");
            assert!(read(&sc)[2..].iter().all(|&w| w != 0));
        }
        force(None);
    }

    #[test]
    fn an_empty_or_all_zero_fold_is_zero() {
        assert_eq!(sum_of(&[0.0, 0.0], &[0, 1]), 0.0);
        assert_eq!(sum_of(&[], &[]), 0.0);
    }
}
