//! Memory and time of one training step (forward + backward) of a pre-LN transformer block, with
//! burn's own LayerNorm / softmax / dropout / GELU and with lpmm-act's operators
//! (`lpmm_act_burn::block`), in the same run:
//!
//! - on burn-flex (burn 0.22.1's CPU backend, the default): heap memory from a counting global
//!   allocator (held after the forward pass, peak during the step);
//! - on burn's wgpu device (`--device wgpu`: a GPU, or lavapipe on a CPU): device memory in use
//!   from cubecl's memory report after the forward pass has run (`Device::sync`), and the host
//!   reads the operators made (zero: their CubeCL kernels run on the device).
//!
//! `cargo run --profile bench -p lpmm-act-burn --example block_memory [-- --steps N] [--device wgpu]`
//!
//! Prints a markdown table and writes `target/lpmm-report/act_memory.json` (`act_memory_wgpu.json`
//! on wgpu).

#[path = "../tests/common/counting.rs"]
mod counting;

use std::time::Instant;

use burn_dispatch::DispatchDevice;
use burn_tensor::{Device, Tensor};
use lpmm_act_burn::RandomStream;
use lpmm_act_burn::block::{Block, BlockConfig, Rng, Variant};

#[global_allocator]
static ALLOC: counting::Counting = counting::Counting;

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// An f32 as the f64 of its shortest decimal form (0.1, not 0.10000000149011612).
fn short(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(f64::from(v))
}

/// A transformer block's training step, burn's operators against lpmm-act's.
#[derive(Debug, clap::Parser)]
struct Args {
    /// Training steps measured per variant.
    #[arg(long, default_value_t = 7)]
    steps: usize,
    /// Where the block runs: `flex` (burn's CPU backend) or `wgpu` (burn's wgpu device).
    #[arg(long, default_value = "flex")]
    device: String,
}

/// The block, its input and its target on `device` (the same on every backend).
fn setup(device: &Device) -> (BlockConfig, Block, Tensor<3>, Tensor<3>) {
    let cfg = BlockConfig::default();
    let block = Block::new(cfg, device, 1);
    let mut rng = Rng::new(2);
    let shape = [cfg.batch, cfg.seq, cfg.d_model];
    let x = rng.tensor(shape, 1.0, device);
    let target = rng.tensor(shape, 1.0, device);
    (cfg, block, x, target)
}

/// The table's heading: what ran, where.
fn heading(backend: &str, cfg: &BlockConfig, steps: usize, device: &str) {
    println!("## Transformer block training step: burn 0.22.1 ({backend}) vs lpmm-act\n");
    println!(
        "pre-LN block, d_model {}, {} heads, d_ff {}, sequence {}, batch {}, attention dropout {}; \
         forward + backward of an MSE loss; median of {steps} steps after a warm-up{device}.\n",
        cfg.d_model, cfg.heads, cfg.d_ff, cfg.seq, cfg.batch, cfg.dropout
    );
}

/// Writes `report` (with the block's configuration and the step count added) to
/// `target/lpmm-report/{file}`.
fn write_report(
    file: &str,
    mut report: serde_json::Value,
    cfg: &BlockConfig,
    steps: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    report["config"] = serde_json::json!({
        "d_model": cfg.d_model, "heads": cfg.heads, "d_ff": cfg.d_ff, "seq": cfg.seq,
        "batch": cfg.batch, "dropout": short(cfg.dropout), "eps": short(cfg.eps),
    });
    report["steps"] = serde_json::json!(steps);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/lpmm-report");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(file), serde_json::to_string_pretty(&report)?)?;
    println!("(written to target/lpmm-report/{file})");
    Ok(())
}

/// Device memory in use (cubecl's memory report, every stream), bytes.
fn device_bytes(device: &Device) -> u64 {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(d) => {
            d.client()
                .memory_report(burn_cubecl::cubecl::MemoryScope::Device)
                .usage()
                .bytes_in_use
        }
        _ => 0,
    }
}

/// One step on the device: `(bytes held after the forward pass, host reads by the operators,
/// loss)`; the step's time is the caller's.
fn device_step(
    block: &Block,
    x: &Tensor<3>,
    target: &Tensor<3>,
    variant: Variant,
    stream: RandomStream,
) -> (u64, usize, f32) {
    let device = x.device();
    device.sync().expect("the device runs");
    let base = device_bytes(&device);
    let reads = lpmm_act_burn::host_reads();
    let out = block.forward(x.clone(), variant, stream);
    let diff = out - target.clone();
    let loss = (diff.clone() * diff).mean();
    device.sync().expect("the forward pass runs");
    let held = device_bytes(&device).saturating_sub(base);
    let grads = loss.backward();
    let reads = lpmm_act_burn::host_reads() - reads;
    let sq = block.grad_square_sum(&grads);
    assert!(
        sq.is_finite() && sq > 0.0,
        "gradients are finite and nonzero"
    );
    (held, reads, loss.into_scalar::<f32>())
}

/// The device measurement: held after forward (median), host reads (max), median ms per step.
#[derive(Debug, Clone, Copy)]
struct DeviceMeasured {
    held_after_forward: u64,
    host_reads: usize,
    median_ms: f64,
    loss: f32,
}

