//! A short version of the comparison: every preset's training loss falls on both tasks, and the
//! report's JSON has the documented fields. No timing assertions.

use lpmm_candle::experiments::{self, Budget, RunResult};

fn falls(r: &RunResult) {
    let first = r.curve[0];
    let last = *r.curve.last().unwrap();
    assert!(
        last < 0.9 * first,
        "{} on {}: loss {first} -> {last}",
        r.preset,
        r.task
    );
    assert!(
        r.val_loss.is_finite() && (0.0..=1.0).contains(&r.val_accuracy),
        "{r:?}"
    );
}

#[test]
fn every_preset_learns_on_both_tasks_and_the_json_schema_holds() -> candle_core::Result<()> {
    let digits = experiments::digits()?;
    assert_eq!((digits.train_y.len(), digits.val_y.len()), (1437, 360));
    let text = experiments::shakespeare()?;
    assert_eq!(text.vocab.len(), 76);
    for preset in experiments::presets() {
        let d = experiments::run_digits(
            &digits,
            &preset,
            0,
            Budget {
                steps: 60,
                batch: 64,
            },
            |_| {},
        )?;
        falls(&d);
        let s = experiments::run_shakespeare(
            &text,
            &preset,
            0,
            Budget {
                steps: 30,
                batch: 16,
            },
            |_| {},
        )?;
        falls(&s);
        println!(
            "{}: digits {:.2} ms/step, shakespeare {:.1} ms/step",
            preset.name, d.ms_per_step, s.ms_per_step
        );
        let json = serde_json::to_value(&s).unwrap();
        for field in [
            "task",
            "preset",
            "reference",
            "seed",
            "params",
            "bytes_per_param",
            "final_train_loss",
            "val_loss",
            "val_accuracy",
            "ms_per_step",
            "curve",
            "curve_every",
        ] {
            assert!(json.get(field).is_some(), "missing {field}");
        }
    }
    Ok(())
}
