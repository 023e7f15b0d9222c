//! One training run of the comparison's character-level language model, with any preset and
//! recipe: for trying a recipe (the figures of docs/RESULTS.md's "Choosing the recipe" come from
//! it) or checking lpmm on your own text.
//!
//! `cargo run --release -p lpmm-candle-examples --example char_lm -- [options]`, options (defaults: the
//! main command's recipe, `lpmm_candle_examples::experiments::LmRecipe::default_run`):
//! `--text PATH` (default: the embedded Shakespeare plays), `--play PLAY` (one of the six plays
//! alone, split as a `--text` file: 1 to 6 or a name), `--held-out-play PLAY` (train on five of
//! the six plays, validate on this one), `--preset NAME` (default
//! "f32 AdamW"; the names of the comparison's table), `--seed N`, `--steps N`, `--batch N`,
//! `--lr X` (AdamW presets), `--sgd-lr X` (SGD presets), `--muon-lr X` (Muon's matrices in the
//! Muon presets), `--width N`, `--heads N`, `--layers N`,
//! `--context N`, `--warmup N`, `--final-lr-fraction X`, `--init-std X` (0: candle's own
//! initialisation).

use std::time::Instant;

use lpmm_candle_examples::experiments::{self, LmRecipe};
use lpmm_candle_examples::process;

/// One language-model run; every option left out keeps the main command's recipe.
#[derive(Debug, clap::Parser)]
struct Args {
    /// The text (default: the embedded Shakespeare plays).
    #[arg(long, value_name = "PATH", conflicts_with_all = ["held_out_play", "play"])]
    text: Option<std::path::PathBuf>,
    /// One of the six embedded plays alone (its first 90% trains, its last 10% validates): its
    /// number in the text's order (1 Hamlet, 2 Macbeth, 3 Julius Caesar, 4 Romeo and Juliet, 5
    /// The Tempest, 6 Othello) or its name (`macbeth`, `tempest`, ...).
    #[arg(long, value_name = "PLAY", conflicts_with = "held_out_play")]
    play: Option<String>,
    /// Train on five of the six embedded plays and validate on this one: its number in the
    /// text's order (1 Hamlet, 2 Macbeth, 3 Julius Caesar, 4 Romeo and Juliet, 5 The Tempest, 6
    /// Othello) or its name (`macbeth`, `tempest`, ...).
    #[arg(long, value_name = "PLAY")]
    held_out_play: Option<String>,
    /// A preset of the comparison's table, or of `experiments::more_presets`.
    #[arg(long, default_value = "f32 AdamW")]
    preset: String,
    /// Initialisation and data-order seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long)]
    batch: Option<usize>,
    /// Peak learning rate of the AdamW (and Lion) presets.
    #[arg(long)]
    lr: Option<f64>,
    /// Peak learning rate of the SGD presets.
    #[arg(long)]
    sgd_lr: Option<f64>,
    /// Peak learning rate of Muon in the Muon presets (their AdamW part takes `--lr`).
    #[arg(long)]
    muon_lr: Option<f64>,
    #[arg(long)]
    width: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    context: Option<usize>,
    #[arg(long)]
    warmup: Option<usize>,
    #[arg(long)]
    final_lr_fraction: Option<f64>,
    /// Standard deviation of the initial weights (0: candle's own initialisation).
    #[arg(long)]
    init_std: Option<f64>,
    /// Micro-batches per step instead of the preset's.
    #[arg(long)]
    micro_batches: Option<usize>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: first thing in `main`, before any other thread exists.
    unsafe { process::candle_threads() };
    process::keep_freed_memory();
    let args = <Args as clap::Parser>::parse();
    let mut recipe = LmRecipe::default_run();
    let set = |field: &mut usize, v: Option<usize>| *field = v.unwrap_or(*field);
    set(&mut recipe.budget.steps, args.steps);
    set(&mut recipe.budget.batch, args.batch);
    set(&mut recipe.width, args.width);
    set(&mut recipe.heads, args.heads);
    set(&mut recipe.layers, args.layers);
    set(&mut recipe.context, args.context);
    set(&mut recipe.warmup, args.warmup);
    recipe.adamw_lr = args.lr.unwrap_or(recipe.adamw_lr);
    recipe.sgd_lr = args.sgd_lr.unwrap_or(recipe.sgd_lr);
    recipe.muon_lr = args.muon_lr.unwrap_or(recipe.muon_lr);
    recipe.final_lr_fraction = args.final_lr_fraction.unwrap_or(recipe.final_lr_fraction);
    recipe.init_std = args.init_std.unwrap_or(recipe.init_std);
    let (text_path, preset_name, seed) = (&args.text, &args.preset, args.seed);
    let mut presets = experiments::presets();
    presets.extend(experiments::more_presets());
    let mut preset = *presets
        .iter()
        .find(|p| p.name == preset_name)
        .ok_or_else(|| {
            let names: Vec<&str> = presets.iter().map(|p| p.name).collect();
            format!("no preset {preset_name:?}; presets: {names:?}")
        })?;
    preset.micro_batches = args.micro_batches.unwrap_or(preset.micro_batches);
    let text = match (&text_path, &args.play, &args.held_out_play) {
        (Some(path), _, _) => experiments::text_file(path, recipe.context)?,
        (None, Some(play), _) => experiments::shakespeare_play(experiments::play_from(play)?)?,
        (None, None, Some(play)) => {
            experiments::shakespeare_held_out(experiments::play_from(play)?)?
        }
        (None, None, None) => experiments::shakespeare()?,
    };
    let baselines = experiments::baselines(&text);
    println!("{recipe:?}");
    println!(
        "{}: {} training bytes, {} validation bytes; baselines: unigram {:.4}, bigram {:.4}",
        text.name,
        text.train.len(),
        text.val.len(),
        baselines.unigram,
        baselines.bigram
    );
    let start = Instant::now();
    let r = experiments::run_char_lm(&text, &preset, seed, &recipe, |s| {
        if s % 100 == 0 {
            eprint!("{s} ");
        }
    })?;
    eprintln!();
    println!(
        "{} (seed {seed}): {} parameters, model memory {:.3} B/param, final train loss {:.4}, \
         val loss {:.4}, val accuracy {:.2}%, {:.1} ms/step, {:.0} s",
        preset.name,
        r.params,
        r.bytes_per_param,
        r.final_train_loss,
        r.val_loss,
        100.0 * r.val_accuracy,
        r.ms_per_step,
        start.elapsed().as_secs_f64()
    );
    let curve: Vec<String> = r.curve.iter().map(|l| format!("{l:.3}")).collect();
    println!(
        "training loss every {} steps: {}",
        r.curve_every,
        curve.join(" ")
    );
    println!(
        "sample (temperature 0.8, prompt before the `|`):\n{}",
        r.sample
    );
    Ok(())
}
