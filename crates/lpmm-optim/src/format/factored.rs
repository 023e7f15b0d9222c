//! Adafactor's factorized second moment (Shazeer & Stern 2018), for the tensor viewed as
//! `rows x cols` (leading dimensions x last): `r_i` and `c_j`, moving averages of the row and
//! column means of the squares of the rule's moment input ([`crate::rule::Rule::moment_input`]:
//! the gradient for a second moment), reconstruct `v_ij = (r_i / mean(r)) c_j`. In the slots a
//! rule averages squares in ([`crate::rule::Rule::factorable`]); 1-D tensors keep a full f32
//! state 2 and no state 3 ([docs/OPTIMIZERS.md]).
//!
//! The row and column sums of squares are exact in any order ([`crate::fixed`]), so every
//! backend computes them bit for bit however it splits the work.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use std::sync::atomic::{AtomicU32, Ordering};

use super::Storage;
use super::{
    Codec, Cover, Dtype, FoldInput, HostSlot, Random, RegionSpec, Regions, RegionsMut,
    check_scales, set_wide_f32, wide_f32,
};
use crate::fixed;
use crate::rule::RuleConsts;
use crate::vocab::SlotKind;

/// The factorized second moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Factored;

/// Wide regions.
const ROW: usize = 0;
const COL: usize = 1;
const MEAN: usize = 2;
const EXP: usize = 3;
const SUM: usize = 4;

/// `(rows, cols)` of a tensor of `shape`.
pub fn dims(shape: &[usize]) -> (usize, usize) {
    let cols = shape.last().copied().unwrap_or(1).max(1);
    (shape.iter().product::<usize>() / cols, cols)
}

/// After the folds: moves the row and column averages by this step's means plus the moment's
/// eps and recomputes `mean(r)` — unless that would not fit: a new average that is not finite
/// keeps its old value, and if the new averages would rebuild a value that is not finite
/// ([`rebuilds_finite`]) none of them moves. Either way the step reports the parameter (true),
/// as it reports any value that would overflow its slot. The same host code for every backend.
fn combine(wide: &[Box<[AtomicU32]>], shape: &[usize], rule: &RuleConsts, slot: SlotKind) -> bool {
    let Some(ema) = rule.moment(slot) else {
        return false;
    };
    let (rows, cols) = dims(shape);
    let mut kept = false;
    // The new average of word `k` of `region` (its old one if the new one is not finite).
    let new = |region: usize, k: usize, sum_at: usize, count: usize, kept: &mut bool| {
        let mean = (fixed::total(&wide[EXP], &wide[SUM], sum_at, count) / count as f64) as f32;
        let old = wide_f32(&wide[region], k);
        let new = ema.one_minus_beta.mul_add(mean + ema.eps, old * ema.beta);
        if new.is_finite() {
            new
        } else {
            *kept = true;
            old
        }
    };
    // First the new averages' sum of rows (in row order, as `mean_rows` sums) and largest row
    // and column, then, if they rebuild finite values, the averages themselves.
    let (mut total, mut row_max, mut col_max) = (0f64, 0f32, 0f32);
    for i in 0..rows {
        let r = new(ROW, i, i, cols, &mut kept);
        total += f64::from(r);
        row_max = row_max.max(r);
    }
    for j in 0..cols {
        col_max = col_max.max(new(COL, j, rows + j, rows, &mut kept));
    }
    if !rebuilds_finite((total / rows as f64) as f32, row_max, col_max) {
        return true;
    }
    let mut ignored = false;
    for i in 0..rows {
        let r = new(ROW, i, i, cols, &mut ignored);
        set_wide_f32(&wide[ROW], i, r);
    }
    for j in 0..cols {
        let c = new(COL, j, rows + j, rows, &mut ignored);
        set_wide_f32(&wide[COL], j, c);
    }
    mean_rows(wide, rows);
    kept
}

/// Whether statistics with `mean(r)` = `mean`, largest row `row_max` and largest column
/// `col_max` rebuild only finite values: `f32(f32(r_i / mean) * c_j)` grows with `r_i` and `c_j`
/// (all non-negative), so its largest value is `f32(f32(row_max / mean) * col_max)`. A mean of 0
/// rebuilds zeros.
fn rebuilds_finite(mean: f32, row_max: f32, col_max: f32) -> bool {
    mean <= 0.0 || (row_max / mean * col_max).is_finite()
}

/// `mean(r)`, in f64 in row order, rounded to f32.
fn mean_rows(wide: &[Box<[AtomicU32]>], rows: usize) {
    let total: f64 = (0..rows).map(|i| f64::from(wide_f32(&wide[ROW], i))).sum();
    set_wide_f32(&wide[MEAN], 0, (total / rows as f64) as f32);
}

