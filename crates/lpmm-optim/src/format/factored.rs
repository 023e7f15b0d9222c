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

use std::sync::atomic::AtomicU32;

use super::{
    Codec, Dtype, FoldInput, HostSlot, Random, RegionSpec, Regions, RegionsMut, check_scales,
    set_wide_f32, wide_f32,
};
use crate::backend::SlotKind;
use crate::config::Storage;
use crate::fixed;
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

/// `(rows, cols)` of a tensor of `shape`.
pub fn dims(shape: &[usize]) -> (usize, usize) {
    let cols = shape.last().copied().unwrap_or(1).max(1);
    (shape.iter().product::<usize>() / cols, cols)
}

/// After the folds: moves the row and column averages by this step's means plus the moment's
/// eps (a value that would not fit keeps its old one, and the step reports the parameter: true)
/// and recomputes `mean(r)`. The same host code for every backend.
fn combine(wide: &[Box<[AtomicU32]>], shape: &[usize], rule: &RuleConsts, slot: SlotKind) -> bool {
    let Some(ema) = rule.moment(slot) else {
        return false;
    };
    let (rows, cols) = dims(shape);
    let mut kept = false;
    let mut update = |region: usize, k: usize, sum_at: usize, count: usize| {
        let mean = (fixed::total(&wide[EXP], &wide[SUM], sum_at, count) / count as f64) as f32;
        let new = ema
            .one_minus_beta
            .mul_add(mean + ema.eps, wide_f32(&wide[region], k) * ema.beta);
        if new.is_finite() {
            set_wide_f32(&wide[region], k, new);
        } else {
            kept = true;
        }
    };
    for i in 0..rows {
        update(ROW, i, i, cols);
    }
    for j in 0..cols {
        update(COL, j, rows + j, rows);
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
        check_scales(host, ".col")
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
            for (k, o) in out[j..end].iter_mut().enumerate() {
                *o = scale * wide_f32(&r.wide[COL], col0 + k);
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

    fn fold(&self, r: &Regions<'_>, pass: usize, at: usize, values: &[f32]) {
        let (rows, cols) = dims(r.shape);
        let first = r.global + at;
        let (exp, sum) = (&r.wide[EXP], &r.wide[SUM]);
        // Row sums: each run of one row's elements in one atomic operation.
        let mut j = 0;
        while j < values.len() {
            let row = (first + j) / cols;
            let end = ((row + 1) * cols - first).min(values.len());
            fixed::fold_many(exp, sum, row, cols, pass, values[j..end].iter().copied());
            j = end;
        }
        // Column sums: each column's elements of these values (every `cols`-th) at once.
        for j in 0..cols.min(values.len()) {
            let col = (first + j) % cols;
            let column = values[j..].iter().step_by(cols).copied();
            fixed::fold_many(exp, sum, rows + col, rows, pass, column);
        }
    }

    fn loaded(&self, wide: &[Box<[AtomicU32]>], shape: &[usize]) {
        mean_rows(wide, dims(shape).0);
    }
}
