//! The README's main command: every preset on two tasks (a digits classifier and a
//! character-level transformer), with the memory each keeps and the quality it reaches against its
//! f32 reference; then a low-learning-rate condition where round-to-nearest bf16 loses small
//! updates; then text sampled from the trained language models.
//!
//! `cargo run --release -p lpmm-candle-examples --example compare` (about 15 minutes on 2 cores).
//! Options: `--quick` (a smoke run of a minute), `--text PATH` (train the language model on your
//! own text: the first 90% of its bytes train, the last 10% validate; `.gz` files are
//! decompressed), `--play PLAY` (one of the six embedded plays alone, split likewise),
//! `--held-out-play PLAY` (train on five of the six plays, validate on this one), `--sgd-lr X`
//! (the SGDM presets' peak rate on the language model; 0.3 by default).
//! Each low-precision preset is judged against its f32 reference by `lpmm_candle_examples::judge`:
//! a reference whose seeds disagree judges nothing ("not judged"), and the summary lists it.
//! Prints the table and writes `target/lpmm-report/train.json` (schema: docs/RESULTS.md),
//! `train.md` and `train_loss.png`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use lpmm_candle_examples::experiments::{self, Baselines, Budget, LmRecipe, Preset, RunResult};
use lpmm_candle_examples::footprint::{self, Probe, ProbeShape};
use lpmm_candle_examples::judge::{
    self, Judgement, ReferenceCheck, Row, Rules, Task, TaskKind, Verdict,
};
use lpmm_candle_examples::process;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use serde::Serialize;

/// (task, reference preset, val-loss spread, accuracy spread) over the reference's seeds.
type Spread = (String, String, f64, f64);

/// Seeds of the presets that judge others (their spread is the yardstick, and shows whether
/// they are stable); every other preset runs seed 0.
const REFERENCE_SEEDS: [u64; 3] = [0, 1, 2];

/// The presets of the low-learning-rate condition.
const UNDERFLOW_PRESETS: [&str; 3] = [
    "f32 AdamW",
    "bf16 AdamW, round to nearest",
    "8-bit AdamW, bf16 SR",
];

#[derive(Debug, Serialize)]
struct TextInfo {
    name: String,
    train_bytes: usize,
    val_bytes: usize,
    vocab: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    command: String,
    mode: String,
    text: TextInfo,
    /// Count models of the text, scored on its validation split (nats per character).
    baselines: Baselines,
    digits_budget: Budget,
    lm_recipe: LmRecipe,
    /// The low-learning-rate condition: `lm_recipe` with the AdamW peak divided by
    /// `underflow_lr_divisor`.
    underflow_recipe: LmRecipe,
    underflow_lr_divisor: f64,
    /// The bounds of the judging.
    rules: Rules,
    reference_spread: Vec<Spread>,
    /// Each reference's seeds, tolerance and stability.
    references: Vec<ReferenceCheck>,
    /// The references that judge nothing: (task, preset, why).
    unstable_references: Vec<(String, String, String)>,
    /// Rows with a goal: how many met it, missed it, were not judged (main table and the
    /// low-learning-rate condition together).
    checks: Checks,
    rows: Vec<Row>,
    underflow_rows: Vec<Row>,
    /// The process-memory probe's model and run.
    memory_shape: ProbeShape,
    /// Measured process memory, one training process per arm.
    memory_rows: Vec<MemoryRow>,
    runs: Vec<RunResult>,
    wall_seconds: f64,
}

#[derive(Debug, Serialize)]
struct Checks {
    met: usize,
    missed: usize,
    not_judged: usize,
}

/// One arm of the process-memory measurement.
#[derive(Debug, Serialize)]
struct MemoryRow {
    arm: String,
    reference: String,
    params: usize,
    /// Bytes of the candle Vars (lent to lpmm or not).
    candle_var_bytes: usize,
    /// Model memory the optimizer accounts for beyond the Vars (lpmm's report; candle AdamW's two
    /// moments).
    optimizer_bytes: usize,
    peak_rss_mib: f64,
    steady_rss_mib: f64,
    /// Resident memory once glibc has returned its freed memory (`malloc_trim`).
    live_rss_mib: f64,
    peak_vs_reference_percent: f64,
    steady_vs_reference_percent: f64,
    /// The peak less the process floor's (the "process floor" arm), against the reference's.
    peak_above_floor_vs_reference_percent: f64,
    first_loss: f64,
    last_loss: f64,
    seconds_per_step: f64,
    goal: String,
    goal_met: Option<bool>,
}

