//! A byte-level GPT trained through candle with each optimizer setup (an *arm*) in a process of
//! its own (`lpmm_candle_examples::gpt`): candle-nn's AdamW (f32), lpmm's `adamw_f32`,
//! `adamw_8bit` (f32 `Var`s), `adamw_8bit_bf16_sr` (bf16 `Var`s), 4-bit AdamW with gradient
//! release in lpmm's layers, and LPMM-SGDM in lpmm's layers.
//!
//! ```sh
//! # The CPU at a small size (CI): both modes, about a minute on 2 cores.
//! cargo run --release -p lpmm-candle-examples --example gpt
//! # A GPU (feature `cuda`; `cargo xtask gpu-bundle` builds it without a GPU or toolkit):
//! gpt --device cuda --size full --mode memory            # 302.8M parameters, a few steps per arm
//! gpt --device cuda --size full --mode quality --steps 600 --parallel 7   # shakespeare-char
//! ```
//!
//! `--mode memory`: each arm's process reports its peak memory — on a CUDA device the device's
//! (sampled from the driver every millisecond, and the stream-ordered pool's exact high-water
//! marks: `lpmm_candle_examples::device_memory`), its host memory (peak RSS), tokens per second
//! and the optimizer step's share of the step time, beside candle-nn AdamW's. `--mode quality`:
//! every arm trains the same steps on the same batches of the six plays (seed 0), the f32
//! reference also from seed 1 for its spread; validation loss (nats per byte) and next-byte
//! accuracy. Prints tables and writes the runs as JSON (`--json`, default
//! `target/lpmm-report/gpt-<mode>.json`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use candle_core::Device;
use lpmm_candle_examples::experiments;
use lpmm_candle_examples::gpt::{self, ArmKind, ArmRun, Recipe};
use lpmm_candle_examples::process;

/// The line prefix of a child's result.
const RESULT: &str = "GPT-RUN ";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    Memory,
    Quality,
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Size {
    /// The CPU's small model (CI).
    Tiny,
    /// The GPU's: 302.8M parameters for memory, nanoGPT's shakespeare-char for quality.
    Full,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DeviceKind {
    Cpu,
    Cuda,
}

/// A byte-level GPT, one process per optimizer arm.
#[derive(Debug, Clone, clap::Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    #[arg(long, value_enum, default_value = "tiny")]
    size: Size,
    /// `cuda`: candle's CUDA device 0 (this example built with feature `cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceKind,
    /// Arms, comma-separated (default: all).
    #[arg(long)]
    arms: Option<String>,
    /// Seeds of the f32 reference in quality mode (the other arms: the first).
    #[arg(long, default_value = "0,1")]
    seeds: String,
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long)]
    batch: Option<usize>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    width: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    context: Option<usize>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    sgd_lr: Option<f64>,
    /// Peak learning rate of Muon's matrices in the Muon arms (their AdamW part takes `--lr`).
    #[arg(long)]
    muon_lr: Option<f64>,
    #[arg(long)]
    val_windows: Option<usize>,
    /// Quality mode: arm processes run at once.
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// Where the JSON goes (default: target/lpmm-report/gpt-<mode>.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Child mode: train this arm here and print its result.
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Child mode: the recipe (memory or quality).
    #[arg(long, hide = true)]
    child_mode: Option<String>,
    /// Child mode: the seed.
    #[arg(long, hide = true, default_value_t = 0)]
    seed: u64,
}

impl Args {
    fn recipe(&self, memory: bool) -> Recipe {
        let mut r = match (self.size, memory) {
            (Size::Tiny, true) => Recipe::tiny_memory(),
            (Size::Tiny, false) => Recipe::tiny_quality(),
            (Size::Full, true) => Recipe::memory(),
            (Size::Full, false) => Recipe::quality(),
        };
        let set = |v: Option<usize>, f: &mut usize| {
            if let Some(v) = v {
                *f = v;
            }
        };
        set(self.steps, &mut r.steps);
        set(self.batch, &mut r.batch);
        set(self.layers, &mut r.shape.layers);
        set(self.width, &mut r.shape.width);
        set(self.heads, &mut r.shape.heads);
        set(self.context, &mut r.shape.context);
        if !memory {
            set(self.val_windows, &mut r.val_windows);
        }
        if let Some(lr) = self.lr {
            r.adamw_lr = lr;
        }
        if let Some(lr) = self.sgd_lr {
            r.sgd_lr = lr;
        }
        if let Some(lr) = self.muon_lr {
            r.muon_lr = lr;
        }
        r
    }

