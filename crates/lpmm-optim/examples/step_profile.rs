//! Runs the fused step of a preset over and over, for a profiler:
//! `cargo run --release -p lpmm-optim --example step_profile -- [preset] [params] [steps]`
//! (e.g. `perf record -g target/release/examples/step_profile adamw8bit_bf16 16777216 20`).

use lpmm_optim::{Optimizer, OptimizerOptions, presets};
use std::time::Instant;

/// The fused step of one preset, over and over.
#[derive(Debug, clap::Parser)]
struct Args {
    /// adamw_f32, adamw8bit_bf16, adamw8bit_bf16_sr, adamw4bit_split or lpmm_sgdm.
    #[arg(default_value = "adamw8bit_bf16")]
    preset: String,
    /// Parameters (one tensor).
    #[arg(default_value_t = 1 << 24)]
    params: usize,
    /// Steps.
    #[arg(default_value_t = 10)]
    steps: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = <Args as clap::Parser>::parse();
    let (n, steps) = (args.params, args.steps);
    let config = match args.preset.as_str() {
        "adamw_f32" => presets::adamw_f32(1e-3).build(),
        "adamw8bit_bf16" => presets::adamw_8bit_bf16(1e-3).build(),
        "adamw8bit_bf16_sr" => presets::adamw_8bit_bf16_sr(1e-3).build(),
        "adamw4bit_split" => presets::adamw_4bit_split(1e-3).build(),
        "lpmm_sgdm" => presets::lpmm_sgdm(1e-2, 0.9).build(),
        other => return Err(format!("unknown preset {other}").into()),
    };
    let mut opt = Optimizer::new(OptimizerOptions::default())?;
    let g = opt.add_group(config)?;
    let init: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-4).collect();
    let grad: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-5).collect();
    let id = opt.add_param("w", &[n], &init, g)?;
    let t = Instant::now();
    for _ in 0..steps {
        opt.step_param(id, &grad)?;
    }
    let ns = t.elapsed().as_secs_f64() * 1e9 / (steps * n) as f64;
    println!(
        "{}: {n} params, {steps} steps, {ns:.2} ns/param/step",
        args.preset
    );
    Ok(())
}