/// Every preset on the digits MLP and the character-level transformer through candle: model
/// and process memory, quality against the f32 references, the low-learning-rate condition,
/// samples (docs/RESULTS.md).
#[derive(Debug, clap::Parser)]
struct Args {
    /// A smoke run of a minute (short budgets, small memory probe).
    #[arg(long)]
    quick: bool,
    /// Train the language model on this text (first 90% train, last 10% validate; `.gz` is
    /// decompressed) instead of the embedded Shakespeare plays.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["held_out_play", "play"])]
    text: Option<PathBuf>,
    /// Train the language model on one of the six embedded plays alone (its first 90% trains,
    /// its last 10% validates): its number or its name, as for `--held-out-play`.
    #[arg(long, value_name = "PLAY", conflicts_with = "held_out_play")]
    play: Option<String>,
    /// Train the language model on five of the six embedded plays and validate on this one: its
    /// number in the text's order (1 Hamlet, 2 Macbeth, 3 Julius Caesar, 4 Romeo and Juliet, 5
    /// The Tempest, 6 Othello) or its name (`macbeth`, `tempest`, ...).
    #[arg(long, value_name = "PLAY")]
    held_out_play: Option<String>,
    /// The SGDM presets' peak learning rate on the language model (default 0.3, the recipe's).
    /// f32 SGDM at 0.3 stalled on one seed of three on Macbeth alone, where 0.2 trained all three
    /// (docs/RESULTS.md, "Fragile recipes"): on a small text whose f32 SGDM is reported
    /// unstable, try 0.2.
    #[arg(long, value_name = "X")]
    sgd_lr: Option<f64>,
    /// Child mode: measure one memory arm in this process and print its JSON.
    #[arg(long, value_name = "ARM", hide = true)]
    memory_probe: Option<String>,
    /// Only the process-memory section.
    #[arg(long)]
    memory_only: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: first thing in `main`, before any other thread exists.
    unsafe { process::candle_threads() };
    let args = <Args as clap::Parser>::parse();
    if let Some(lr) = args.sgd_lr
        && !(lr.is_finite() && lr > 0.0)
    {
        return Err(format!("--sgd-lr must be a positive number, not {lr}").into());
    }
    // The plays named, checked before the memory section spends a minute.
    let play = args
        .play
        .as_deref()
        .map(experiments::play_from)
        .transpose()?;
    let held_out = args
        .held_out_play
        .as_deref()
        .map(experiments::play_from)
        .transpose()?;
    let probe_shape = if args.quick {
        ProbeShape::quick()
    } else {
        ProbeShape::default_run()
    };
    if let Some(name) = &args.memory_probe {
        // A child: glibc's default allocator settings, as a user's process has them.
        let arm = footprint::arms()
            .into_iter()
            .find(|a| a.name == name)
            .ok_or_else(|| format!("no memory arm named {name:?}"))?;
        let probe = footprint::probe(&arm, &probe_shape)?;
        println!("PROBE {}", serde_json::to_string(&probe)?);
        return Ok(());
    }
    process::keep_freed_memory();
    let start = Instant::now();
    println!(
        "Process memory: {} layers of {}, batch {}, {} steps; each arm in a process of its own",
        probe_shape.depth, probe_shape.width, probe_shape.batch, probe_shape.steps
    );
    let memory_rows = measure_memory(args.quick)?;
    let memory_table = render_memory(&memory_rows, &probe_shape);
    println!("\n{memory_table}");
    if args.memory_only {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/lpmm-report");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("memory.json"),
            serde_json::to_string_pretty(&memory_rows)?,
        )?;
        println!("(written to target/lpmm-report/memory.json)");
        return Ok(());
    }
    let (mode, digits_budget, recipe) = if args.quick {
        (
            "quick",
            Budget {
                steps: 150,
                batch: 64,
            },
            LmRecipe {
                budget: Budget {
                    steps: 40,
                    batch: 16,
                },
                warmup: 5,
                val_windows: Some(64),
                ..LmRecipe::default_run()
            },
        )
    } else {
        (
            "default",
            Budget {
                steps: 1500,
                batch: 64,
            },
            LmRecipe::default_run(),
        )
    };
    let recipe = LmRecipe {
        sgd_lr: args.sgd_lr.unwrap_or(recipe.sgd_lr),
        ..recipe
    };
    let underflow_lr_divisor = 10.0;
    let underflow_recipe = LmRecipe {
        adamw_lr: recipe.adamw_lr / underflow_lr_divisor,
        ..recipe
    };
    let digits = experiments::digits()?;
    let text = match (&args.text, play, held_out) {
        (Some(path), _, _) => experiments::text_file(path, recipe.context)?,
        (None, Some(play), _) => experiments::shakespeare_play(play)?,
        (None, None, Some(play)) => experiments::shakespeare_held_out(play)?,
        (None, None, None) => experiments::shakespeare()?,
    };
    let baselines = experiments::baselines(&text);
    println!(
        "{}: {} training bytes, {} validation bytes, {} distinct bytes; validation cross-entropy \
         of count models: unigram {:.4}, bigram {:.4} nats/char",
        text.name,
        text.train.len(),
        text.val.len(),
        text.vocab.len(),
        baselines.unigram,
        baselines.bigram
    );
    let presets = experiments::presets();
    let style = ProgressStyle::with_template("{prefix:>52} [{bar:30}] {pos}/{len} {elapsed}")?
        .progress_chars("=> ");
    let bar = |steps: usize, label: String| {
        let bar = ProgressBar::new(steps as u64).with_style(style.clone());
        bar.set_prefix(label);
        bar
    };
    let seeds_of = |p: &Preset| -> &'static [u64] {
        if judge::is_reference(&presets, p.name) {
            &REFERENCE_SEEDS
        } else {
            &[0]
        }
    };
    let mut runs: Vec<RunResult> = Vec::new();
    for preset in &presets {
        for &seed in seeds_of(preset) {
            let b = bar(
                digits_budget.steps,
                format!("digits: {} (seed {seed})", preset.name),
            );
            runs.push(experiments::run_digits(
                &digits,
                preset,
                seed,
                digits_budget,
                |s| b.set_position(s as u64),
            )?);
            b.finish();
        }
    }
    for preset in &presets {
        for &seed in seeds_of(preset) {
            let b = bar(
                recipe.budget.steps,
                format!("{}: {} (seed {seed})", text.name, preset.name),
            );
            runs.push(experiments::run_char_lm(
                &text,
                preset,
                seed,
                &recipe,
                |s| b.set_position(s as u64),
            )?);
            b.finish();
        }
    }
    let low_task = format!("{}, AdamW lr / {underflow_lr_divisor}", text.name);
    for preset in presets
        .iter()
        .filter(|p| UNDERFLOW_PRESETS.contains(&p.name))
    {
        let b = bar(
            recipe.budget.steps,
            format!("{low_task}: {} (seed 0)", preset.name),
        );
        let mut r = experiments::run_char_lm(&text, preset, 0, &underflow_recipe, |s| {
            b.set_position(s as u64)
        })?;
        b.finish();
        r.task = low_task.clone();
        runs.push(r);
    }
    let tasks = ["digits".to_string(), text.name.clone()];
    let rules = Rules::default();
    let judged = judge::judge(
        &presets,
        &runs,
        &[
            Task {
                name: tasks[0].clone(),
                kind: TaskKind::Classifier,
            },
            Task {
                name: text.name.clone(),
                kind: TaskKind::LanguageModel {
                    bigram: baselines.bigram,
                },
            },
        ],
        &rules,
    );
    let underflow_rows = judged
        .reference(&text.name, "f32 AdamW")
        .map(|main| judge::judge_underflow(&presets, &runs, &low_task, main, &rules))
        .unwrap_or_default();
    let wall_seconds = start.elapsed().as_secs_f64();
    let table = render(
        &judged,
        &underflow_rows,
        &rules,
        &baselines,
        &text.name,
        &underflow_recipe,
        mode,
        wall_seconds,
    );
    let table = format!("{table}\n{memory_table}");
    println!("\n{table}");
    println!("Samples (temperature 0.8; the prompt, from the validation split, before the `|`):\n");
    for (preset, seed) in [("f32 AdamW", 0), ("f32 SGDM", 0), ("LPMM-SGDM", 0)] {
        if let Some(r) = runs
            .iter()
            .find(|r| r.task == text.name && r.preset == preset && r.seed == seed)
        {
            println!(
                "--- {preset} (val loss {:.4}) ---\n{}\n",
                r.val_loss, r.sample
            );
        }
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/lpmm-report");
    std::fs::create_dir_all(&dir)?;
    let mut command = "cargo run --release -p lpmm-candle-examples --example compare".to_string();
    let mut flags = Vec::new();
    if mode != "default" {
        flags.push(format!("--{mode}"));
    }
    if let Some(path) = &args.text {
        flags.push(format!("--text {}", path.display()));
    }
    if let Some(play) = &args.play {
        flags.push(format!("--play {play}"));
    }
    if let Some(play) = &args.held_out_play {
        flags.push(format!("--held-out-play {play}"));
    }
    if let Some(lr) = args.sgd_lr {
        flags.push(format!("--sgd-lr {lr}"));
    }
    if !flags.is_empty() {
        command += &format!(" -- {}", flags.join(" "));
    }
    let report = Report {
        command,
        mode: mode.to_string(),
        text: TextInfo {
            name: text.name.clone(),
            train_bytes: text.train.len(),
            val_bytes: text.val.len(),
            vocab: text.vocab.len(),
        },
        baselines,
        digits_budget,
        lm_recipe: recipe,
        underflow_recipe,
        underflow_lr_divisor,
        rules,
        reference_spread: judged
            .references
            .iter()
            .map(|c| {
                (
                    c.task.clone(),
                    c.preset.clone(),
                    c.val_loss_spread,
                    c.val_accuracy_spread,
                )
            })
            .collect(),
        unstable_references: judged
            .unstable()
            .map(|c| {
                (
                    c.task.clone(),
                    c.preset.clone(),
                    c.unstable.clone().unwrap_or_default(),
                )
            })
            .collect(),
        checks: {
            let (a, b, c) = judged.counts();
            let (d, e, f) = judge::count(&underflow_rows);
            Checks {
                met: a + d,
                missed: b + e,
                not_judged: c + f,
            }
        },
        references: judged.references,
        rows: judged.rows,
        underflow_rows,
        memory_shape: probe_shape,
        memory_rows,
        runs,
        wall_seconds,
    };
    std::fs::write(
        dir.join("train.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(dir.join("train.md"), &table)?;
    plot(
        &report.runs,
        &[tasks[0].clone(), tasks[1].clone(), low_task],
        &presets,
        &report.memory_rows,
        &dir.join("train_loss.png"),
    )?;
    println!("(written to target/lpmm-report/train.json, train.md and train_loss.png)");
    Ok(())
}

/// Runs every memory arm in a child process (this example with `--memory-probe ARM`) and
/// compares each peak with its reference's.
fn measure_memory(quick: bool) -> Result<Vec<MemoryRow>, Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let mut probes: Vec<(footprint::Arm, Probe)> = Vec::new();
    for arm in footprint::arms() {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["--memory-probe", arm.name]);
        if quick {
            cmd.arg("--quick");
        }
        let out = cmd.output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!(
                "the memory probe of {:?} failed: {}{}",
                arm.name,
                stdout,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        let json = stdout
            .lines()
            .find_map(|l| l.strip_prefix("PROBE "))
            .ok_or_else(|| format!("the memory probe of {:?} printed no result", arm.name))?;
        let probe: Probe = serde_json::from_str(json)?;
        println!(
            "  {:<40} peak {:>7.1} MiB, steady {:>7.1} MiB",
            arm.name,
            mib(probe.peak_rss),
            mib(probe.steady_rss)
        );
        probes.push((arm, probe));
    }
    let floor = probes
        .iter()
        .find(|(a, _)| matches!(a.kind, footprint::ArmKind::Floor))
        .map_or(0, |(_, p)| p.peak_rss);
    let mut rows = Vec::new();
    for (arm, p) in &probes {
        let reference = &probes
            .iter()
            .find(|(a, _)| a.name == arm.reference)
            .ok_or("an arm's reference is missing")?
            .1;
        let peak = p.peak_rss as f64 / reference.peak_rss.max(1) as f64;
        let steady = p.steady_rss as f64 / reference.steady_rss.max(1) as f64;
        let above = p.peak_rss.saturating_sub(floor) as f64
            / reference.peak_rss.saturating_sub(floor).max(1) as f64;
        let (goal, goal_met) = match arm.goal {
            Some(g) => (
                format!("peak at most {:.0}% of {}'s", 100.0 * g, arm.reference),
                Some(peak <= g),
            ),
            None if arm.name == arm.reference => ("reference".to_string(), None),
            None => ("-".to_string(), None),
        };
        rows.push(MemoryRow {
            arm: arm.name.to_string(),
            reference: arm.reference.to_string(),
            params: p.params,
            candle_var_bytes: p.candle_var_bytes,
            optimizer_bytes: p.optimizer_bytes,
            peak_rss_mib: mib(p.peak_rss),
            steady_rss_mib: mib(p.steady_rss),
            live_rss_mib: mib(p.live_rss),
            peak_vs_reference_percent: 100.0 * peak,
            steady_vs_reference_percent: 100.0 * steady,
            peak_above_floor_vs_reference_percent: 100.0 * above,
            first_loss: p.first_loss,
            last_loss: p.last_loss,
            seconds_per_step: p.seconds_per_step,
            goal,
            goal_met,
        });
    }
    Ok(rows)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn render_memory(rows: &[MemoryRow], shape: &ProbeShape) -> String {
    let mut t = format!(
        concat!(
            "Process memory, one training process per arm: an MLP of {} layers of {} ({:.1}M ",
            "parameters), batch {}, {} steps, glibc's default allocator. Vars: the candle Vars ",
            "(lent to lpmm where their dtype is the storage's); optimizer: what the optimizer ",
            "holds beside them (lpmm's memory report; candle-nn AdamW's two f32 moments); peak: ",
            "VmHWM; steady: VmRSS after the last step; live: VmRSS once glibc has returned the ",
            "memory it keeps freed (malloc_trim).\n\n"
        ),
        shape.depth,
        shape.width,
        shape.params() as f64 / 1e6,
        shape.batch,
        shape.steps
    );
    t += "| arm | Vars MiB | optimizer MiB | peak MiB | steady MiB | live MiB | peak vs reference | steady vs reference | peak above the floor vs reference | loss first -> last | s/step | goal | met |\n";
    t += "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for r in rows {
        let met = match r.goal_met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "-",
        };
        let vs = |pct: f64| {
            if r.arm == r.reference {
                "reference".to_string()
            } else {
                format!("{pct:.1}% of {}", r.reference)
            }
        };
        t += &format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {:.4} -> {:.4} | {:.2} | {} | {} |\n",
            r.arm,
            mib(r.candle_var_bytes as u64),
            mib(r.optimizer_bytes as u64),
            r.peak_rss_mib,
            r.steady_rss_mib,
            r.live_rss_mib,
            vs(r.peak_vs_reference_percent),
            vs(r.steady_vs_reference_percent),
            vs(r.peak_above_floor_vs_reference_percent),
            r.first_loss,
            r.last_loss,
            r.seconds_per_step,
            r.goal,
            met
        );
    }
    t
}