fn device_measure(
    block: &Block,
    x: &Tensor<3>,
    target: &Tensor<3>,
    variant: Variant,
    steps: usize,
) -> DeviceMeasured {
    // One warm-up step (kernel compilation, pools).
    device_step(block, x, target, variant, RandomStream::new(1, 0, 0));
    let mut held = Vec::new();
    let mut ms = Vec::new();
    let (mut reads, mut loss) = (0, f32::NAN);
    for s in 0..steps.max(1) {
        let t = Instant::now();
        let (h, r, l) = device_step(
            block,
            x,
            target,
            variant,
            RandomStream::new(1, 0, 1 + s as u64),
        );
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        held.push(h);
        reads = reads.max(r);
        if s == 0 {
            loss = l;
        }
    }
    held.sort_unstable();
    ms.sort_by(f64::total_cmp);
    DeviceMeasured {
        held_after_forward: held[held.len() / 2],
        host_reads: reads,
        median_ms: ms[ms.len() / 2],
        loss,
    }
}

fn run_wgpu(steps: usize) -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::wgpu_options().init()?.autodiff();
    let (cfg, block, x, target) = setup(&device);
    let adapter = format!("{device:?}");
    let results: Vec<_> = Variant::ALL
        .iter()
        .map(|&v| (v, device_measure(&block, &x, &target, v, steps)))
        .collect();
    let base = results[0].1;
    heading("wgpu", &cfg, steps, &format!("; device {adapter}"));
    println!(
        "| variant | device memory held after forward | of baseline | host reads by the operators | ms/step | vs baseline |"
    );
    println!("|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (v, m) in &results {
        let ratio = m.held_after_forward as f64 / base.held_after_forward as f64;
        let time = m.median_ms / base.median_ms;
        println!(
            "| {} | {} B ({:.2} MiB) | {:.1}% | {} | {:.1} | {:.2}x |",
            v.name(),
            m.held_after_forward,
            mib(m.held_after_forward as usize),
            100.0 * ratio,
            m.host_reads,
            m.median_ms,
            time,
        );
        rows.push(serde_json::json!({
            "variant": format!("{v:?}"),
            "name": v.name(),
            "held_after_forward_bytes": m.held_after_forward,
            "held_percent_of_baseline": 100.0 * ratio,
            "host_reads": m.host_reads,
            "median_ms": m.median_ms,
            "time_vs_baseline": time,
            "loss": m.loss,
        }));
    }
    println!(
        "\n(device bytes in use above what was in use before the step, after the forward pass ran: \
         what the autodiff graph keeps for the backward pass plus the loss)"
    );
    let report = serde_json::json!({
        "command": "cargo run --profile bench -p lpmm-act-burn --example block_memory -- --device wgpu",
        "backend": "burn 0.22.1 Autodiff<Cube> (wgpu)",
        "device": adapter,
        "results": rows,
    });
    write_report("act_memory_wgpu.json", report, &cfg, steps)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = <Args as clap::Parser>::parse();
    let steps = args.steps;
    match args.device.as_str() {
        "flex" => {}
        "wgpu" => return run_wgpu(steps),
        other => return Err(format!("--device flex or wgpu, not {other}").into()),
    }
    let device = Device::flex().autodiff();
    let (cfg, block, x, target) = setup(&device);

    let results: Vec<_> = Variant::ALL
        .iter()
        .map(|&v| (v, counting::measure(&block, &x, &target, v, steps)))
        .collect();
    let base = results[0].1;

    heading("flex, CPU", &cfg, steps, "");
    println!("| variant | held after forward | saving | peak during step | saving | ms/step |");
    println!("|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (v, m) in &results {
        let saving = 100.0 * (1.0 - m.peak as f64 / base.peak as f64);
        let held_saving =
            100.0 * (1.0 - m.held_after_forward as f64 / base.held_after_forward as f64);
        println!(
            "| {} | {} B ({:.2} MiB) | {:.1}% | {} B ({:.2} MiB) | {:.1}% | {:.1} |",
            v.name(),
            m.held_after_forward,
            mib(m.held_after_forward),
            held_saving,
            m.peak,
            mib(m.peak),
            saving,
            m.median_ms,
        );
        rows.push(serde_json::json!({
            "variant": format!("{v:?}"),
            "name": v.name(),
            "held_after_forward_bytes": m.held_after_forward,
            "held_saving_percent": held_saving,
            "peak_bytes": m.peak,
            "peak_saving_percent": saving,
            "median_ms": m.median_ms,
            "loss": m.loss,
        }));
    }
    println!(
        "\n(bytes above what was live before the step: parameters, input and target excluded; \
         'held after forward' is what the autodiff graph keeps for the backward pass plus the loss)"
    );

    let report = serde_json::json!({
        "command": "cargo run --profile bench -p lpmm-act-burn --example block_memory",
        "backend": "burn 0.22.1 Autodiff<Flex> (CPU)",
        "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "results": rows,
    });
    write_report("act_memory.json", report, &cfg, steps)
}
