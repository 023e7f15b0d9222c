//! Adafactor's factorized second moment (Shazeer & Stern 2018), for the tensor viewed as
//! `rows x cols` (leading dimensions x last): `r_i` and `c_j`, moving averages of the row and
//! column means of the squared moment gradients, reconstruct `v_ij = r_i c_j / mean(r)`. Adam
//! only, state 2 only; 1-D tensors keep a full f32 state ([docs/OPTIMIZERS.md]).
//!
//! The row and column sums of squares are exact in any order, so every backend computes them
//! bit for bit however it splits the work: a first fold takes, per row and column, the largest
//! exponent `E` of the squares `q = g^2` (exact in f64); a second adds `floor(q * 2^(F - E))`
//! into a 64-bit integer (`F = 62 - bitlen(count)`, so the sum cannot overflow); the sum is then
//! `S * 2^(E - F)` rounded once to f64. Atomic max and add suffice on every device.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use std::sync::atomic::{AtomicU32, Ordering};

use super::{
    Codec, Dtype, FoldInput, HostSlot, Random, RegionSpec, Regions, RegionsMut, check_scales,
    set_wide_f32, wide_f32,
};
use crate::backend::SlotKind;
use crate::config::Storage;
use crate::rule::RuleConsts;

/// The factorized second moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Factored;

/// Wide regions.
const ROW: usize = 0;
const COL: usize = 1;
const MEAN: usize = 2;
const EXP: usize = 3;
const SUM: usize = 4;

/// Added to an exponent when stored (0: no element yet).
pub const EXP_BIAS: i32 = 1024;

/// `(rows, cols)` of a tensor of `shape`.
pub fn dims(shape: &[usize]) -> (usize, usize) {
    let cols = shape.last().copied().unwrap_or(1).max(1);
    (shape.iter().product::<usize>() / cols, cols)
}

/// Fractional bits of a sum over `count` terms.
fn frac_bits(count: usize) -> i32 {
    62 - (usize::BITS - count.leading_zeros()) as i32
}

/// The exponent of `q = x^2` (exact in f64) for a finite non-zero `x`.
fn exponent(x: f32) -> i32 {
    let q = f64::from(x) * f64::from(x);
    ((q.to_bits() >> 52) & 0x7FF) as i32 - 1023
}

/// `floor(x^2 * 2^(frac - e))` for the stored exponent `e` of `x`'s row or column.
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

/// The sum of squares of row or column `k` as an f64.
fn sum_of(wide: &[Box<[AtomicU32]>], k: usize, count: usize) -> f64 {
    let e = wide[EXP][k].load(Ordering::Relaxed) as i32;
    if e == 0 {
        return 0.0;
    }
    let s = u64::from(wide[SUM][2 * k].load(Ordering::Relaxed))
        | u64::from(wide[SUM][2 * k + 1].load(Ordering::Relaxed)) << 32;
    let scale = e - EXP_BIAS - frac_bits(count);
    // 2^scale: between 2^-360 and 2^256, a normal f64, so the product rounds only once.
    s as f64 * f64::from_bits(((scale + 1023) as u64) << 52)
}

/// After the folds: moves the row and column averages by this step's means (a value that would
/// overflow keeps its old one, and the step reports the parameter: true) and recomputes
/// `mean(r)`. The same host code for every backend.
fn combine(wide: &[Box<[AtomicU32]>], shape: &[usize], rule: &RuleConsts) -> bool {
    let Some((b2, w2)) = rule.second_moment_betas() else {
        return false;
    };
    let (rows, cols) = dims(shape);
    let mut kept = false;
    for i in 0..rows {
        let mean = (sum_of(wide, i, cols) / cols as f64) as f32;
        let new = w2.mul_add(mean, wide_f32(&wide[ROW], i) * b2);
        if new.is_finite() {
            set_wide_f32(&wide[ROW], i, new);
        } else {
            kept = true;
        }
    }
    for j in 0..cols {
        let mean = (sum_of(wide, rows + j, rows) / rows as f64) as f32;
        let new = w2.mul_add(mean, wide_f32(&wide[COL], j) * b2);
        if new.is_finite() {
            set_wide_f32(&wide[COL], j, new);
        } else {
            kept = true;
        }
    }
    mean_rows(wide, rows);
    kept
}

