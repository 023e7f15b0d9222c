//! The comparison's judging, a pure function of run results: each reference's seeds are checked
//! for stability first, and only a stable reference judges the presets that name it.
//!
//! A reference's seed spread is the yardstick of "within the reference's noise", so a reference
//! that diverged on one seed would make every check against it vacuous (a spread of half a nat
//! passes anything short of a collapse). Hence, with [`Rules::default`]:
//!
//! - a reference is **unstable** when its seeds' validation losses span more than
//!   [`Rules::loss_spread_bound`] of their mean (language models), their accuracies more than
//!   [`Rules::accuracy_spread_bound`], or a language model's seed does not beat the text's
//!   bigram count model by [`Rules::bigram_margin`]; the presets it would judge are **not
//!   judged**;
//! - a stable reference's tolerance is its seed spread, at least the floor (1% of the mean val
//!   loss, 1 accuracy point) and **never more than the cap** ([`Rules::loss_cap`],
//!   [`Rules::accuracy_cap`]).
//!
//! docs/RESULTS.md ("How the checks judge") gives the runs these numbers come from.

use serde::Serialize;

use crate::experiments::{Goal, Preset, RunResult};

/// The bounds of the judging. [`Rules::default`] is the comparison's; docs/RESULTS.md says why
/// each number is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rules {
    /// The least validation-loss tolerance, a fraction of the reference's mean.
    pub loss_floor: f64,
    /// The most validation-loss tolerance, a fraction of the reference's mean.
    pub loss_cap: f64,
    /// A reference whose seeds' validation losses span more than this fraction of their mean is
    /// unstable.
    pub loss_spread_bound: f64,
    /// The least accuracy tolerance (a fraction: 0.01 is one point).
    pub accuracy_floor: f64,
    /// The most accuracy tolerance.
    pub accuracy_cap: f64,
    /// A reference whose seeds' accuracies span more than this is unstable.
    pub accuracy_spread_bound: f64,
    /// Every seed of a language model's reference must end at a validation loss at least this
    /// fraction below the bigram count model's (a seed at `bigram * (1 - margin)` or above has
    /// learned little beyond character pairs).
    pub bigram_margin: f64,
    /// The least number of seeds that shows a reference's spread.
    pub min_seeds: usize,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            loss_floor: 0.01,
            loss_cap: 0.02,
            loss_spread_bound: 0.03,
            accuracy_floor: 0.01,
            accuracy_cap: 0.02,
            accuracy_spread_bound: 0.03,
            bigram_margin: 0.10,
            min_seeds: 2,
        }
    }
}

/// What a task's goals measure.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// A classifier: goals on validation accuracy.
    Classifier,
    /// A language model: goals on validation loss and accuracy; `bigram` is the validation loss
    /// (nats per character) of the text's bigram count model ([`crate::experiments::baselines`]).
    LanguageModel {
        /// The bigram baseline of the task's text.
        bigram: f64,
    },
}

/// A task the comparison ran: the `task` of its runs and what its goals measure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Task {
    /// The runs' `task`.
    pub name: String,
    /// What its goals measure.
    pub kind: TaskKind,
}

/// A reference's seeds and what they allow.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReferenceCheck {
    /// The task.
    pub task: String,
    /// The reference preset.
    pub preset: String,
    /// Its seeds, in run order.
    pub seeds: Vec<u64>,
    /// Each seed's validation loss.
    pub val_losses: Vec<f64>,
    /// Each seed's validation accuracy.
    pub val_accuracies: Vec<f64>,
    /// Mean validation loss over the seeds.
    pub val_loss: f64,
    /// Mean validation accuracy over the seeds.
    pub val_accuracy: f64,
    /// max - min of the validation losses.
    pub val_loss_spread: f64,
    /// max - min of the validation accuracies.
    pub val_accuracy_spread: f64,
    /// The validation-loss tolerance of the presets it judges (absolute, nats): the spread, at
    /// least the floor, at most the cap.
    pub loss_tolerance: f64,
    /// The accuracy tolerance (a fraction), likewise.
    pub accuracy_tolerance: f64,
    /// `Some(why)` when the reference is unstable: the presets it would judge are not judged.
    pub unstable: Option<String>,
}

