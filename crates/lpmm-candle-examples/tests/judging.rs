//! The comparison's judging from synthetic runs: an unstable reference judges nothing, a stable
//! one judges as the comparison always has, and no tolerance exceeds the cap. (No training: the
//! runs are made up, so each case states exactly what it checks.)

use lpmm_candle_examples::experiments::{self, Goal, RunResult};
use lpmm_candle_examples::judge::{self, Rules, Task, TaskKind, Verdict};

const LM: &str = "some play";
/// The bigram baseline of the issue's play.
const BIGRAM: f64 = 2.47;

fn lm_task() -> Task {
    Task {
        name: LM.to_string(),
        kind: TaskKind::LanguageModel { bigram: BIGRAM },
    }
}

fn digits_task() -> Task {
    Task {
        name: "digits".to_string(),
        kind: TaskKind::Classifier,
    }
}

fn run(task: &str, preset: &str, seed: u64, val_loss: f64, val_accuracy: f64) -> RunResult {
    let p = experiments::presets()
        .into_iter()
        .find(|p| p.name == preset)
        .unwrap_or_else(|| panic!("no preset {preset}"));
    let bytes_per_param = match preset {
        "f32 SGDM" => 12.0,
        "LPMM-SGDM" => 3.19,
        "f32 AdamW" => 16.0,
        _ => 6.0,
    };
    RunResult {
        task: task.to_string(),
        preset: preset.to_string(),
        reference: p.reference.to_string(),
        seed,
        params: 1000,
        bytes_per_param,
        final_train_loss: val_loss,
        val_loss,
        val_accuracy,
        ms_per_step: 1.0,
        curve: vec![val_loss],
        curve_every: 1,
        sample: String::new(),
    }
}

fn row<'a>(j: &'a judge::Judgement, task: &str, preset: &str) -> &'a judge::Row {
    j.rows
        .iter()
        .find(|r| r.task == task && r.preset == preset)
        .unwrap_or_else(|| panic!("no row {task} / {preset}"))
}

/// The issue's comparison on a 115 KB play: f32 SGDM diverged on seed 1 (1.830, 2.341, 1.825),
/// which made LPMM-SGDM "within 0.5163 of 1.9987"; f32 AdamW was stable.
fn issue_runs() -> Vec<RunResult> {
    vec![
        run(LM, "f32 SGDM", 0, 1.830, 0.462),
        run(LM, "f32 SGDM", 1, 2.341, 0.335),
        run(LM, "f32 SGDM", 2, 1.825, 0.461),
        run(LM, "LPMM-SGDM", 0, 1.833, 0.46),
        run(LM, "f32 AdamW", 0, 1.704, 0.49),
        run(LM, "f32 AdamW", 1, 1.712, 0.49),
        run(LM, "f32 AdamW", 2, 1.706, 0.49),
        run(LM, "8-bit AdamW, bf16 SR", 0, 1.718, 0.487),
        run(LM, "bf16 AdamW, round to nearest", 0, 1.75, 0.47),
    ]
}

#[test]
fn an_unstable_reference_judges_nothing() {
    let presets = experiments::presets();
    let j = judge::judge(&presets, &issue_runs(), &[lm_task()], &Rules::default());
    let sgdm = j.reference(LM, "f32 SGDM").unwrap();
    let why = sgdm.unstable.as_deref().expect("f32 SGDM must be unstable");
    assert!(
        why.contains("val losses span 0.5160, 25.8% of their mean"),
        "{why}"
    );
    assert!(
        why.contains("seed 1 at 2.3410, not 10% below the bigram baseline 2.4700"),
        "{why}"
    );
    let r = row(&j, LM, "f32 SGDM");
    assert_eq!(r.verdict, Verdict::UnstableReference);
    assert!(r.goal.starts_with("reference, UNSTABLE"), "{}", r.goal);
    let r = row(&j, LM, "LPMM-SGDM");
    assert_eq!(r.verdict, Verdict::NotJudged, "{}", r.goal);
    assert_eq!(r.goal_met, None);
    assert_eq!(
        r.goal,
        "not judged: its reference f32 SGDM is unstable; memory at least 70% below f32 SGDM"
    );
    // The summary's list.
    let unstable: Vec<&str> = j.unstable().map(|c| c.preset.as_str()).collect();
    assert_eq!(unstable, ["f32 SGDM"]);
    assert_eq!(j.counts(), (1, 0, 1));
}