    /// The arguments a child repeats.
    fn passed(&self) -> Vec<String> {
        let mut v = vec![
            "--size".to_string(),
            format!("{:?}", self.size).to_lowercase(),
            "--device".into(),
            format!("{:?}", self.device).to_lowercase(),
        ];
        let mut opt = |name: &str, value: Option<String>| {
            if let Some(x) = value {
                v.push(format!("--{name}"));
                v.push(x);
            }
        };
        opt("steps", self.steps.map(|x| x.to_string()));
        opt("batch", self.batch.map(|x| x.to_string()));
        opt("layers", self.layers.map(|x| x.to_string()));
        opt("width", self.width.map(|x| x.to_string()));
        opt("heads", self.heads.map(|x| x.to_string()));
        opt("context", self.context.map(|x| x.to_string()));
        opt("lr", self.lr.map(|x| x.to_string()));
        opt("sgd-lr", self.sgd_lr.map(|x| x.to_string()));
        opt("muon-lr", self.muon_lr.map(|x| x.to_string()));
        opt("val-windows", self.val_windows.map(|x| x.to_string()));
        v
    }
}

fn device(kind: DeviceKind) -> candle_core::Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => Device::new_cuda(0),
    }
}

/// Trains one arm in this process and prints its result.
fn child(args: &Args, key: &str) -> Result<(), Box<dyn std::error::Error>> {
    let memory = args.child_mode.as_deref() == Some("memory");
    let recipe = args.recipe(memory);
    if !memory {
        // Speed, not the process's memory, matters in quality runs (process.rs).
        process::keep_freed_memory();
    }
    let arm = gpt::arm(key)?;
    let dev = device(args.device)?;
    let text = experiments::shakespeare()?;
    let (train, val) = gpt::byte_split(&text);
    let every = (recipe.steps / 10).max(1);
    let run = gpt::train(
        &arm,
        &recipe,
        args.seed,
        &dev,
        &train,
        &val,
        |step, loss| {
            if step % every == 0 {
                eprintln!("{key} seed {}: step {step}: loss {loss:.4}", args.seed);
            }
        },
    )?;
    println!("{RESULT}{}", serde_json::to_string(&run)?);
    Ok(())
}