fn table(rows: &[Row]) -> String {
    let mut t = String::new();
    t += "| task | preset | model memory B/param | vs reference | final train loss | val loss | val accuracy | ms/step | goal | met |\n";
    t += "|---|---|---|---|---|---|---|---|---|---|\n";
    for r in rows {
        let vs = if r.preset == r.reference {
            "reference".to_string()
        } else {
            format!("{:+.1}% vs {}", r.memory_vs_reference_percent, r.reference)
        };
        let met = r.verdict.label();
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
    t
}

#[allow(clippy::too_many_arguments)]
fn render(
    judged: &Judgement,
    underflow: &[Row],
    rules: &Rules,
    baselines: &Baselines,
    text: &str,
    underflow_recipe: &LmRecipe,
    mode: &str,
    wall_seconds: f64,
) -> String {
    let mut t = String::new();
    if mode == "quick" {
        t += "(quick smoke run: far too short for the goals to mean anything)\n\n";
    }
    t += &table(&judged.rows);
    t += &format!(
        "\nBaselines on the {text} validation split (count models of the training split, add-one \
         smoothed): unigram {:.4}, bigram {:.4} nats/char.\n",
        baselines.unigram, baselines.bigram
    );
    t += &format!(
        "\nReferences (mean of seeds 0, 1, 2), spread = max - min over the seeds; a reference is \
         unstable, and judges nothing, when its seeds' val losses span more than {:.0}% of their \
         mean (language model), their accuracies more than {:.0} points, or a language-model \
         seed is not {:.0}% below the bigram baseline; its tolerance is its spread, at least \
         {:.0}% of its val loss and {:.0} point, at most {:.0}% and {:.0} points:\n\n",
        100.0 * rules.loss_spread_bound,
        100.0 * rules.accuracy_spread_bound,
        100.0 * rules.bigram_margin,
        100.0 * rules.loss_floor,
        100.0 * rules.accuracy_floor,
        100.0 * rules.loss_cap,
        100.0 * rules.accuracy_cap,
    );
    for c in &judged.references {
        let losses: Vec<String> = c.val_losses.iter().map(|v| format!("{v:.4}")).collect();
        t += &format!(
            "- {}, {}: val loss {} (spread {:.4}), accuracy spread {:.2} points: {}\n",
            c.task,
            c.preset,
            losses.join(", "),
            c.val_loss_spread,
            100.0 * c.val_accuracy_spread,
            match &c.unstable {
                None => "stable".to_string(),
                Some(why) => format!("UNSTABLE ({why})"),
            }
        );
    }
    t += &format!(
        "\nLow-learning-rate condition (the same model, data and steps; AdamW peak learning rate \
         {:.1e}, cosine to {:.1e}; seed 0): updates below half a bf16 step are lost with \
         round-to-nearest storage.\n\n",
        underflow_recipe.adamw_lr,
        underflow_recipe.adamw_lr * underflow_recipe.final_lr_fraction
    );
    t += &table(underflow);
    let (met, missed, not_judged) = judged.counts();
    let (u_met, u_missed, u_not) = judge::count(underflow);
    t += &format!(
        "\nSummary: {} checks met, {} missed, {} not judged.",
        met + u_met,
        missed + u_missed,
        not_judged + u_not
    );
    let unstable: Vec<&ReferenceCheck> = judged.unstable().collect();
    if unstable.is_empty() {
        t += " Every reference is stable.\n";
    } else {
        t += " Unstable references (the presets they would judge are not judged):\n";
        for c in unstable {
            let judged_by: Vec<&str> = judged
                .rows
                .iter()
                .filter(|r| {
                    r.task == c.task && r.reference == c.preset && r.verdict == Verdict::NotJudged
                })
                .map(|r| r.preset.as_str())
                .collect();
            t += &format!(
                "- {}, {}: {}; not judged: {}\n",
                c.task,
                c.preset,
                c.unstable.as_deref().unwrap_or_default(),
                if judged_by.is_empty() {
                    "none".to_string()
                } else {
                    judged_by.join(", ")
                }
            );
        }
    }
    t += &format!("\nWall time of the whole command: {:.0} s.\n", wall_seconds);
    t
}

fn plot(
    runs: &[RunResult],
    tasks: &[String],
    presets: &[Preset],
    memory: &[MemoryRow],
    path: &Path,
) -> Result<(), Box<dyn std::error::Error>> {
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        include_bytes!("../assets/DejaVuSans.ttf"),
    )
    .map_err(|_| "cannot load the embedded font")?;
    let root = BitMapBackend::new(path, (640 * tasks.len() as u32, 600 + 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (curves, bars) = root.split_vertically(600);
    plot_memory(&bars, memory)?;
    let panels = curves.split_evenly((1, tasks.len()));
    for (area, task) in panels.iter().zip(tasks) {
        let series: Vec<&RunResult> = runs
            .iter()
            .filter(|r| &r.task == task && r.seed == 0)
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
        let builder = |area| {
            let mut b = ChartBuilder::on(area);
            b.caption(format!("{task}: training loss"), ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(56);
            b
        };
        // A log scale where the loss spans more than a decade (digits), linear otherwise.
        if max_loss / min_loss > 10.0 {
            let chart = builder(area).build_cartesian_2d(
                0.0..max_step,
                ((min_loss * 0.9).max(1e-4)..max_loss * 1.05).log_scale(),
            )?;
            draw_curves(chart, &series, presets, "loss (log scale)")?;
        } else {
            let chart = builder(area).build_cartesian_2d(
                0.0..max_step,
                (min_loss - 0.05 * (max_loss - min_loss))..max_loss,
            )?;
            draw_curves(chart, &series, presets, "loss")?;
        }
    }
    root.present()?;
    Ok(())
}

/// The process-memory arms as bars: peak (dark) and steady (light) resident memory.
fn plot_memory(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    rows: &[MemoryRow],
) -> Result<(), Box<dyn std::error::Error>> {
    let max = rows
        .iter()
        .map(|r| r.peak_rss_mib.max(r.steady_rss_mib))
        .fold(1.0, f64::max);
    let n = rows.len() as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "process memory of one training process per arm (MiB): peak, steady",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(10)
        .build_cartesian_2d(0.0..max * 1.02, 0.0..n)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc("MiB")
        .label_style(("sans-serif", 14))
        .draw()?;
    for (i, r) in rows.iter().enumerate() {
        let y = n - i as f64 - 1.0;
        let dark = Palette99::pick(i).to_rgba();
        let light = dark.mix(0.4);
        chart.draw_series([
            Rectangle::new([(0.0, y + 0.52), (r.peak_rss_mib, y + 0.9)], dark.filled()),
            Rectangle::new(
                [(0.0, y + 0.12), (r.steady_rss_mib, y + 0.5)],
                light.filled(),
            ),
        ])?;
        chart.draw_series(std::iter::once(Text::new(
            format!(
                "{}: {:.0} / {:.0} MiB{}",
                r.arm,
                r.peak_rss_mib,
                r.steady_rss_mib,
                if r.arm == r.reference {
                    String::new()
                } else {
                    format!(" ({:.0}% of {})", r.peak_vs_reference_percent, r.reference)
                }
            ),
            (max * 0.01, y + 0.7),
            ("sans-serif", 14).into_font().color(&BLACK),
        )))?;
    }
    Ok(())
}

/// Each run's curve, coloured by its preset's place in the comparison (the same colour in every
/// panel).
fn draw_curves<'a, Y>(
    mut chart: ChartContext<'a, BitMapBackend<'a>, Cartesian2d<RangedCoordf64, Y>>,
    series: &[&RunResult],
    presets: &[Preset],
    y_desc: &str,
) -> Result<(), Box<dyn std::error::Error>>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| match *y {
            y if y >= 1.0 => format!("{y:.1}"),
            y if y >= 0.1 => format!("{y:.2}"),
            y => format!("{y:.3}"),
        })
        .label_style(("sans-serif", 14))
        .draw()?;
    for r in series {
        let k = presets
            .iter()
            .position(|p| p.name == r.preset)
            .unwrap_or(presets.len());
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
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}
