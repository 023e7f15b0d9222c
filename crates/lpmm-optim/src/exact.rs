//! An exact accumulator for f64 values: the sum of a multiset of f64, rounded once, so it does
//! not depend on the order of the additions or on how they were grouped. The gradient
//! norm is such a sum (one f64 partial per 256 elements), which is why it is the same on
//! one rank and on any number of ranks that each hold some of the chunks, and why partial sums
//! from ranks combine by integer addition (exact in any order, so any all-reduce will do).
//!
//! Representation: a fixed-point integer with 32-bit digits held in `i64` limbs (the spare bits
//! absorb carries), bit 0 worth 2^-352, top digit worth 2^384: wide enough for every value whose
//! lowest set bit is at least 2^-352 and whose magnitude is below 2^330 — every sum of squares of
//! f32 values is (the smallest square is 2^-298, so an f64 sum of them has no bit below 2^-350;
//! 2^40 runs of 256 squares below 2^256 stay below 2^304). A value outside the window makes
//! the sum NaN rather than inexact.

/// Limbs of the accumulator.
const LIMBS: usize = 23;
/// Words of [`ExactSum::to_words`].
pub const EXACT_WORDS: usize = LIMBS + 1;
/// The weight of bit 0: 2^BASE.
const BASE: i32 = -352;
/// Values must be below 2^MAX_EXP.
const MAX_EXP: i32 = 330;
/// Additions between carry propagations (each adds less than 2^32 to a limb).
const SPARE: u32 = 1 << 29;

/// The exact sum of the f64 values added so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExactSum {
    limbs: [i64; LIMBS],
    pending: u32,
    non_finite: bool,
}

impl Default for ExactSum {
    fn default() -> Self {
        Self {
            limbs: [0; LIMBS],
            pending: 0,
            non_finite: false,
        }
    }
}

impl ExactSum {
    /// Zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `x` exactly. A non-finite `x`, or one outside the window (see the module's
    /// documentation), makes the sum NaN.
    pub fn add(&mut self, x: f64) {
        if x == 0.0 {
            return;
        }
        if !x.is_finite() {
            self.non_finite = true;
            return;
        }
        let bits = x.to_bits();
        let field = ((bits >> 52) & 0x7FF) as i32;
        let mut mant = bits & ((1 << 52) - 1);
        let e = if field == 0 {
            -1074
        } else {
            mant |= 1 << 52;
            field - 1075
        };
        // x = ±mant * 2^e: its lowest set bit and its top bit must fall in the window.
        let low = e + mant.trailing_zeros() as i32;
        if low < BASE || e + 53 > MAX_EXP {
            self.non_finite = true;
            return;
        }
        let pos = (e - BASE).max(0) as u32;
        let mant = if e < BASE { mant >> (BASE - e) } else { mant };
        let v = u128::from(mant) << (pos % 32);
        let at = (pos / 32) as usize;
        let parts = [v as u32, (v >> 32) as u32, (v >> 64) as u32];
        for (k, &p) in parts.iter().enumerate() {
            let p = i64::from(p);
            if x > 0.0 {
                self.limbs[at + k] += p;
            } else {
                self.limbs[at + k] -= p;
            }
        }
        self.pending += 1;
        if self.pending >= SPARE {
            self.normalize();
        }
    }

    /// Adds another exact sum.
    pub fn merge(&mut self, other: &ExactSum) {
        let mut o = *other;
        o.normalize();
        self.normalize();
        for (a, b) in self.limbs.iter_mut().zip(o.limbs) {
            *a += b;
        }
        self.non_finite |= o.non_finite;
        self.normalize();
    }

    /// Propagates carries: every limb but the top one in 0..2^32.
    fn normalize(&mut self) {
        for i in 0..LIMBS - 1 {
            let c = self.limbs[i] >> 32;
            self.limbs[i] -= c << 32;
            self.limbs[i + 1] += c;
        }
        self.pending = 0;
    }

    /// The limbs, normalised, as words for an integer all-reduce (see [`ExactSum::from_words`]);
    /// the last word flags a non-finite addend.
    pub fn to_words(&self) -> [i64; EXACT_WORDS] {
        let mut s = *self;
        s.normalize();
        let mut w = [0i64; LIMBS + 1];
        w[..LIMBS].copy_from_slice(&s.limbs);
        w[LIMBS] = i64::from(s.non_finite);
        w
    }

    /// The sum whose words (possibly the element-wise sum of several sums' words) are `w`.
    pub fn from_words(w: &[i64; EXACT_WORDS]) -> Self {
        let mut s = ExactSum {
            limbs: [0; LIMBS],
            pending: 0,
            non_finite: w[LIMBS] != 0,
        };
        s.limbs.copy_from_slice(&w[..LIMBS]);
        s.normalize();
        s
    }

