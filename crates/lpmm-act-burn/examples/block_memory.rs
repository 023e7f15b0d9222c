//! Peak heap memory and time of one training step (forward + backward) of a pre-LN transformer
//! block on burn-flex (burn 0.22.1 CPU backend), with burn's own LayerNorm / softmax / dropout / GELU and
//! with lpmm-act's operators (`lpmm_act_burn::block`), measured with a counting global allocator
//! in the same run.
//!
//! `cargo run --profile bench -p lpmm-act-burn --example block_memory [-- --steps N]`
//!
//! Prints a markdown table and writes `target/lpmm-report/act_memory.json`.

#[path = "../tests/common/counting.rs"]
mod counting;

use burn_tensor::Device;
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
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps = <Args as clap::Parser>::parse().steps;
    let device = Device::flex().autodiff();
    let cfg = BlockConfig::default();
    let block = Block::new(cfg, &device, 1);
    let mut rng = Rng::new(2);
    let shape = [cfg.batch, cfg.seq, cfg.d_model];
    let x = rng.tensor(shape, 1.0, &device);
    let target = rng.tensor(shape, 1.0, &device);

    let results: Vec<_> = Variant::ALL
        .iter()
        .map(|&v| (v, counting::measure(&block, &x, &target, v, steps)))
        .collect();
    let base = results[0].1;

    println!("## Transformer block training step: burn 0.22.1 (flex, CPU) vs lpmm-act\n");
    println!(
        "pre-LN block, d_model {}, {} heads, d_ff {}, sequence {}, batch {}, attention dropout {}; \
         forward + backward of an MSE loss; median of {steps} steps after a warm-up.\n",
        cfg.d_model, cfg.heads, cfg.d_ff, cfg.seq, cfg.batch, cfg.dropout
    );
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
        "config": {
            "d_model": cfg.d_model, "heads": cfg.heads, "d_ff": cfg.d_ff, "seq": cfg.seq,
            "batch": cfg.batch, "dropout": short(cfg.dropout), "eps": short(cfg.eps),
        },
        "steps": steps,
        "results": rows,
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/lpmm-report");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("act_memory.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    println!("(written to target/lpmm-report/act_memory.json)");
    Ok(())
}
