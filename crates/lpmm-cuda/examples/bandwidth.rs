//! Effective bandwidth of the fused step: 8-bit AdamW (bf16 parameters and gradient accumulators;
//! nearest and stochastic rounding of the parameter), 4-bit AdamW, LPMM-SGDM, 8-bit Lion and f32
//! AdamW at the given sizes, each against a device-to-device copy of the same bytes measured in
//! the same run; and (`--many`) many small tensors stepped together. Each row names the
//! specialized step that ran it (`plan`), whose static instruction count
//! `crates/lpmm-cuda/gpu/calibrate.py` turns into the issue-rate model's measured rate.
//!
//! ```text
//! cargo run --release -p lpmm-cuda --example bandwidth -- --params 1e8,1e9 [--iters 20]
//! cargo run --release -p lpmm-cuda --example bandwidth -- --cases adamw8 --generic
//! cargo run --release -p lpmm-cuda --example bandwidth -- --params 0 --many 10000
//! cargo run --release -p lpmm-cuda --example bandwidth -- --emulate --params 1e5   # no GPU
//! ```
//!
//! Bytes moved per step: every slot read once and written once (the accumulator is cleared), the
//! backend's own accounting (`Backend::bytes`) times two. Effective bandwidth = bytes moved / time
//! per step; the copy's = 2 x bytes copied / time. The step is timed through
//! `lpmm_optim::backend::run_batch` (the executor's run of one batch over the backend's
//! primitives), as `Optimizer::step` runs it without clipping under
//! `NonFinitePolicy::SkipElements`: one launch per plan and the read-back of the flag words per
//! step.
//!
//! - `--cases`: which of `adamw8`, `adamw8sr`, `adamw4`, `sgdm`, `lion8`, `adamw32` (default:
//!   all).
//! - `--generic`: also each case with the specialized steps off (`CudaOptions::with_specialized`):
//!   the generic kernel, for the speed-up.
//! - `--many N`: also N tensors of 4096 to 2^20 elements (`many_sizes`, the same sizes as
//!   `peers_cuda.py --many N`) in one step, for each case.
//! - `--json PATH` writes the figures.
//!
//! With `--emulate` the kernels run on the CPU (kernels/emulate.cpp): a smoke test of this
//! harness, not a GPU figure.

use std::time::Instant;

use lpmm_cuda::{Cuda, CudaOptions};
use lpmm_optim::backend::{
    HostValues, Init, ParamLayout, ParamStep, StepFlags, StepPlan, StepWork,
};
use lpmm_optim::{ParamConfig, Storage, backend::Backend, presets};

/// The fused steps against a device copy.
#[derive(Debug, clap::Parser)]
struct Args {
    /// Parameter counts, comma-separated (`1e8` notation accepted; 0 is skipped).
    #[arg(long, value_delimiter = ',', value_parser = count, default_value = "1e8,1e9")]
    params: Vec<usize>,
    /// The cases, comma-separated: adamw8, adamw8sr, adamw4, sgdm, lion8, adamw32.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "adamw8,adamw8sr,adamw4,sgdm,lion8,adamw32"
    )]
    cases: Vec<String>,
    /// Timed steps per case.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Also measure every case with the specialized steps off (the generic kernel).
    #[arg(long)]
    generic: bool,
    /// Also step this many small tensors (4096 to 2^20 elements) together, per case.
    #[arg(long, default_value_t = 0)]
    many: usize,
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

/// The sizes of `--many N`: tensor `i` has `4096 * 256^u` elements (4096 to 2^20), `u =
/// ((i * 7919) mod N) / (N - 1)`, rounded down to a multiple of 16: log-uniform, spread without
/// a random generator so that `peers_cuda.py` makes the same list.
fn many_sizes(n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| {
            let u = if n > 1 {
                ((i * 7919) % n) as f64 / (n - 1) as f64
            } else {
                0.0
            };
            ((4096.0 * 256f64.powf(u)) as usize) / 16 * 16
        })
        .collect()
}

