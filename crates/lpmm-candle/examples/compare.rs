//! The README's main command: every preset on both tasks, with the memory each keeps and the
//! quality it reaches, against its f32 reference.
//!
//! `cargo run --release -p lpmm-candle --example compare` (about 10 minutes on 2 cores;
//! `-- --quick` for a one-minute smoke run). Prints the table and writes
//! `target/lpmm-report/train.json` (schema: docs/RESULTS.md) and `target/lpmm-report/train_loss.png`.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use lpmm_candle::experiments::{self, Budget, Preset, RunResult};
use plotters::prelude::*;
use serde::Serialize;

/// (task, reference preset, val-loss spread, accuracy spread) over the reference's seeds.
type Spread = (String, String, f64, f64);

/// Seeds of the f32 references (their spread is the yardstick); every other preset runs seed 0.
const REFERENCE_SEEDS: [u64; 3] = [0, 1, 2];

#[derive(Debug, Serialize)]
struct Row {
    task: String,
    preset: String,
    reference: String,
    bytes_per_param: f64,
    memory_vs_reference_percent: f64,
    final_train_loss: f64,
    val_loss: f64,
    val_accuracy: f64,
    ms_per_step: f64,
    /// For low-precision presets: the goal of the issue, and whether it was met.
    goal: String,
    goal_met: Option<bool>,
}

