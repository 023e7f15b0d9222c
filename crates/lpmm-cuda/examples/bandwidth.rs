//! Effective bandwidth of the fused step: 8-bit and 4-bit AdamW (bf16 parameters and gradient
//! accumulators) at the given sizes, against a device-to-device copy measured in the same run.
//!
//! ```text
//! cargo run --release -p lpmm-cuda --example bandwidth -- --params 1e8,1e9 [--iters 20]
//! cargo run --release -p lpmm-cuda --example bandwidth -- --emulate --params 1e5   # no GPU
//! ```
//!
//! Bytes moved per step: every slot read once and written once (the accumulator is cleared), the
//! backend's own accounting (`Backend::bytes`) times two. Effective bandwidth = bytes moved / time
//! per step; the copy's = 2 x bytes copied / time. The step is timed through `Backend::step`, as
//! `Optimizer::step` calls it without clipping under `NonFinitePolicy::SkipElements`: one launch
//! and the read-back of one flag word per step. `--json PATH` writes the figures. With `--emulate` the kernels run on the CPU
//! (kernels/emulate.cpp): a smoke test of this harness, not a GPU figure.

use std::time::Instant;

use lpmm_cuda::{Cuda, CudaOptions};
use lpmm_optim::backend::{
    HostValues, Init, ParamLayout, ParamStep, StepFlags, StepPlan, StepWork,
};
use lpmm_optim::{Backend, ParamConfig, Storage, presets};

/// The fused 8-bit and 4-bit AdamW steps against a device copy.
#[derive(Debug, clap::Parser)]
struct Args {
    /// Parameter counts, comma-separated (`1e8` notation accepted).
    #[arg(long, value_delimiter = ',', value_parser = count, default_value = "1e8,1e9")]
    params: Vec<usize>,
    /// Timed steps per case.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Run the kernels' host emulation instead of a GPU.
    #[arg(long)]
    emulate: bool,
    /// Also write the rows as JSON to this path.
    #[arg(long, value_name = "PATH")]
    json: Option<String>,
}

/// A count written as an integer or in `1e8` notation.
fn count(x: &str) -> Result<usize, String> {
    x.parse::<f64>()
        .map(|f| f as usize)
        .map_err(|e| format!("{x}: {e}"))
}

fn parse() -> Result<Args, String> {
    Ok(<Args as clap::Parser>::parse())
}

fn four_bit(lr: f64) -> ParamConfig {
    presets::adamw_8bit_bf16(lr)
        .with_state1(Storage::FOUR_BIT_SIGNED)
        .with_state2(Storage::FOUR_BIT_UNSIGNED)
        .build()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse()?;
    let backend = if args.emulate {
        Cuda::emulated(CudaOptions::default())?
    } else {
        Cuda::new(0)?
    };
    println!(
        "device: {} ({}), {} timed steps per case",
        backend.device_name(),
        backend.arch(),
        args.iters
    );
    let mut rows = Vec::new();
    for &n in &args.params {
        for (name, config) in [
            ("adamw 8-bit", presets::adamw_8bit_bf16(1e-3).build()),
            ("adamw 4-bit", four_bit(1e-3)),
        ] {
            // The backend driven directly, as the optimizer drives it: one parameter, its
            // accumulator filled once, then steps (each reads and writes every slot; the cleared
            // accumulator is read again, so every step does the same work).
            let resolved = config.resolve(n, &[n]);
            let layout = ParamLayout {
                shape: vec![n],
                numel: n,
                formats: resolved.formats(),
                stream: 0,
                offset: 0,
                lent: false,
            };
            let init: Vec<f32> = (0..n).map(|i| ((i % 977) as f32 - 488.0) * 1e-4).collect();
            let values = backend.host_input(HostValues::F32(&init));
            let mut params = vec![backend.allocate(&layout, Init::Values(values), 1)?];
            drop(init);
            let grad: Vec<f32> = (0..n).map(|i| ((i % 631) as f32 - 315.0) * 1e-5).collect();
            let grad_in = backend.host_input(HostValues::F32(&grad));
            backend.accumulate(&mut params[0], &layout, 0, grad_in, 1)?;
            drop(grad);
            let moved = 2 * backend.bytes(&params[0], &layout).iter().sum::<usize>();
            let layouts = std::slice::from_ref(&layout);
            let mut flags = [false];
            let mut steps = 0u64;
            let step_plan = StepPlan::new(&layout, &resolved.hyper.consts(1, &Default::default()));
            let mut step = |params: &mut [_]| {
                steps += 1;
                let plan = ParamStep {
                    plan: step_plan,
                    t: steps,
                    flags: StepFlags(StepFlags::UPDATE_PARAM).with(StepFlags::FIRST, steps == 1),
                    rule: resolved.hyper.consts(steps, &Default::default()),
                    clip: 1.0,
                };
                backend.step(StepWork {
                    params,
                    layouts,
                    plans: &[Some(plan)],
                    released: None,
                    lent: &mut [],
                    seed: 1,
                    non_finite: &mut flags,
                })
            };
            // Warm-up (the first step also loads the module's code onto the device).
            step(&mut params)?;
            backend.synchronize()?;
            let t0 = Instant::now();
            for _ in 0..args.iters {
                step(&mut params)?;
            }
            backend.synchronize()?;
            let step_s = t0.elapsed().as_secs_f64() / args.iters as f64;
            let copy_s = backend.time_device_copy(moved / 2, args.iters)?;
            let step_bw = moved as f64 / step_s / 1e9;
            let copy_bw = moved as f64 / copy_s / 1e9;
            println!(
                "{name:12} n={n:>13}: {:8.3} ms/step, {:6.2} B/param, {step_bw:9.3} GB/s; copy of {} MB: {copy_bw:9.3} GB/s; ratio {:.3}",
                step_s * 1e3,
                moved as f64 / n as f64,
                moved / 2 / 1_000_000,
                step_bw / copy_bw
            );
            rows.push(format!(
                "{{\"case\":\"{name}\",\"params\":{n},\"step_s\":{step_s},\"bytes_moved\":{moved},\"step_gbps\":{step_bw},\"copy_gbps\":{copy_bw},\"ratio\":{}}}",
                step_bw / copy_bw
            ));
        }
    }
    if let Some(path) = args.json {
        let body = format!(
            "{{\"device\":\"{}\",\"arch\":\"{}\",\"emulated\":{},\"rows\":[{}]}}\n",
            backend.device_name(),
            backend.arch(),
            args.emulate,
            rows.join(",")
        );
        std::fs::write(&path, body)?;
        println!("wrote {path}");
    }
    Ok(())
}