fn four_bit(lr: f64) -> ParamConfig {
    presets::adamw_8bit_bf16(lr)
        .with_state1(Storage::FOUR_BIT_SIGNED)
        .with_state2(Storage::FOUR_BIT_UNSIGNED)
        .build()
}

fn config(case: &str) -> Result<(&'static str, ParamConfig), String> {
    Ok(match case {
        "adamw8" => ("adamw 8-bit", presets::adamw_8bit_bf16(1e-3).build()),
        "adamw8sr" => ("adamw 8-bit sr", presets::adamw_8bit_bf16_sr(1e-3).build()),
        "adamw4" => ("adamw 4-bit", four_bit(1e-3)),
        "sgdm" => ("lpmm-sgdm", presets::lpmm_sgdm(0.05, 0.9).build()),
        "lion8" => ("lion 8-bit", presets::lion_8bit(1e-4).build()),
        "adamw32" => ("adamw f32", presets::adamw_f32(1e-3).build()),
        other => {
            return Err(format!(
                "unknown case {other:?}: adamw8, adamw8sr, adamw4, sgdm, lion8 or adamw32"
            ));
        }
    })
}

/// One measurement: seconds per step and bytes moved per step, and the specialized steps that
/// step its parameters (lpmm-backend's plans; `-` for the generic step).
struct Figure {
    step_s: f64,
    moved: usize,
    plan_launches: u64,
    plans: Vec<String>,
}

