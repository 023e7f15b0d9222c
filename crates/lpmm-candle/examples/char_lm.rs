//! One training run of the comparison's character-level language model, with any preset and
//! recipe: for trying a recipe (the figures of docs/RESULTS.md's "Choosing the recipe" come from
//! it) or checking lpmm on your own text.
//!
//! `cargo run --release -p lpmm-candle --example char_lm -- [options]`, options (defaults: the
//! main command's recipe, `lpmm_candle::experiments::LmRecipe::default_run`):
//! `--text PATH` (default: the embedded Shakespeare plays), `--preset NAME` (default
//! "f32 AdamW"; the names of the comparison's table), `--seed N`, `--steps N`, `--batch N`,
//! `--lr X` (AdamW presets), `--sgd-lr X` (SGD presets), `--width N`, `--heads N`, `--layers N`,
//! `--context N`, `--warmup N`, `--final-lr-fraction X`, `--init-std X` (0: candle's own
//! initialisation).

use std::time::Instant;

use lpmm_candle::experiments::{self, LmRecipe};

/// As in `compare.rs`: candle 0.11's element-wise pool spins on 2 cores; `RAYON_NUM_THREADS`
/// spares it from reading /proc/cpuinfo before every matrix product.
fn candle_threads() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (name, value) in [
        ("CANDLE_NUM_THREADS", "1".to_string()),
        ("RAYON_NUM_THREADS", cores.to_string()),
    ] {
        if std::env::var_os(name).is_none() {
            // SAFETY: called first thing in `main`, before any other thread exists.
            unsafe { std::env::set_var(name, value) };
        }
    }
}

/// As in `compare.rs`: keep freed memory in the process (glibc).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    unsafe extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    // SAFETY: mallopt only changes allocator thresholds; called before any other thread exists.
    unsafe {
        mallopt(-3, 32 << 20); // M_MMAP_THRESHOLD
        mallopt(-1, 1 << 30); // M_TRIM_THRESHOLD
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    candle_threads();
    keep_freed_memory();
    let mut recipe = LmRecipe::default_run();
    let (mut text_path, mut preset_name, mut seed) = (None, "f32 AdamW".to_string(), 0u64);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--text" => text_path = Some(std::path::PathBuf::from(&value)),
            "--preset" => preset_name = value.clone(),
            "--seed" => seed = value.parse().map_err(|e| bad(&e))?,
            "--steps" => recipe.budget.steps = value.parse().map_err(|e| bad(&e))?,
            "--batch" => recipe.budget.batch = value.parse().map_err(|e| bad(&e))?,
            "--lr" => recipe.adamw_lr = value.parse().map_err(|e| bad(&e))?,
            "--sgd-lr" => recipe.sgd_lr = value.parse().map_err(|e| bad(&e))?,
            "--width" => recipe.width = value.parse().map_err(|e| bad(&e))?,
            "--heads" => recipe.heads = value.parse().map_err(|e| bad(&e))?,
            "--layers" => recipe.layers = value.parse().map_err(|e| bad(&e))?,
            "--context" => recipe.context = value.parse().map_err(|e| bad(&e))?,
            "--warmup" => recipe.warmup = value.parse().map_err(|e| bad(&e))?,
            "--final-lr-fraction" => {
                recipe.final_lr_fraction = value.parse().map_err(|e| bad(&e))?
            }
            "--init-std" => recipe.init_std = value.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown option {flag}").into()),
        }
    }
    let mut presets = experiments::presets();
    presets.extend(experiments::more_presets());
    let preset = presets
        .iter()
        .find(|p| p.name == preset_name)
        .ok_or_else(|| {
            let names: Vec<&str> = presets.iter().map(|p| p.name).collect();
            format!("no preset {preset_name:?}; presets: {names:?}")
        })?;
    let text = match &text_path {
        Some(path) => experiments::text_file(path, recipe.context)?,
        None => experiments::shakespeare()?,
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
    let r = experiments::run_char_lm(&text, preset, seed, &recipe, |s| {
        if s % 100 == 0 {
            eprint!("{s} ");
        }
    })?;
    eprintln!();
    println!(
        "{} (seed {seed}): {} parameters, final train loss {:.4}, val loss {:.4}, val accuracy \
         {:.2}%, {:.1} ms/step, {:.0} s",
        preset.name,
        r.params,
        r.final_train_loss,
        r.val_loss,
        100.0 * r.val_accuracy,
        r.ms_per_step,
        start.elapsed().as_secs_f64()
    );
    println!(
        "sample (temperature 0.8, prompt before the `|`):\n{}",
        r.sample
    );
    Ok(())
}
