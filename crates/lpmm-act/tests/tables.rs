//! The few-bit tables lpmm's solver computes (1 to 4 bits, N(0,1) weight, 1,024 points on
//! [-8, 8]) and their N(0,1)-weighted RMS derivative error, snapshotted: a change to the solver,
//! the grid or the derivatives shows here. (Pure-Rust libm keeps them the same on every
//! platform.)

use lpmm_act::{Activation, Grid, Table, Weight};

#[test]
fn few_bit_tables() {
    let mut out = String::new();
    let f = |v: &[f32]| {
        v.iter()
            .map(|x| format!("{x:.4}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for act in Activation::ALL {
        for bits in 1..=4 {
            let t = Table::solve(act, bits, Weight::STANDARD, Grid::default()).unwrap();
            let e = t.rms_error(act, Weight::STANDARD, Grid::default(), 200_000);
            out.push_str(&format!(
                "{} {bits} bits: N(0,1)-weighted RMS derivative error {e:.5}\n  thresholds [{}]\n  levels     [{}]\n",
                act.name(),
                f(&t.thresholds),
                f(&t.levels)
            ));
        }
    }
    insta::assert_snapshot!(out);
}