/// Allocates one parameter per size with `config`, fills each accumulator once, and times
/// `iters` steps of all of them together (after one warm-up step).
fn measure(
    backend: &Cuda,
    config: ParamConfig,
    sizes: &[usize],
    iters: usize,
) -> Result<Figure, Box<dyn std::error::Error>> {
    let mut layouts = Vec::new();
    let mut params = Vec::new();
    let mut resolved_all = Vec::new();
    for &n in sizes {
        let resolved = config.resolve(n, &[n]);
        let layout = ParamLayout {
            shape: vec![n],
            numel: n,
            formats: resolved.formats(),
            stream: layouts.len() as u64,
            offset: 0,
            lent: false,
        };
        let init: Vec<f32> = (0..n).map(|i| ((i % 977) as f32 - 488.0) * 1e-4).collect();
        let values = backend.host_input(HostValues::F32(&init));
        let mut p = backend.allocate(&layout, Init::Values(values), 1)?;
        drop(init);
        let grad: Vec<f32> = (0..n).map(|i| ((i % 631) as f32 - 315.0) * 1e-5).collect();
        let grad_in = backend.host_input(HostValues::F32(&grad));
        backend.accumulate(&mut p, &layout, 0, grad_in, 1)?;
        params.push(p);
        layouts.push(layout);
        resolved_all.push(resolved);
    }
    let moved: usize = params
        .iter()
        .zip(&layouts)
        .map(|(p, l)| 2 * backend.bytes(p, l).iter().sum::<usize>())
        .sum();
    let step_plans: Vec<StepPlan> = resolved_all
        .iter()
        .zip(&layouts)
        .map(|(r, l)| StepPlan::new(l, &r.hyper.consts(1, &Default::default())))
        .collect();
    let mut plans: Vec<String> = resolved_all
        .iter()
        .zip(&layouts)
        .map(|(r, l)| {
            let consts = r.hyper.consts(2, &Default::default());
            lpmm_backend::plans::find(l, &consts, lpmm_backend::plans::GradInput::None)
                .map_or("-".into(), |k| lpmm_backend::plans::plans()[k].name.clone())
        })
        .collect();
    plans.sort();
    plans.dedup();
    let mut flags = vec![false; params.len()];
    let mut steps = 0u64;
    let mut step = |params: &mut [_]| {
        steps += 1;
        let plans: Vec<Option<ParamStep>> = resolved_all
            .iter()
            .zip(&step_plans)
            .map(|(r, &plan)| {
                Some(ParamStep {
                    plan,
                    t: steps,
                    flags: StepFlags(StepFlags::UPDATE_PARAM).with(StepFlags::FIRST, steps == 1),
                    rule: r.hyper.consts(steps, &Default::default()),
                    clip: 1.0,
                })
            })
            .collect();
        let work = StepWork {
            params,
            layouts: &layouts,
            plans: &plans,
            released: None,
            lent: &mut [],
            seed: 1,
        };
        lpmm_optim::backend::run_batch(backend, work, &mut flags)
    };
    // Warm-up (the first step also loads the module's code onto the device).
    step(&mut params)?;
    backend.synchronize()?;
    let launches = backend.plan_launches();
    let t0 = Instant::now();
    for _ in 0..iters {
        step(&mut params)?;
    }
    backend.synchronize()?;
    Ok(Figure {
        step_s: t0.elapsed().as_secs_f64() / iters.max(1) as f64,
        moved,
        plan_launches: (backend.plan_launches() - launches) / iters.max(1) as u64,
        plans,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = <Args as clap::Parser>::parse();
    let make = |specialized: bool| -> Result<Cuda, Box<dyn std::error::Error>> {
        let options = CudaOptions::default().with_specialized(specialized);
        Ok(if args.emulate {
            Cuda::emulated(options)?
        } else {
            Cuda::with_options(0, options)?
        })
    };
    let mut backends = vec![("specialized", make(true)?)];
    if args.generic {
        backends.push(("generic", make(false)?));
    }
    let first = &backends[0].1;
    println!(
        "device: {} ({}), {} timed steps per case",
        first.device_name(),
        first.arch(),
        args.iters
    );
    let mut workloads: Vec<(String, Vec<usize>)> = args
        .params
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| (format!("n={n}"), vec![n]))
        .collect();
    if args.many > 0 {
        workloads.push((format!("{} tensors", args.many), many_sizes(args.many)));
    }
    let mut rows = Vec::new();
    for (what, sizes) in &workloads {
        let total: usize = sizes.iter().sum();
        for case in &args.cases {
            let (name, config) = config(case)?;
            for (kernel, backend) in &backends {
                let f = measure(backend, config, sizes, args.iters)?;
                let copy_s = backend.time_device_copy(f.moved / 2, args.iters)?;
                let step_bw = f.moved as f64 / f.step_s / 1e9;
                let copy_bw = f.moved as f64 / copy_s / 1e9;
                println!(
                    "{name:12} {kernel:11} {what:>16} ({total} params): {:9.3} ms/step, {:6.2} B/param, {step_bw:9.1} GB/s; copy: {copy_bw:9.1} GB/s; ratio {:.3}; {} specialized launches/step",
                    f.step_s * 1e3,
                    f.moved as f64 / total as f64,
                    step_bw / copy_bw,
                    f.plan_launches
                );
                // The plan of a specialized run (one per case: every tensor resolves alike).
                let plan = if *kernel == "specialized" && f.plans.len() == 1 {
                    f.plans[0].clone()
                } else {
                    "-".into()
                };
                rows.push(format!(
                    "{{\"case\":\"{name}\",\"kernel\":\"{kernel}\",\"plan\":\"{plan}\",\"workload\":\"{what}\",\"tensors\":{},\"params\":{total},\"step_s\":{},\"bytes_moved\":{},\"step_gbps\":{step_bw},\"copy_gbps\":{copy_bw},\"ratio\":{},\"plan_launches_per_step\":{}}}",
                    sizes.len(),
                    f.step_s,
                    f.moved,
                    step_bw / copy_bw,
                    f.plan_launches
                ));
                // Written after every row, so that a run cut short keeps what it measured.
                if let Some(path) = &args.json {
                    let body = format!(
                        "{{\"device\":\"{}\",\"arch\":\"{}\",\"emulated\":{},\"rows\":[{}]}}\n",
                        first.device_name(),
                        first.arch(),
                        args.emulate,
                        rows.join(",")
                    );
                    std::fs::write(path, body)?;
                }
            }
        }
    }
    if let Some(path) = &args.json {
        println!("wrote {path}");
    }
    Ok(())
}