/// Runs the children of `jobs` (arm, seed), `parallel` at a time, in order.
fn run_children(
    args: &Args,
    mode: &str,
    jobs: &[(String, u64)],
    parallel: usize,
) -> Result<Vec<ArmRun>, Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let mut out: Vec<Option<ArmRun>> = vec![None; jobs.len()];
    for (chunk_start, chunk) in jobs
        .chunks(parallel.max(1))
        .enumerate()
        .map(|(k, c)| (k * parallel.max(1), c))
    {
        let children: Vec<_> = chunk
            .iter()
            .map(|(arm, seed)| {
                eprintln!("{mode}: {arm}, seed {seed}");
                Command::new(&exe)
                    .args(["--child", arm, "--child-mode", mode])
                    .args(["--seed", &seed.to_string()])
                    .args(args.passed())
                    .stdout(Stdio::piped())
                    .spawn()
            })
            .collect::<Result<_, _>>()?;
        for (k, mut c) in children.into_iter().enumerate() {
            let stdout = c.stdout.take().ok_or("no stdout")?;
            let mut result = None;
            for line in BufReader::new(stdout).lines() {
                let line = line?;
                if let Some(json) = line.strip_prefix(RESULT) {
                    result = Some(serde_json::from_str::<ArmRun>(json)?);
                }
            }
            let status = c.wait()?;
            let (arm, seed) = &chunk[k];
            match result {
                Some(r) if status.success() => out[chunk_start + k] = Some(r),
                _ => eprintln!("{mode}: {arm}, seed {seed} failed ({status})"),
            }
        }
    }
    Ok(out.into_iter().flatten().collect())
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// The memory table: each arm beside candle-nn AdamW's process.
fn memory_table(runs: &[ArmRun]) -> String {
    let reference = runs.iter().find(|r| r.arm == "candle-adamw");
    let on_cuda = runs.iter().any(|r| r.cuda.is_some());
    let mut s = String::new();
    if let Some(r) = runs.first() {
        let sh = r.recipe.shape;
        s += &format!(
            "GPT {} blocks x {} wide, {} heads, context {} ({:.1}M parameters), batch {}, {} steps (the first untimed), on {}\n\n",
            sh.layers,
            sh.width,
            sh.heads,
            sh.context,
            sh.params() as f64 / 1e6,
            r.recipe.batch,
            r.recipe.steps,
            r.device
        );
    }
    if on_cuda {
        s += "| arm | device peak MiB (driver, sampled) | ÷ candle-nn AdamW | above context MiB | pool used high MiB | ÷ | pool reserved high MiB | host peak RSS MiB | Vars MiB | lpmm MiB | tokens/s | ÷ | optimizer step share |\n";
        s += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    } else {
        s += "| arm | peak RSS MiB | ÷ candle-nn AdamW | Vars MiB | lpmm MiB | tokens/s | ÷ | optimizer step share |\n";
        s += "|---|---:|---:|---:|---:|---:|---:|---:|\n";
    }
    let ratio = |a: f64, b: Option<f64>| b.map_or("-".into(), |b| format!("{:.3}", a / b));
    for r in runs {
        let tok = ratio(r.tokens_per_s, reference.map(|x| x.tokens_per_s));
        if let Some(c) = r.cuda {
            let rc = reference.and_then(|x| x.cuda);
            let pool = |m: Option<u64>| m.map_or("-".into(), |b| format!("{:.0}", mib(b)));
            s += &format!(
                "| {} | {:.0} | {} | {:.0} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.1}% |\n",
                r.name,
                mib(c.peak),
                ratio(c.peak as f64, rc.map(|x| x.peak as f64)),
                mib(c.peak - c.baseline),
                pool(c.pool_used_high),
                match (c.pool_used_high, rc.and_then(|x| x.pool_used_high)) {
                    (Some(a), Some(b)) => format!("{:.3}", a as f64 / b as f64),
                    _ => "-".into(),
                },
                pool(c.pool_reserved_high),
                mib(r.host.peak_rss),
                mib(r.var_bytes as u64),
                mib(r.optimizer_bytes as u64),
                r.tokens_per_s,
                tok,
                100.0 * r.optimizer_share
            );
        } else {
            s += &format!(
                "| {} | {:.0} | {} | {:.1} | {:.1} | {:.0} | {} | {:.1}% |\n",
                r.name,
                mib(r.host.peak_rss),
                ratio(
                    r.host.peak_rss as f64,
                    reference.map(|x| x.host.peak_rss as f64)
                ),
                mib(r.var_bytes as u64),
                mib(r.optimizer_bytes as u64),
                r.tokens_per_s,
                tok,
                100.0 * r.optimizer_share
            );
        }
    }
    s
}