#[test]
fn a_stable_reference_judges_as_before() {
    let presets = experiments::presets();
    let j = judge::judge(&presets, &issue_runs(), &[lm_task()], &Rules::default());
    let adamw = j.reference(LM, "f32 AdamW").unwrap();
    assert!(adamw.stable(), "{:?}", adamw.unstable);
    // The spread (0.008) is under the floor: 1% of the mean, 1 accuracy point.
    let mean = (1.704 + 1.712 + 1.706) / 3.0;
    assert!((adamw.loss_tolerance - 0.01 * mean).abs() < 1e-12);
    assert!((adamw.accuracy_tolerance - 0.01).abs() < 1e-12);
    let r = row(&j, LM, "8-bit AdamW, bf16 SR");
    assert_eq!((r.verdict, r.goal_met), (Verdict::Met, Some(true)));
    assert_eq!(
        r.goal,
        "val loss within 0.0171 of 1.7073, accuracy within 1.0 points of 49.00%"
    );
    assert_eq!(row(&j, LM, "f32 AdamW").verdict, Verdict::Reference);
    assert_eq!(
        row(&j, LM, "bf16 AdamW, round to nearest").verdict,
        Verdict::NoGoal
    );

    // A stable spread above the floor and under the cap is the tolerance, as it always was: the
    // plays' f32 AdamW, 0.0329 at 1.7546 (docs/RESULTS.md).
    let runs = vec![
        run(LM, "f32 AdamW", 0, 1.7669, 0.48),
        run(LM, "f32 AdamW", 1, 1.7340, 0.485),
        run(LM, "f32 AdamW", 2, 1.7629, 0.476),
        run(LM, "8-bit AdamW, bf16 SR", 0, 1.7721, 0.4777),
        run(LM, "8-bit AdamW, bf16", 0, 1.7960, 0.47),
    ];
    let j = judge::judge(&presets, &runs, &[lm_task()], &Rules::default());
    let adamw = j.reference(LM, "f32 AdamW").unwrap();
    assert!(adamw.stable(), "{:?}", adamw.unstable);
    assert!((adamw.loss_tolerance - (1.7669 - 1.7340)).abs() < 1e-12);
    assert_eq!(row(&j, LM, "8-bit AdamW, bf16 SR").verdict, Verdict::Met);
    assert_eq!(row(&j, LM, "8-bit AdamW, bf16").verdict, Verdict::Missed);
}

#[test]
fn a_preset_above_the_cap_fails() {
    let presets = experiments::presets();
    let rules = Rules::default();
    // A stable reference whose seeds span 2.5% of their mean (under the 3% bound, over the 2%
    // cap): the tolerance is the cap, and a preset within the spread but above the cap fails.
    let runs = vec![
        run(LM, "f32 AdamW", 0, 1.975, 0.45),
        run(LM, "f32 AdamW", 1, 2.000, 0.45),
        run(LM, "f32 AdamW", 2, 2.025, 0.45),
        run(LM, "8-bit AdamW, bf16 SR", 0, 2.045, 0.45),
        run(LM, "4-bit AdamW, split f32", 0, 2.035, 0.45),
    ];
    let j = judge::judge(&presets, &runs, &[lm_task()], &rules);
    let adamw = j.reference(LM, "f32 AdamW").unwrap();
    assert!(adamw.stable(), "{:?}", adamw.unstable);
    assert!((adamw.val_loss_spread - 0.05).abs() < 1e-12);
    assert!((adamw.loss_tolerance - rules.loss_cap * 2.0).abs() < 1e-12);
    let r = row(&j, LM, "8-bit AdamW, bf16 SR");
    assert_eq!(r.verdict, Verdict::Missed, "{}", r.goal);
    assert!(
        r.goal.contains("within 0.0400 (the cap) of 2.0000"),
        "{}",
        r.goal
    );
    assert_eq!(row(&j, LM, "4-bit AdamW, split f32").verdict, Verdict::Met);

    // Accuracy likewise on a classifier: seeds spanning 2.5 points give a 2-point tolerance.
    let d = "digits";
    let runs = vec![
        run(d, "f32 AdamW", 0, 0.08, 0.970),
        run(d, "f32 AdamW", 1, 0.08, 0.980),
        run(d, "f32 AdamW", 2, 0.08, 0.995),
        run(d, "8-bit AdamW, bf16 SR", 0, 0.08, 0.960),
        run(d, "4-bit AdamW, split f32", 0, 0.08, 0.966),
    ];
    let j = judge::judge(&presets, &runs, &[digits_task()], &rules);
    assert!(j.reference(d, "f32 AdamW").unwrap().stable());
    let r = row(&j, d, "8-bit AdamW, bf16 SR");
    assert_eq!(r.verdict, Verdict::Missed, "{}", r.goal);
    assert_eq!(r.goal, "accuracy within 2.0 points (the cap) of 98.2%");
    assert_eq!(row(&j, d, "4-bit AdamW, split f32").verdict, Verdict::Met);
}