impl ReferenceCheck {
    /// Whether it may judge.
    pub fn stable(&self) -> bool {
        self.unstable.is_none()
    }
}

/// The outcome of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// A stable reference (or, for a preset that is also a reference, its own check was met).
    Reference,
    /// A reference whose seeds disagree or did not train: it judges nothing.
    UnstableReference,
    /// The goal was met.
    Met,
    /// The goal was missed.
    Missed,
    /// The goal could not be checked (its reference is unstable or missing).
    NotJudged,
    /// No goal (the naive baseline in the main table).
    NoGoal,
}

impl Verdict {
    /// The table's word for it.
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Reference => "-",
            Verdict::UnstableReference => "UNSTABLE",
            Verdict::Met => "yes",
            Verdict::Missed => "NO",
            Verdict::NotJudged => "not judged",
            Verdict::NoGoal => "-",
        }
    }

    /// `goal_met` in the JSON: `Some` only for a goal that was checked.
    pub fn met(self) -> Option<bool> {
        match self {
            Verdict::Met => Some(true),
            Verdict::Missed => Some(false),
            _ => None,
        }
    }
}

/// One row of the table: a (task, preset) with its runs averaged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// The task.
    pub task: String,
    /// The preset.
    pub preset: String,
    /// The preset it is compared with.
    pub reference: String,
    /// Model memory (lent `Var`s included), bytes per parameter.
    pub bytes_per_param: f64,
    /// `(bytes / reference bytes - 1) * 100`.
    pub memory_vs_reference_percent: f64,
    /// Mean training loss over the last 10% of steps.
    pub final_train_loss: f64,
    /// Validation cross-entropy (nats).
    pub val_loss: f64,
    /// Validation accuracy in [0, 1].
    pub val_accuracy: f64,
    /// Wall time per optimizer step.
    pub ms_per_step: f64,
    /// The goal checked for this row, in words (for a reference: whether it is stable).
    pub goal: String,
    /// `true` / `false` where the goal was checked; `null` for references, the naive baseline
    /// and rows not judged.
    pub goal_met: Option<bool>,
    /// The outcome.
    pub verdict: Verdict,
}

/// The judging of a comparison: its rows and its references' checks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Judgement {
    /// One per (task, preset), in the order of the tasks and presets given.
    pub rows: Vec<Row>,
    /// One per (task, reference preset).
    pub references: Vec<ReferenceCheck>,
}

impl Judgement {
    /// The references that judge nothing.
    pub fn unstable(&self) -> impl Iterator<Item = &ReferenceCheck> {
        self.references.iter().filter(|r| !r.stable())
    }

    /// The reference check of `preset` on `task`.
    pub fn reference(&self, task: &str, preset: &str) -> Option<&ReferenceCheck> {
        self.references
            .iter()
            .find(|r| r.task == task && r.preset == preset)
    }

    /// (met, missed, not judged) over the rows with a goal.
    pub fn counts(&self) -> (usize, usize, usize) {
        count(&self.rows)
    }
}

/// (met, missed, not judged) over `rows`.
pub fn count(rows: &[Row]) -> (usize, usize, usize) {
    let n = |v: Verdict| rows.iter().filter(|r| r.verdict == v).count();
    (n(Verdict::Met), n(Verdict::Missed), n(Verdict::NotJudged))
}