impl Codec for Factored {
    const NAME: &'static str = "factored";
    const COVER: Cover = Cover {
        tensor_wide: &[("factorized", Storage::Factorized)],
        ..Cover::NONE
    };

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
        matches!(slot, SlotKind::State2 | SlotKind::State3)
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
        check_scales(host, ".col")?;
        // What the statistics rebuild must be finite too (`mean(r)` as `mean_rows` computes it).
        let values = |suffix: &str| host.f32s(suffix).unwrap_or_default();
        let (row, col) = (values(".row"), values(".col"));
        let total: f64 = row.iter().map(|&r| f64::from(r)).sum();
        let mean = (total / row.len().max(1) as f64) as f32;
        let max = |v: &[f32]| v.iter().fold(0f32, |m, &x| m.max(x));
        if rebuilds_finite(mean, max(&row), max(&col)) {
            Ok(())
        } else {
            Err(format!(
                "its statistics rebuild a value that is not finite: (largest row {} / mean of \
                 the rows {mean}) x largest column {}",
                max(&row),
                max(&col)
            ))
        }
    }

    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
        let (_, cols) = dims(r.shape);
        let mean = wide_f32(&r.wide[MEAN], 0);
        let first = r.global + at;
        if mean <= 0.0 {
            out.fill(0.0);
            return;
        }
        // `(row / mean) * col` element by element, the row's quotient computed once per run of
        // the row's elements (the same f32 operations in the same order).
        let mut j = 0;
        while j < out.len() {
            let row = (first + j) / cols;
            let end = ((row + 1) * cols - first).min(out.len());
            let scale = wide_f32(&r.wide[ROW], row) / mean;
            let col0 = (first + j) % cols;
            let col = &r.wide[COL][col0..col0 + (end - j)];
            for (o, c) in out[j..end].iter_mut().zip(col) {
                *o = scale * f32::from_bits(c.load(Ordering::Relaxed));
            }
            j = end;
        }
    }

    /// The reconstruction is not stored: the statistics move in `combine`.
    fn encode(&self, _r: &mut RegionsMut<'_>, _at: usize, _values: &[f32], _random: Random) {}

    fn fold_targets(&self) -> &'static [usize] {
        &[EXP, SUM]
    }

    fn combine(
        &self,
        wide: &[Box<[AtomicU32]>],
        shape: &[usize],
        rule: &RuleConsts,
        slot: SlotKind,
    ) -> bool {
        combine(wide, shape, rule, slot)
    }

    fn fold(
        &self,
        r: &Regions<'_>,
        pass: usize,
        at: usize,
        values: &[f32],
        local: &mut fixed::Local,
    ) {
        let (rows, cols) = dims(r.shape);
        let first = r.global + at;
        let (exp, sum) = (&r.wide[EXP], &r.wide[SUM]);
        // Column sums: each chunk holds a few elements of every column, so they are summed in
        // `local` over the whole piece and applied once (`fold_flush`). A matrix with more
        // columns than `local` holds has at most one element of a column in a chunk: those fold
        // one by one.
        let held = local.ready(exp, rows, cols, pass);
        // Row sums: each run of one row's elements in one atomic operation.
        let mut j = 0;
        while j < values.len() {
            let row = (first + j) / cols;
            let end = ((row + 1) * cols - first).min(values.len());
            let run = &values[j..end];
            fixed::fold_many(exp, sum, row, cols, pass, run);
            let col = (first + j) % cols;
            if held {
                local.fold_run(col, rows, pass, run);
            } else {
                for (k, &x) in run.iter().enumerate() {
                    fixed::fold(exp, sum, rows + col + k, rows, pass, x);
                }
            }
            j = end;
        }
    }

    fn fold_flush(&self, r: &Regions<'_>, pass: usize, local: &fixed::Local) {
        let (rows, _) = dims(r.shape);
        local.flush(&r.wide[EXP], &r.wide[SUM], rows, pass);
    }

    fn loaded(&self, wide: &[Box<[AtomicU32]>], shape: &[usize]) {
        mean_rows(wide, dims(shape).0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row and column sums of squares the CPU folds (runs of a row at once, columns in a
    /// piece's local words, or one by one for matrices wider than those) are the words of
    /// folding every element atomically, for pieces and chunks that cut rows anywhere.
    #[test]
    fn folded_sums_equal_folding_each_element() {
        for (rows, cols) in [(7, 1000), (3, fixed::LOCAL_SUMS + 3)] {
            let shape = [rows, cols];
            let n = rows * cols;
            let values: Vec<f32> = (0..n)
                .map(|i| match i % 97 {
                    0 => 0.0,
                    1 => f32::NAN,
                    2 => 1e-45,
                    3 => -3e38,
                    _ => (i as f32 * 0.377).sin() * 10f32.powi((i % 11) as i32 - 5),
                })
                .collect();
            let words = |k: usize| (0..k).map(|_| AtomicU32::new(0)).collect::<Box<[_]>>();
            let wide = || -> Vec<Box<[AtomicU32]>> {
                vec![
                    words(rows),
                    words(cols),
                    words(1),
                    words(rows + cols),
                    words(2 * (rows + cols)),
                ]
            };
            let (folded, each) = (wide(), wide());
            let (piece, chunk) = (2500, 600);
            for pass in 0..2 {
                for (p, part) in values.chunks(piece).enumerate() {
                    let r = Regions {
                        elem: [&[]; 3],
                        wide: &folded,
                        global: p * piece,
                        shape: &shape,
                    };
                    let mut local = fixed::Local::default();
                    for (c, values) in part.chunks(chunk).enumerate() {
                        Factored.fold(&r, pass, c * chunk, values, &mut local);
                    }
                    Factored.fold_flush(&r, pass, &local);
                }
                for (i, &x) in values.iter().enumerate() {
                    let (e, s) = (&each[EXP], &each[SUM]);
                    fixed::fold(e, s, i / cols, cols, pass, x);
                    fixed::fold(e, s, rows + i % cols, rows, pass, x);
                }
            }
            let read = |w: &[AtomicU32]| w.iter().map(|a| a.load(Ordering::Relaxed)).collect();
            let read: fn(&[AtomicU32]) -> Vec<u32> = read;
            assert_eq!(read(&folded[EXP]), read(&each[EXP]), "{rows}x{cols}");
            assert_eq!(read(&folded[SUM]), read(&each[SUM]), "{rows}x{cols}");
            assert!(read(&each[SUM]).iter().any(|&w| w != 0));
        }
    }
}