/// `mean(r)`, in f64 in row order, rounded to f32.
fn mean_rows(wide: &[Box<[AtomicU32]>], rows: usize) {
    let total: f64 = (0..rows).map(|i| f64::from(wide_f32(&wide[ROW], i))).sum();
    set_wide_f32(&wide[MEAN], 0, (total / rows as f64) as f32);
}

impl Codec for Factored {
    const NAME: &'static str = "factored";

    fn from_storage(storage: Storage) -> Option<Self> {
        (storage == Storage::Factorized).then_some(Factored)
    }

    fn describe(&self) -> String {
        "factorized".into()
    }

    fn regions(&self, shape: &[usize]) -> Vec<RegionSpec> {
        let (rows, cols) = dims(shape);
        let tensor = |len| super::Extent::Tensor { len };
        vec![
            RegionSpec::new(".row", Dtype::F32, tensor(rows)),
            RegionSpec::new(".col", Dtype::F32, tensor(cols)),
            RegionSpec::scratch("~mean", Dtype::F32, 1),
            RegionSpec::scratch("~exp", Dtype::U32, rows + cols),
            RegionSpec::scratch("~sum", Dtype::U32, 2 * (rows + cols)),
        ]
    }

    fn allowed(&self, slot: SlotKind) -> bool {
        slot == SlotKind::State2
    }

    fn quantized(&self) -> bool {
        true
    }

    fn resolve(&self, shape: &[usize]) -> Option<Storage> {
        (shape.len() < 2).then_some(Storage::F32)
    }

    fn folds(&self) -> &'static [FoldInput] {
        &[FoldInput::MomentGradient, FoldInput::MomentGradient]
    }

    fn validate(&self, host: &HostSlot, _values: bool) -> Result<(), String> {
        check_scales(host, ".row")?;
        check_scales(host, ".col")
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        let (_, cols) = dims(r.shape);
        let mean = wide_f32(&r.wide[MEAN], 0);
        let first = r.global + at;
        for (j, o) in out.iter_mut().enumerate() {
            let e = first + j;
            *o = if mean > 0.0 {
                wide_f32(&r.wide[ROW], e / cols) * wide_f32(&r.wide[COL], e % cols) / mean
            } else {
                0.0
            };
        }
    }

    /// The reconstruction is not stored: the statistics move in `combine`.
    fn encode(&self, _r: &mut RegionsMut<'_>, _at: usize, _values: &[f32], _random: Random) {}

    fn fold_targets(&self) -> &'static [usize] {
        &[EXP, SUM]
    }

    fn combine(&self, wide: &[Box<[AtomicU32]>], shape: &[usize], rule: &RuleConsts) -> bool {
        combine(wide, shape, rule)
    }

    fn fold(&self, r: &Regions<'_>, pass: usize, at: usize, values: &[f32]) {
        let (rows, cols) = dims(r.shape);
        let (fr, fc) = (frac_bits(cols), frac_bits(rows));
        let first = r.global + at;
        for (j, &x) in values.iter().enumerate() {
            // Only finite values count; zeros add nothing.
            if !x.is_finite() || x == 0.0 {
                continue;
            }
            let e = first + j;
            let (row, col) = (e / cols, rows + e % cols);
            if pass == 0 {
                let stored = (exponent(x) + EXP_BIAS) as u32;
                r.wide[EXP][row].fetch_max(stored, Ordering::Relaxed);
                r.wide[EXP][col].fetch_max(stored, Ordering::Relaxed);
            } else {
                let exp = |k: usize| r.wide[EXP][k].load(Ordering::Relaxed) as i32 - EXP_BIAS;
                add64(&r.wide[SUM], row, term(x, exp(row), fr));
                add64(&r.wide[SUM], col, term(x, exp(col), fc));
            }
        }
    }

    fn loaded(&self, wide: &[Box<[AtomicU32]>], shape: &[usize]) {
        mean_rows(wide, dims(shape).0);
    }
}