/// Whether `name` judges another preset (is named as a reference by one that is not itself):
/// such a preset runs several seeds.
pub fn is_reference(presets: &[Preset], name: &str) -> bool {
    presets.iter().any(|p| p.reference == name)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn spread(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().copied().fold(f64::MIN, f64::max) - v.iter().copied().fold(f64::MAX, f64::min)
}

fn field(rs: &[&RunResult], f: fn(&RunResult) -> f64) -> f64 {
    mean(&rs.iter().map(|r| f(r)).collect::<Vec<_>>())
}

/// Checks the runs of reference `preset` on `task`: `None` if it has none.
pub fn check_reference(
    task: &Task,
    preset: &str,
    runs: &[RunResult],
    rules: &Rules,
) -> Option<ReferenceCheck> {
    let mine: Vec<&RunResult> = runs
        .iter()
        .filter(|r| r.task == task.name && r.preset == preset)
        .collect();
    if mine.is_empty() {
        return None;
    }
    let val_losses: Vec<f64> = mine.iter().map(|r| r.val_loss).collect();
    let val_accuracies: Vec<f64> = mine.iter().map(|r| r.val_accuracy).collect();
    let (val_loss, val_accuracy) = (mean(&val_losses), mean(&val_accuracies));
    let (loss_spread, acc_spread) = (spread(&val_losses), spread(&val_accuracies));
    let mut why = Vec::new();
    if mine.len() < rules.min_seeds {
        why.push(format!(
            "{} seed, fewer than the {} that show a spread",
            mine.len(),
            rules.min_seeds
        ));
    }
    if let Some(bad) = val_losses.iter().find(|v| !v.is_finite()) {
        why.push(format!("a seed ended at val loss {bad}"));
    }
    if let TaskKind::LanguageModel { bigram } = task.kind {
        if loss_spread > rules.loss_spread_bound * val_loss {
            why.push(format!(
                "val losses span {loss_spread:.4}, {:.1}% of their mean {val_loss:.4} (bound {:.0}%)",
                100.0 * loss_spread / val_loss,
                100.0 * rules.loss_spread_bound
            ));
        }
        let limit = bigram * (1.0 - rules.bigram_margin);
        let above: Vec<&&RunResult> = mine.iter().filter(|r| r.val_loss >= limit).collect();
        if !above.is_empty() {
            let list = |f: &dyn Fn(&RunResult) -> String| {
                above.iter().map(|r| f(r)).collect::<Vec<_>>().join(", ")
            };
            why.push(format!(
                "seed{} {} at {}, not {:.0}% below the bigram baseline {bigram:.4} (under \
                 {limit:.4})",
                if above.len() > 1 { "s" } else { "" },
                list(&|r| r.seed.to_string()),
                list(&|r| format!("{:.4}", r.val_loss)),
                100.0 * rules.bigram_margin
            ));
        }
    }
    if acc_spread > rules.accuracy_spread_bound {
        why.push(format!(
            "accuracies span {:.2} points (bound {:.0})",
            100.0 * acc_spread,
            100.0 * rules.accuracy_spread_bound
        ));
    }
    let loss_tolerance = loss_spread.clamp(
        rules.loss_floor * val_loss,
        (rules.loss_cap * val_loss).max(rules.loss_floor * val_loss),
    );
    let accuracy_tolerance = acc_spread.clamp(
        rules.accuracy_floor,
        rules.accuracy_cap.max(rules.accuracy_floor),
    );
    Some(ReferenceCheck {
        task: task.name.clone(),
        preset: preset.to_string(),
        seeds: mine.iter().map(|r| r.seed).collect(),
        val_losses,
        val_accuracies,
        val_loss,
        val_accuracy,
        val_loss_spread: loss_spread,
        val_accuracy_spread: acc_spread,
        loss_tolerance,
        accuracy_tolerance,
        unstable: (!why.is_empty()).then(|| why.join("; ")),
    })
}

/// The row of `p` on `task` with `goal` and `verdict`.
fn row(
    task: &str,
    p: &Preset,
    mine: &[&RunResult],
    reference: &[&RunResult],
    goal: String,
    verdict: Verdict,
) -> Row {
    let bytes = field(mine, |r| r.bytes_per_param);
    let ref_bytes = field(reference, |r| r.bytes_per_param);
    Row {
        task: task.to_string(),
        preset: p.name.to_string(),
        reference: p.reference.to_string(),
        bytes_per_param: bytes,
        memory_vs_reference_percent: if reference.is_empty() {
            f64::NAN
        } else {
            100.0 * (bytes / ref_bytes - 1.0)
        },
        final_train_loss: field(mine, |r| r.final_train_loss),
        val_loss: field(mine, |r| r.val_loss),
        val_accuracy: field(mine, |r| r.val_accuracy),
        ms_per_step: field(mine, |r| r.ms_per_step),
        goal,
        goal_met: verdict.met(),
        verdict,
    }
}

/// The quality check of `mine` against a stable reference: the goal in words and whether it
/// was met.
fn quality(
    kind: TaskKind,
    mine: &[&RunResult],
    r: &ReferenceCheck,
    rules: &Rules,
) -> (String, bool) {
    let (loss, acc) = (field(mine, |r| r.val_loss), field(mine, |r| r.val_accuracy));
    let capped = |capped: bool| if capped { " (the cap)" } else { "" };
    let acc_capped = r.val_accuracy_spread > rules.accuracy_cap;
    match kind {
        TaskKind::LanguageModel { .. } => (
            format!(
                "val loss within {:.4}{} of {:.4}, accuracy within {:.1} points{} of {:.2}%",
                r.loss_tolerance,
                capped(r.val_loss_spread > rules.loss_cap * r.val_loss),
                r.val_loss,
                100.0 * r.accuracy_tolerance,
                capped(acc_capped),
                100.0 * r.val_accuracy
            ),
            loss <= r.val_loss + r.loss_tolerance && acc >= r.val_accuracy - r.accuracy_tolerance,
        ),
        TaskKind::Classifier => (
            format!(
                "accuracy within {:.1} points{} of {:.1}%",
                100.0 * r.accuracy_tolerance,
                capped(acc_capped),
                100.0 * r.val_accuracy
            ),
            acc >= r.val_accuracy - r.accuracy_tolerance,
        ),
    }
}

/// Judges every preset of `presets` on every task of `tasks` from `runs`: one row per (task,
/// preset) that has runs (a preset's runs averaged over its seeds), and one check per (task,
/// reference). A preset whose reference is unstable or has no runs is not judged; a preset that
/// is itself the reference of others (f32 CAME judges CAME, LPMM) keeps its own check against
/// its reference, and its goal says when it is unstable as a reference.
pub fn judge(presets: &[Preset], runs: &[RunResult], tasks: &[Task], rules: &Rules) -> Judgement {
    let mut rows = Vec::new();
    let mut references = Vec::new();
    for task in tasks {
        let of = |name: &str| {
            runs.iter()
                .filter(|r| r.task == task.name && r.preset == name)
                .collect::<Vec<_>>()
        };
        for p in presets.iter().filter(|p| is_reference(presets, p.name)) {
            if let Some(c) = check_reference(task, p.name, runs, rules) {
                references.push(c);
            }
        }
        let check_of = |name: &str| {
            references
                .iter()
                .find(|c: &&ReferenceCheck| c.task == task.name && c.preset == name)
        };
        for p in presets {
            let mine = of(p.name);
            if mine.is_empty() {
                continue;
            }
            let reference = of(p.reference);
            let (mut goal, verdict) = match p.goal {
                Goal::Reference => match check_of(p.name) {
                    Some(c) if !c.stable() => (
                        format!(
                            "reference, UNSTABLE: {}",
                            c.unstable.as_deref().unwrap_or_default()
                        ),
                        Verdict::UnstableReference,
                    ),
                    _ => ("reference".to_string(), Verdict::Reference),
                },
                Goal::NaiveBaseline => (
                    "none (the naive baseline; see the low-learning-rate condition)".to_string(),
                    Verdict::NoGoal,
                ),
                Goal::Quality | Goal::QualityAndMemory { .. } => {
                    let (goal, quality) = match check_of(p.reference) {
                        None => (format!("not judged: {} has no runs", p.reference), None),
                        Some(c) if !c.stable() => (
                            format!("not judged: its reference {} is unstable", p.reference),
                            None,
                        ),
                        Some(c) => {
                            let (goal, met) = quality(task.kind, &mine, c, rules);
                            (goal, Some(met))
                        }
                    };
                    // A memory goal does not depend on the reference's seeds: missed, it fails
                    // the row even where the quality cannot be judged.
                    let (goal, memory) = match p.goal {
                        Goal::QualityAndMemory { reduction } if !reference.is_empty() => {
                            let saved = 1.0
                                - field(&mine, |r| r.bytes_per_param)
                                    / field(&reference, |r| r.bytes_per_param);
                            (
                                format!(
                                    "{goal}; memory at least {:.0}% below {}",
                                    100.0 * reduction,
                                    p.reference
                                ),
                                Some(saved >= reduction),
                            )
                        }
                        _ => (goal, None),
                    };
                    let verdict = match (quality, memory) {
                        (Some(false), _) | (_, Some(false)) => Verdict::Missed,
                        (None, _) => Verdict::NotJudged,
                        (Some(true), _) => Verdict::Met,
                    };
                    (goal, verdict)
                }
            };
            if p.goal != Goal::Reference
                && let Some(c) = check_of(p.name)
                && let Some(why) = &c.unstable
            {
                goal = format!("{goal}; UNSTABLE as the reference of others: {why}");
            }
            rows.push(row(&task.name, p, &mine, &reference, goal, verdict));
        }
    }
    Judgement { rows, references }
}

/// The low-learning-rate condition (`task`: one seed of each preset on the language model at a
/// lower rate), judged with the tolerance of `main` (the same reference's check at the normal
/// rate, whose seeds it borrows): a [`Goal::NaiveBaseline`] preset must be visibly worse than the
/// reference (train and val loss above the reference's by more than 1% plus the tolerance), every
/// other preset within the tolerance. Nothing is judged when `main` is unstable.
pub fn judge_underflow(
    presets: &[Preset],
    runs: &[RunResult],
    task: &str,
    main: &ReferenceCheck,
    rules: &Rules,
) -> Vec<Row> {
    let of = |name: &str| {
        runs.iter()
            .filter(|r| r.task == task && r.preset == name)
            .collect::<Vec<_>>()
    };
    let reference = of(&main.preset);
    let mut rows = Vec::new();
    if reference.is_empty() {
        return rows;
    }
    let (ref_val, ref_train) = (
        field(&reference, |r| r.val_loss),
        field(&reference, |r| r.final_train_loss),
    );
    // The main reference's spread (its seeds are at the normal rate), within the floor and the
    // cap of this reference's loss.
    let tol = main.val_loss_spread.clamp(
        rules.loss_floor * ref_val,
        (rules.loss_cap * ref_val).max(rules.loss_floor * ref_val),
    );
    for p in presets {
        let mine = of(p.name);
        if mine.is_empty() {
            continue;
        }
        let (val, train) = (
            field(&mine, |r| r.val_loss),
            field(&mine, |r| r.final_train_loss),
        );
        let (goal, met) = if p.name == main.preset {
            ("reference".to_string(), None)
        } else if p.goal == Goal::NaiveBaseline {
            (
                format!(
                    "visibly worse: train and val loss above the reference's by more than 1% + \
                     {tol:.4} (the tolerance)"
                ),
                Some(val > ref_val * 1.01 + tol && train > ref_train * 1.01 + tol),
            )
        } else {
            (
                format!("val loss within {tol:.4} of {ref_val:.4}"),
                Some(val <= ref_val + tol),
            )
        };
        let (goal, verdict) = match met {
            None if main.stable() => (goal, Verdict::Reference),
            None => (
                "reference, UNSTABLE at the normal rate".to_string(),
                Verdict::UnstableReference,
            ),
            Some(_) if !main.stable() => (
                format!("not judged: {} is unstable at the normal rate", main.preset),
                Verdict::NotJudged,
            ),
            Some(true) => (goal, Verdict::Met),
            Some(false) => (goal, Verdict::Missed),
        };
        rows.push(row(task, p, &mine, &reference, goal, verdict));
    }
    rows
}
