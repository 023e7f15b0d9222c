//! Runs the fused step of a preset over and over, for a profiler:
//! `cargo run --release -p lpmm-optim --example step_profile -- [preset] [params] [steps]`
//! (e.g. `perf record -g target/release/examples/step_profile adamw8bit_bf16 16777216 20`).

use lpmm_optim::{Accumulated, NonFinitePolicy, Optimizer, OptimizerOptions, Step, presets};
use std::time::Instant;

/// The fused step of one preset, over and over.
#[derive(Debug, clap::Parser)]
struct Args {
    /// A preset as the step bench names it (adamw_8bit_bf16, lpmm_sgdm, came_lpmm, ...; the older
    /// names adamw8bit_bf16, adamw8bit_bf16_sr and adamw4bit_split too).
    #[arg(default_value = "adamw_8bit_bf16")]
    preset: String,
    /// Parameters (one tensor; rows of 1024 for Adafactor and CAME, as in the bench).
    #[arg(default_value_t = 1 << 24)]
    params: usize,
    /// Steps.
    #[arg(default_value_t = 10)]
    steps: usize,
    /// Step on the generic element-wise path instead of the specialized kernel.
    #[arg(long)]
    generic: bool,
    /// Time `step()` from the preset's gradient accumulator (the gradient accumulated before
    /// each step, untimed) instead of `Step::param` with the f32 gradient.
    #[arg(long)]
    acc: bool,
    /// `NonFinitePolicy::SkipElements` instead of the default `SkipStep`: no read of the
    /// gradient before the step (an element with a non-finite gradient is left unchanged).
    #[arg(long)]
    skip_elements: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = <Args as clap::Parser>::parse();
    let (n, steps) = (args.params, args.steps);
    let config = match args
        .preset
        .replace("8bit", "_8bit")
        .replace("4bit", "_4bit")
        .replace("__", "_")
        .as_str()
    {
        "adamw_f32" => presets::adamw_f32(1e-3).build(),
        "adamw_8bit_bf16" => presets::adamw_8bit_bf16(1e-3).build(),
        "adamw_8bit_bf16_sr" => presets::adamw_8bit_bf16_sr(1e-3).build(),
        "adamw_4bit_split" => presets::adamw_4bit_split(1e-3).build(),
        "adamw_4bit_bf16_sr_released" => presets::adamw_4bit_bf16_sr_released(1e-3).build(),
        "sgdm_f32" => presets::sgdm_f32(1e-2, 0.9).build(),
        "lpmm_sgdm" => presets::lpmm_sgdm(1e-2, 0.9).build(),
        "adamw_8bit" => presets::adamw_8bit(1e-3).build(),
        "adamw_4bit" => presets::adamw_4bit(1e-3).build(),
        "lion_8bit" => presets::lion_8bit(1e-4).build(),
        "adafactor_lpmm" => presets::adafactor_lpmm().build(),
        "came_lpmm" => presets::came_lpmm(2e-4).build(),
        "ademamix_8bit" => presets::ademamix_8bit(1e-3).build(),
        "schedule_free_adamw_8bit" => presets::schedule_free_adamw_8bit(2.5e-3).build(),
        other => return Err(format!("unknown preset {other}").into()),
    };
    let factored = args.preset.starts_with("adafactor") || args.preset.starts_with("came");
    let shape = if factored {
        vec![n / 1024, 1024]
    } else {
        vec![n]
    };
    let mut options = OptimizerOptions::default();
    if args.skip_elements {
        options = options.with_non_finite(NonFinitePolicy::SkipElements);
    }
    let mut opt = Optimizer::new(options)?;
    opt.settings_mut().specialized_kernels = !args.generic;
    let g = opt.add_group(config)?;
    let init: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-4).collect();
    let grad: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-5).collect();
    let id = opt.add_param("w", &shape, &init, g)?;
    // One step first: the slots' pages are touched (faulted in) by it, not timed.
    opt.step(Step::param(id, &grad))?;
    let mut timed = std::time::Duration::ZERO;
    for _ in 0..steps {
        if args.acc {
            opt.accumulate(id, &grad)?;
            let t = Instant::now();
            opt.step(Accumulated)?;
            timed += t.elapsed();
        } else {
            let t = Instant::now();
            opt.step(Step::param(id, &grad))?;
            timed += t.elapsed();
        }
    }
    let ns = timed.as_secs_f64() * 1e9 / (steps * n) as f64;
    println!(
        "{} ({}, {:?}): {n} params, {steps} steps, {ns:.3} ns/param/step",
        args.preset,
        lpmm_optim::Cpu::kernel_name(&opt.param(id).map(|p| p.plan)?),
        lpmm_formats::simd::level(),
    );
    Ok(())
}