/// The issue's f32 CAME (2.282 while its LPMM twin reached 1.755): a reference that barely beats
/// the bigram count model judges nothing, and its own row says it is unstable as a reference.
#[test]
fn a_reference_that_did_not_train_judges_nothing() {
    let presets = experiments::presets();
    let runs = vec![
        run(LM, "f32 AdamW", 0, 1.704, 0.49),
        run(LM, "f32 AdamW", 1, 1.712, 0.49),
        run(LM, "f32 AdamW", 2, 1.706, 0.49),
        run(LM, "f32 CAME", 0, 2.282, 0.339),
        run(LM, "f32 CAME", 1, 2.290, 0.336),
        run(LM, "f32 CAME", 2, 2.275, 0.340),
        run(LM, "CAME, LPMM", 0, 1.755, 0.48),
    ];
    let j = judge::judge(&presets, &runs, &[lm_task()], &Rules::default());
    let came = j.reference(LM, "f32 CAME").unwrap();
    let why = came.unstable.as_deref().expect("f32 CAME must be unstable");
    assert!(
        why.contains("not 10% below the bigram baseline 2.4700"),
        "{why}"
    );
    let r = row(&j, LM, "f32 CAME");
    assert_eq!(
        r.verdict,
        Verdict::Missed,
        "its own check against f32 AdamW"
    );
    assert!(
        r.goal.contains("UNSTABLE as the reference of others"),
        "{}",
        r.goal
    );
    assert_eq!(row(&j, LM, "CAME, LPMM").verdict, Verdict::NotJudged);
}

/// A memory goal is checked even where the quality cannot be: missed, it fails the row.
#[test]
fn a_missed_memory_goal_fails_without_a_stable_reference() {
    let mut presets = experiments::presets();
    for p in &mut presets {
        if p.name == "LPMM-SGDM" {
            p.goal = Goal::QualityAndMemory { reduction: 0.9 };
        }
    }
    let j = judge::judge(&presets, &issue_runs(), &[lm_task()], &Rules::default());
    let r = row(&j, LM, "LPMM-SGDM");
    assert_eq!(r.verdict, Verdict::Missed, "{}", r.goal);
}

/// The low-learning-rate condition borrows the normal-rate reference's check: nothing is judged
/// when it is unstable, and with a stable one the naive baseline must be visibly worse.
#[test]
fn the_low_rate_condition_follows_its_reference() {
    let presets = experiments::presets();
    let low = "some play, AdamW lr / 10";
    let mut runs = issue_runs();
    runs.extend([
        run(low, "f32 AdamW", 0, 2.13, 0.38),
        run(low, "8-bit AdamW, bf16 SR", 0, 2.125, 0.38),
        run(low, "bf16 AdamW, round to nearest", 0, 2.317, 0.35),
    ]);
    let rules = Rules::default();
    let j = judge::judge(&presets, &runs, &[lm_task()], &rules);
    let main = j.reference(LM, "f32 AdamW").unwrap();
    let rows = judge::judge_underflow(&presets, &runs, low, main, &rules);
    let verdicts: Vec<Verdict> = rows.iter().map(|r| r.verdict).collect();
    assert_eq!(verdicts, [Verdict::Reference, Verdict::Met, Verdict::Met]);

    let mut unstable = main.clone();
    unstable.unstable = Some("made up".to_string());
    let rows = judge::judge_underflow(&presets, &runs, low, &unstable, &rules);
    let verdicts: Vec<Verdict> = rows.iter().map(|r| r.verdict).collect();
    assert_eq!(
        verdicts,
        [
            Verdict::UnstableReference,
            Verdict::NotJudged,
            Verdict::NotJudged
        ]
    );
}