/// The quality table: validation loss and accuracy, each lpmm arm against the f32 reference's
/// seeds.
fn quality_table(runs: &[ArmRun]) -> String {
    let refs: Vec<&ArmRun> = runs.iter().filter(|r| r.arm == "candle-adamw").collect();
    let ref_losses: Vec<f64> = refs.iter().filter_map(|r| r.val_loss).collect();
    let (lo, hi) = ref_losses
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let mut s = String::new();
    if let Some(r) = runs.first() {
        let sh = r.recipe.shape;
        s += &format!(
            "GPT {} blocks x {} wide, {} heads, context {} ({:.2}M parameters), batch {}, {} steps, validation on {} windows, on {}\n\n",
            sh.layers,
            sh.width,
            sh.heads,
            sh.context,
            sh.params() as f64 / 1e6,
            r.recipe.batch,
            r.recipe.steps,
            r.recipe.val_windows,
            r.device
        );
    }
    s += "| arm | seed | val loss (nats/byte) | val accuracy | final train loss | ms/step | within the reference's seed range |\n";
    s += "|---|---:|---:|---:|---:|---:|---|\n";
    for r in runs {
        let verdict = match r.val_loss {
            _ if r.arm == "candle-adamw" => "reference".to_string(),
            Some(v) if ref_losses.len() >= 2 => {
                if v <= hi {
                    format!("yes ({:+.4} against the worst seed)", v - hi)
                } else {
                    format!("no ({:+.4} above the worst seed)", v - hi)
                }
            }
            _ => "-".into(),
        };
        s += &format!(
            "| {} | {} | {} | {} | {:.4} | {:.1} | {} |\n",
            r.name,
            r.seed,
            r.val_loss.map_or("-".into(), |v| format!("{v:.4}")),
            r.val_accuracy
                .map_or("-".into(), |v| format!("{:.2}%", 100.0 * v)),
            r.final_train_loss,
            r.ms_per_step,
            verdict
        );
    }
    if ref_losses.len() >= 2 {
        s += &format!(
            "\nf32 reference (candle-nn AdamW): {} seeds, val loss {lo:.4} to {hi:.4} (spread {:.4})\n",
            ref_losses.len(),
            hi - lo
        );
    }
    s
}

fn write_json(
    args: &Args,
    mode: &str,
    runs: &[ArmRun],
) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let path = match &args.json {
        Some(p) if args.mode == Mode::Both => {
            let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("gpt");
            p.with_file_name(format!("{stem}-{mode}.json"))
        }
        Some(p) => p.clone(),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/lpmm-report")
            .join(format!("gpt-{mode}.json")),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(runs)?)?;
    Ok(path)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: first thing in main, before any other thread exists.
    unsafe { process::candle_threads() };
    let args = <Args as clap::Parser>::parse();
    if let Some(key) = args.child.clone() {
        return child(&args, &key);
    }
    let keys: Vec<String> = match &args.arms {
        Some(list) => list.split(',').map(str::to_string).collect(),
        // Muon's matrix phase runs on lpmm's CPU backend only (docs/BACKENDS.md): on CUDA the
        // default leaves its arms out (naming them with --arms runs them, and they fail).
        None => gpt::arms()
            .iter()
            .filter(|a| {
                let skip = args.device == DeviceKind::Cuda && matches!(a.kind, ArmKind::Hybrid(_));
                if skip {
                    eprintln!("{}: left out on cuda (no matrix phase on lpmm-cuda)", a.key);
                }
                !skip
            })
            .map(|a| a.key.to_string())
            .collect(),
    };
    for k in &keys {
        gpt::arm(k)?;
    }
    let seeds: Vec<u64> = args
        .seeds
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let mut failed = false;
    if matches!(args.mode, Mode::Memory | Mode::Both) {
        let jobs: Vec<(String, u64)> = keys.iter().map(|k| (k.clone(), seeds[0])).collect();
        let runs = run_children(&args, "memory", &jobs, 1)?;
        failed |= runs.len() < jobs.len();
        println!("{}", memory_table(&runs));
        println!(
            "(written to {})\n",
            write_json(&args, "memory", &runs)?.display()
        );
    }
    if matches!(args.mode, Mode::Quality | Mode::Both) {
        let mut jobs = Vec::new();
        for k in &keys {
            if k == "candle-adamw" {
                jobs.extend(seeds.iter().map(|&s| (k.clone(), s)));
            } else {
                jobs.push((k.clone(), seeds[0]));
            }
        }
        let runs = run_children(&args, "quality", &jobs, args.parallel)?;
        failed |= runs.len() < jobs.len();
        println!("{}", quality_table(&runs));
        println!(
            "(written to {})",
            write_json(&args, "quality", &runs)?.display()
        );
    }
    if failed {
        return Err("some arms failed (their errors are above)".into());
    }
    Ok(())
}