    /// The sum rounded to the nearest f64 (ties to even); NaN if a value that was not finite or
    /// outside the window was added.
    pub fn to_f64(&self) -> f64 {
        if self.non_finite {
            return f64::NAN;
        }
        let mut s = *self;
        s.normalize();
        let negative = s.limbs[LIMBS - 1] < 0;
        if negative {
            // Two's complement over the limbs: negate, then normalise again.
            for l in s.limbs.iter_mut() {
                *l = -*l;
            }
            s.normalize();
        }
        let Some(top) = s.limbs.iter().rposition(|&l| l != 0) else {
            return 0.0;
        };
        // The value's highest bit, as a position from bit 0 of the accumulator.
        let top_bits = 64 - (s.limbs[top] as u64).leading_zeros() as i64;
        let msb = 32 * top as i64 + top_bits - 1;
        // Keep 53 bits (the window lies in f64's normal range, so no result is subnormal).
        let lowest = msb - 52;
        let bit = |p: i64| -> u64 {
            if p < 0 {
                return 0;
            }
            let (l, b) = ((p / 32) as usize, p % 32);
            if l >= LIMBS {
                return 0;
            }
            ((s.limbs[l] as u64) >> b) & 1
        };
        let mut mant: u64 = 0;
        for p in (lowest..=msb).rev() {
            mant = (mant << 1) | bit(p);
        }
        // Round to nearest, ties to even: the first dropped bit, and whether any below it is set.
        let round = bit(lowest - 1) == 1;
        let sticky = (0..lowest - 1).any(|p| bit(p) == 1);
        if round && (sticky || mant & 1 == 1) {
            mant += 1;
        }
        // mant * 2^(lowest + BASE), with mant <= 2^53: exactly representable (or past the f64
        // range), so multiplying by powers of two never rounds.
        let value = scale(mant, lowest + i64::from(BASE));
        if negative { -value } else { value }
    }
}

/// 2^e for e in -1022..=1023.
fn pow2(e: i64) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// `mant * 2^exp` where the exact product is an f64 or overflows.
fn scale(mant: u64, exp: i64) -> f64 {
    let mut v = mant as f64;
    let mut e = exp;
    while e > 1023 {
        v *= pow2(1023);
        e -= 1023;
    }
    while e < -1022 {
        v *= pow2(-1022);
        e += 1022;
    }
    v * pow2(e)
}

/// Elements per partial sum of the gradient norm.
pub const NORM_RUN: usize = 256;

/// Adds the squares of `values`' finite elements to `sum` as the gradient norm defines it (one
/// f64 partial per [`NORM_RUN`] elements, in element order, added exactly; `values` starts at a
/// multiple of `NORM_RUN` of the parameter) and returns whether every element is finite.
///
/// Each partial is a chain of f64 additions in element order, so one run is latency-bound; runs
/// of all-finite groups of eight are summed side by side, each still in its own order
/// (the same bits as one at a time: a square of an f32 is exact in f64, and every chain is the
/// one the one-run-at-a-time path computes).
pub fn add_squares(values: &[f32], sum: &mut ExactSum) -> bool {
    let span = NORM_RUN * SQUARE_LANES;
    let whole = values.len() - values.len() % span;
    let (head, tail) = values.split_at(whole);
    let mut finite = true;
    for group in head.chunks_exact(span) {
        if lpmm_formats::simd::abs_max_bits(group) < f32::INFINITY.to_bits() {
            let mut parts = [0f64; SQUARE_LANES];
            for j in 0..NORM_RUN {
                for (k, part) in parts.iter_mut().enumerate() {
                    let x = f64::from(group[k * NORM_RUN + j]);
                    *part += x * x;
                }
            }
            parts.into_iter().for_each(|p| sum.add(p));
        } else {
            finite &= add_squares_runs(group, sum);
        }
    }
    finite & add_squares_runs(tail, sum)
}

/// Runs summed side by side by [`add_squares`].
const SQUARE_LANES: usize = 8;