#[derive(Debug, Serialize)]
struct Report {
    command: String,
    budgets: [(String, Budget); 2],
    reference_spread: Vec<Spread>,
    rows: Vec<Row>,
    runs: Vec<RunResult>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (digits_budget, lm_budget) = if quick {
        (
            Budget {
                steps: 150,
                batch: 64,
            },
            Budget {
                steps: 60,
                batch: 32,
            },
        )
    } else {
        (
            Budget {
                steps: 1500,
                batch: 64,
            },
            Budget {
                steps: 1200,
                batch: 32,
            },
        )
    };
    let digits = experiments::digits()?;
    let text = experiments::shakespeare()?;
    let presets = experiments::presets();
    let style = ProgressStyle::with_template("{prefix:>40} [{bar:30}] {pos}/{len} {elapsed}")?
        .progress_chars("=> ");
    let mut runs: Vec<RunResult> = Vec::new();
    for task in ["digits", "shakespeare"] {
        for preset in &presets {
            let seeds: &[u64] = if preset.name == preset.reference {
                &REFERENCE_SEEDS
            } else {
                &[0]
            };
            for &seed in seeds {
                let budget = if task == "digits" {
                    digits_budget
                } else {
                    lm_budget
                };
                let bar = ProgressBar::new(budget.steps as u64).with_style(style.clone());
                bar.set_prefix(format!("{task}: {} (seed {seed})", preset.name));
                let r = if task == "digits" {
                    experiments::run_digits(&digits, preset, seed, budget, |s| {
                        bar.set_position(s as u64)
                    })?
                } else {
                    experiments::run_shakespeare(&text, preset, seed, budget, |s| {
                        bar.set_position(s as u64)
                    })?
                };
                bar.finish();
                runs.push(r);
            }
        }
    }
    let (rows, spread) = summarize(&presets, &runs);
    let table = render(&rows, &spread, quick);
    println!("\n{table}");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/lpmm-report");
    std::fs::create_dir_all(&dir)?;
    let command = format!(
        "cargo run --release -p lpmm-candle --example compare{}",
        if quick { " -- --quick" } else { "" }
    );
    let report = Report {
        command,
        budgets: [
            ("digits".into(), digits_budget),
            ("shakespeare".into(), lm_budget),
        ],
        reference_spread: spread,
        rows,
        runs,
    };
    std::fs::write(
        dir.join("train.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(dir.join("train.md"), &table)?;
    plot(&report.runs, &dir.join("train_loss.png"))?;
    println!("(written to target/lpmm-report/train.json, train.md and train_loss.png)");
    Ok(())
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// One row per (task, preset): references averaged over their seeds; each low-precision preset's
/// goal checked against its reference (tolerance: 1% relative validation loss for the language
/// model, 1 accuracy point for digits, or the reference's own spread over its seeds if larger).
fn summarize(presets: &[Preset], runs: &[RunResult]) -> (Vec<Row>, Vec<Spread>) {
    let mut rows = Vec::new();
    let mut spread = Vec::new();
    for task in ["digits", "shakespeare"] {
        let of = |name: &str| {
            runs.iter()
                .filter(|r| r.task == task && r.preset == name)
                .collect::<Vec<_>>()
        };
        for p in presets {
            let mine = of(p.name);
            if mine.is_empty() {
                continue;
            }
            let reference = of(p.reference);
            let field = |rs: &[&RunResult], f: fn(&RunResult) -> f64| {
                mean(&rs.iter().map(|r| f(r)).collect::<Vec<_>>())
            };
            let range = |rs: &[&RunResult], f: fn(&RunResult) -> f64| {
                let v: Vec<f64> = rs.iter().map(|r| f(r)).collect();
                v.iter().cloned().fold(f64::MIN, f64::max)
                    - v.iter().cloned().fold(f64::MAX, f64::min)
            };
            let (val_loss, acc) = (
                field(&mine, |r| r.val_loss),
                field(&mine, |r| r.val_accuracy),
            );
            let (ref_loss, ref_acc) = (
                field(&reference, |r| r.val_loss),
                field(&reference, |r| r.val_accuracy),
            );
            let bytes = field(&mine, |r| r.bytes_per_param);
            let ref_bytes = field(&reference, |r| r.bytes_per_param);
            if p.name == p.reference {
                spread.push((
                    task.to_string(),
                    p.name.to_string(),
                    range(&reference, |r| r.val_loss),
                    range(&reference, |r| r.val_accuracy),
                ));
            }
            let (goal, met) = if p.name == p.reference {
                ("reference".to_string(), None)
            } else if p.name.starts_with("bf16") {
                let worse = val_loss > ref_loss * 1.01 + range(&reference, |r| r.val_loss);
                (
                    "visibly worse than its reference (underflow)".to_string(),
                    Some(worse),
                )
            } else if task == "shakespeare" {
                let tol = (0.01 * ref_loss).max(range(&reference, |r| r.val_loss));
                (
                    format!("val loss within {tol:.4} of {ref_loss:.4}"),
                    Some((val_loss - ref_loss).abs() <= tol || val_loss < ref_loss),
                )
            } else {
                let tol = 0.01f64.max(range(&reference, |r| r.val_accuracy));
                (
                    format!(
                        "accuracy within {:.1} points of {:.1}%",
                        tol * 100.0,
                        ref_acc * 100.0
                    ),
                    Some(acc >= ref_acc - tol),
                )
            };
            let mut goal = goal;
            let mut met = met;
            if p.name == "LPMM-SGDM" {
                let reduction = 1.0 - bytes / ref_bytes;
                goal = format!("{goal}; memory at least 70% below f32 SGDM");
                met = met.map(|m| m && reduction >= 0.70);
            }
            rows.push(Row {
                task: task.to_string(),
                preset: p.name.to_string(),
                reference: p.reference.to_string(),
                bytes_per_param: bytes,
                memory_vs_reference_percent: 100.0 * (bytes / ref_bytes - 1.0),
                final_train_loss: field(&mine, |r| r.final_train_loss),
                val_loss,
                val_accuracy: acc,
                ms_per_step: field(&mine, |r| r.ms_per_step),
                goal,
                goal_met: met,
            });
        }
    }
    (rows, spread)
}

fn render(rows: &[Row], spread: &[Spread], quick: bool) -> String {
    let mut t = String::new();
    if quick {
        t += "(quick smoke run: far too short for the goals to mean anything)\n\n";
    }
    t += "| task | preset | model memory B/param | vs reference | final train loss | val loss | val accuracy | ms/step | goal | met |\n";
    t += "|---|---|---|---|---|---|---|---|---|---|\n";
    for r in rows {
        let vs = if r.preset == r.reference {
            "reference".to_string()
        } else {
            format!("{:+.1}% vs {}", r.memory_vs_reference_percent, r.reference)
        };
        let met = match r.goal_met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "-",
        };
        t += &format!(
            "| {} | {} | {:.3} | {} | {:.4} | {:.4} | {:.2}% | {:.1} | {} | {} |\n",
            r.task,
            r.preset,
            r.bytes_per_param,
            vs,
            r.final_train_loss,
            r.val_loss,
            100.0 * r.val_accuracy,
            r.ms_per_step,
            r.goal,
            met
        );
    }
    t += "\nReferences (mean of seeds 0, 1, 2), spread = max - min over the seeds:\n\n";
    for (task, name, loss, acc) in spread {
        t += &format!(
            "- {task}, {name}: val loss spread {loss:.4}, accuracy spread {:.2} points\n",
            100.0 * acc
        );
    }
    t
}

fn plot(runs: &[RunResult], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        include_bytes!("../assets/DejaVuSans.ttf"),
    )
    .map_err(|_| "cannot load the embedded font")?;
    let root = BitMapBackend::new(path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    for (area, task) in panels.iter().zip(["digits", "shakespeare"]) {
        let series: Vec<&RunResult> = runs
            .iter()
            .filter(|r| r.task == task && r.seed == 0)
            .collect();
        let max_step = series
            .iter()
            .map(|r| r.curve.len() * r.curve_every)
            .max()
            .unwrap_or(1) as f64;
        let max_loss = series
            .iter()
            .flat_map(|r| r.curve.iter().copied())
            .fold(0.0, f64::max)
            .max(1e-3);
        let min_loss = series
            .iter()
            .flat_map(|r| r.curve.iter().copied())
            .fold(f64::MAX, f64::min)
            .min(max_loss);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{task}: training loss"), ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..max_step, (min_loss * 0.9).max(1e-4)..max_loss * 1.05)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .label_style(("sans-serif", 14))
            .draw()?;
        for (k, r) in series.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            let points = r
                .curve
                .iter()
                .enumerate()
                .map(|(i, &l)| (((i + 1) * r.curve_every) as f64, l));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(r.preset.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