/// [`add_squares`] one run at a time, skipping non-finite elements.
fn add_squares_runs(values: &[f32], sum: &mut ExactSum) -> bool {
    let mut finite = true;
    for run in values.chunks(NORM_RUN) {
        let mut part = 0.0f64;
        for &x in run {
            // Only finite values count towards the norm: under SkipElements one Inf must not
            // turn clipping off for the rest.
            if x.is_finite() {
                part += f64::from(x) * f64::from(x);
            } else {
                finite = false;
            }
        }
        sum.add(part);
    }
    finite
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The side-by-side runs give the partials one run at a time gives, bit for bit, with and
    /// without non-finite elements, for lengths that are not whole groups or runs.
    #[test]
    fn squares_side_by_side_are_the_runs_one_at_a_time() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for len in [0, 1, 255, 256, 2047, 2048, 2049, 4096, 5000, 3 * 2048 + 300] {
            let mut values: Vec<f32> = (0..len)
                .map(|i| {
                    // Magnitudes from subnormal to 2^40, so f64 rounding in each chain happens.
                    let e = (next() % 190) as u32;
                    let m = (next() as u32) & 0x007F_FFFF;
                    let x = f32::from_bits(e << 23 | m);
                    if i % 3 == 0 { -x } else { x }
                })
                .collect();
            for poison in [None, Some(f32::NAN), Some(f32::NEG_INFINITY)] {
                if let (Some(p), true) = (poison, len > 0) {
                    let at = (next() as usize) % len;
                    values[at] = p;
                }
                let (mut fast, mut slow) = (ExactSum::new(), ExactSum::new());
                let a = add_squares(&values, &mut fast);
                let b = add_squares_runs(&values, &mut slow);
                assert_eq!(a, b, "len {len}");
                assert_eq!(a, values.iter().all(|x| x.is_finite()), "len {len}");
                assert_eq!(fast.to_words(), slow.to_words(), "len {len}");
                // The partials are rounded f64 chains: a different order would change them.
                assert_eq!(
                    fast.to_f64().to_bits(),
                    slow.to_f64().to_bits(),
                    "len {len}"
                );
            }
        }
    }

    fn exact(values: &[f64]) -> f64 {
        let mut s = ExactSum::new();
        values.iter().for_each(|&x| s.add(x));
        s.to_f64()
    }

    #[test]
    fn sums_that_f64_gets_wrong_are_exact() {
        // 1 + 2^-60 - 1: f64 left to right gives 0.
        assert_eq!(exact(&[1.0, 2f64.powi(-60), -1.0]), 2f64.powi(-60));
        assert_eq!(exact(&[1e90, 1.0, -1e90]), 1.0);
        assert_eq!(exact(&[]), 0.0);
        let tiny = 2f64.powi(-350);
        assert_eq!(exact(&[tiny, tiny, tiny]), 3.0 * tiny);
        assert_eq!(exact(&[2f64.powi(300), -2f64.powi(300), 3.5]), 3.5);
        // Outside the window, or not finite: NaN, never a wrong number.
        assert!(exact(&[1.0, f64::NAN]).is_nan());
        assert!(exact(&[1.0, f64::INFINITY]).is_nan());
        assert!(exact(&[1.0, 2f64.powi(-400)]).is_nan());
        assert!(exact(&[1.0, 1e300]).is_nan());
        // The extremes of f32 squares.
        let smallest = f64::from(f32::from_bits(1)).powi(2);
        let largest = f64::from(f32::MAX).powi(2);
        assert_eq!(exact(&[smallest, smallest]), 2.0 * smallest);
        assert_eq!(exact(&[largest, largest, -largest]), largest);
        // Ties to even: 1 + 2^-53 is a tie between 1 and 1 + 2^-52.
        assert_eq!(exact(&[1.0, 2f64.powi(-53)]), 1.0);
        assert_eq!(
            exact(&[1.0, 2f64.powi(-53), 2f64.powi(-80)]),
            1.0 + 2f64.powi(-52)
        );
        assert_eq!(
            exact(&[1.0 + 2f64.powi(-52), 2f64.powi(-53)]),
            1.0 + 2f64.powi(-51)
        );
    }

    #[test]
    fn order_and_grouping_do_not_matter() {
        // Squares of f32 over many magnitudes, summed whole, in reverse, and as 4 merged groups.
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let values: Vec<f64> = (0..10_000)
            .map(|_| {
                let x = f32::from_bits((next() as u32) & 0x7F7F_FFFF);
                f64::from(x) * f64::from(x)
            })
            .collect();
        let whole = exact(&values);
        let mut rev = values.clone();
        rev.reverse();
        assert_eq!(whole.to_bits(), exact(&rev).to_bits());
        let mut merged = ExactSum::new();
        for part in values.chunks(2_501) {
            let mut s = ExactSum::new();
            part.iter().for_each(|&x| s.add(x));
            // Through the words an all-reduce would carry.
            let mut w = merged.to_words();
            for (a, b) in w.iter_mut().zip(s.to_words()) {
                *a += b;
            }
            merged = ExactSum::from_words(&w);
        }
        assert_eq!(whole.to_bits(), merged.to_f64().to_bits());
        // And it is the correctly rounded sum: f64 summation in any order is within 1e-12.
        let naive: f64 = values.iter().sum();
        assert!((naive - whole).abs() <= whole * 1e-12, "{naive} vs {whole}");
    }

    #[test]
    fn integers_are_exact_at_any_scale() {
        for k in [-340, -300, -60, 0, 60, 250] {
            let u = 2f64.powi(k);
            let vals: Vec<f64> = (1..=100).map(|i| f64::from(i) * u).collect();
            assert_eq!(exact(&vals), 5050.0 * u, "scale 2^{k}");
        }
    }
}
