//! A wide digits classifier (64 -> H -> H -> 10, ReLU, cross-entropy) trained in burn with burn's
//! own AdamW and with lpmm's optimizers, on burn's ndarray CPU backend and on burn's wgpu device
//! (Mesa's lavapipe where there is no GPU: its "device" memory is the process's memory), each
//! configuration in its own child process, which reports its peak (`VmHWM`) and steady (`VmRSS`
//! after the last step) resident memory, the memory lpmm's optimizer holds, and the loss and
//! validation accuracy it reached.
//!
//! ```sh
//! cargo run --profile bench -p lpmm-burn --example memory                # H = 2048 (4.3M parameters), 30 steps
//! cargo run --profile bench -p lpmm-burn --example memory -- --backends ndarray --repeat 3
//! cargo run --profile bench -p lpmm-burn --example memory -- --backends wgpu --repeat 2 --lpmm-segment-mib 16
//! cargo run --profile bench -p lpmm-burn --example memory -- --steps 10 --hidden 1024 --backends ndarray
//! ```

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_core as burn;

use burn::module::{Module, Param};
use burn::tensor::activation::{log_softmax, relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use lpmm_burn::{Lpmm8bitAdamWConfig, LpmmLinear, LpmmOptimizer, LpmmOptimizerConfig};
use lpmm_optim::Storage;
use rand_core::{Rng as _, SeedableRng};
use rand_xoshiro::SplitMix64;

const BATCH: usize = 256;

#[path = "common/digits.rs"]
mod digits;
pub use digits::{digits, status_kib};

/// 64 -> h -> h -> 10.
#[derive(Module, Debug)]
pub struct Wide {
    w1: Param<Tensor<2>>,
    b1: Param<Tensor<1>>,
    w2: Param<Tensor<2>>,
    b2: Param<Tensor<1>>,
    w3: Param<Tensor<2>>,
    b3: Param<Tensor<1>>,
}

/// SplitMix64 (`rand_xoshiro`), so every configuration starts from the same weights.
fn uniform(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

fn param<const D: usize>(v: Vec<f32>, shape: [usize; D], device: &Device) -> Param<Tensor<D>> {
    Param::from_tensor(Tensor::from_data(TensorData::new(v, shape), device))
}

impl Wide {
    pub fn new(device: &Device, h: usize) -> Self {
        let mut s = SplitMix64::seed_from_u64(42);
        let k = |fan_in: usize| (1.0 / fan_in as f32).sqrt();
        Wide {
            w1: param(uniform(&mut s, 64 * h, k(64)), [64, h], device),
            b1: param(vec![0.0; h], [h], device),
            w2: param(uniform(&mut s, h * h, k(h)), [h, h], device),
            b2: param(vec![0.0; h], [h], device),
            w3: param(uniform(&mut s, h * 10, k(h)), [h, 10], device),
            b3: param(vec![0.0; 10], [10], device),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = relu(x.matmul(self.w1.val()) + self.b1.val().unsqueeze::<2>());
        let x = relu(x.matmul(self.w2.val()) + self.b2.val().unsqueeze::<2>());
        x.matmul(self.w3.val()) + self.b3.val().unsqueeze::<2>()
    }
}

/// The same network with [`LpmmLinear`] layers: each weight lives only in the optimizer (in its
/// configuration's parameter storage), decoded one layer at a time.
#[derive(Module, Debug)]
pub struct WideLayers {
    l1: LpmmLinear,
    l2: LpmmLinear,
    l3: LpmmLinear,
}

impl WideLayers {
    /// The layers of `optim`, initialised as [`Wide::new`] initialises its weights.
    pub fn new(device: &Device, h: usize, optim: &LpmmOptimizer) -> Result<Self, String> {
        let mut s = SplitMix64::seed_from_u64(42);
        let k = |fan_in: usize| (1.0 / fan_in as f32).sqrt();
        let mut layer = |d_in: usize, d_out: usize| {
            let w = Tensor::from_data(
                TensorData::new(uniform(&mut s, d_in * d_out, k(d_in)), [d_in, d_out]),
                device,
            );
            let b = Tensor::zeros([d_out], device);
            optim.linear(w, Some(b)).map_err(|e| e.to_string())
        };
        Ok(WideLayers {
            l1: layer(64, h)?,
            l2: layer(h, h)?,
            l3: layer(h, 10)?,
        })
    }

    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, String> {
        let e = |e: lpmm_burn::BurnError| e.to_string();
        let x = relu(self.l1.forward(x).map_err(e)?);
        let x = relu(self.l2.forward(x).map_err(e)?);
        self.l3.forward(x).map_err(e)
    }
}

/// Either network.
enum Model {
    Plain(Box<Wide>),
    Layers(Box<WideLayers>),
}

impl Model {
    fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, String> {
        match self {
            Model::Plain(m) => Ok(m.forward(x)),
            Model::Layers(m) => m.forward(x),
        }
    }
}

/// The optimizers compared.
pub const OPTIMIZERS: [&str; 6] = [
    "none",
    "burn-adamw",
    "lpmm-adamw8",
    "lpmm-adamw4",
    "lpmm-adamw8-accumulator",
    "lpmm-sgdm-layers",
];

fn describe(opt: &str) -> &'static str {
    match opt {
        "none" => "no optimizer (forward + backward only)",
        "burn-adamw" => "burn AdamW (f32 states)",
        "lpmm-adamw8" => "lpmm 8-bit AdamW (`Lpmm8bitAdamWConfig`)",
        "lpmm-adamw4" => "lpmm 4-bit AdamW",
        "lpmm-adamw8-accumulator" => "lpmm 8-bit AdamW with an f32 gradient accumulator",
        "lpmm-sgdm-layers" => "lpmm LPMM-SGDM, 8-bit weights in `LpmmLinear` layers",
        _ => "?",
    }
}

enum Optim {
    None,
    Burn(ModuleOptimizer),
    Lpmm(LpmmOptimizer),
}

/// lpmm-wgpu's segment size in MiB (its staging buffer: half of it, at most 64 MiB).
/// `--lpmm-segment-mib 128` gives lpmm-wgpu's defaults (128 MiB segments, 64 MiB of staging).
pub static SEGMENT_MIB: AtomicU64 = AtomicU64::new(16);

/// The device of `backend` (burn's wgpu device is shared with lpmm, once per process).
pub fn device(backend: &str) -> Result<Device, String> {
    static WGPU: OnceLock<Result<Device, String>> = OnceLock::new();
    match backend {
        #[allow(deprecated)] // burn 0.22 deprecates ndarray in favour of flex.
        "ndarray" => Ok(Device::ndarray().autodiff()),
        "flex" => Ok(Device::flex().autodiff()),
        "wgpu" => WGPU
            .get_or_init(|| {
                // lpmm-wgpu's segments sized for this model's state (`--lpmm-segment-mib`).
                let mib = SEGMENT_MIB.load(Ordering::Relaxed);
                let lpmm = lpmm_burn::wgpu::LpmmWgpuOptions::default()
                    .with_segment_bytes(mib << 20)
                    .with_io_bytes((mib << 20).min(128 << 20) / 2);
                lpmm_burn::wgpu::init_with(Device::wgpu_options(), lpmm).map_err(|e| e.to_string())
            })
            .clone()
            .map(Device::autodiff),
        other => Err(format!("unknown backend {other}")),
    }
}

/// One configuration's result.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Run {
    pub backend: String,
    pub optimizer: String,
    pub params: usize,
    pub steps: usize,
    pub first_loss: f32,
    pub last_loss: f32,
    pub val_accuracy: f32,
    /// Bytes lpmm's optimizer holds (0 for burn's).
    pub lpmm_bytes: usize,
    pub peak_kib: u64,
    pub steady_kib: u64,
}

fn loss(model: &Model, x: Tensor<2>, y: Tensor<1, Int>) -> Result<Tensor<1>, String> {
    let logp = log_softmax(model.forward(x)?, 1);
    let picked = logp.gather(1, y.unsqueeze_dim::<2>(1));
    Ok(picked.mean().neg())
}

/// Trains `steps` steps of `opt` on `backend` with hidden width `h` and reports.
pub fn train(backend: &str, opt: &str, steps: usize, h: usize) -> Result<Run, String> {
    let device = device(backend)?;
    let data = digits();
    let params = 64 * h + h + h * h + h + h * 10 + 10;
    let lr = if opt == "lpmm-sgdm-layers" {
        0.05
    } else {
        1e-3
    };
    let mut optim = match opt {
        "none" => Optim::None,
        "burn-adamw" => Optim::Burn(AdamWConfig::new().init()),
        "lpmm-adamw8" => Optim::Lpmm(Lpmm8bitAdamWConfig::new().init_whole_module()),
        "lpmm-adamw4" => {
            let base = Lpmm8bitAdamWConfig::new().lpmm();
            let config = base
                .param
                .with_state1(Storage::FOUR_BIT_SIGNED)
                .with_state2(Storage::FOUR_BIT_UNSIGNED);
            Optim::Lpmm(base.with_param(config).init_whole_module())
        }
        "lpmm-adamw8-accumulator" => {
            let base = Lpmm8bitAdamWConfig::new().lpmm();
            let config = base.param.with_grad(Storage::F32);
            Optim::Lpmm(base.with_param(config).init_whole_module())
        }
        "lpmm-sgdm-layers" => Optim::Lpmm(
            LpmmOptimizerConfig::from(lpmm_optim::presets::lpmm_sgdm(0.0, 0.9)).init_whole_module(),
        ),
        other => return Err(format!("unknown optimizer {other}")),
    };
    let mut model = match &optim {
        Optim::Lpmm(o) if opt == "lpmm-sgdm-layers" => {
            Model::Layers(Box::new(WideLayers::new(&device, h, o)?))
        }
        _ => Model::Plain(Box::new(Wide::new(&device, h))),
    };
    let n = data.train_y.len();
    let (mut first_loss, mut last_loss) = (f32::NAN, f32::NAN);
    for step in 0..steps {
        let idx: Vec<usize> = (0..BATCH).map(|i| (step * BATCH + i * 7) % n).collect();
        let x: Vec<f32> = idx
            .iter()
            .flat_map(|&i| data.train_x[64 * i..64 * i + 64].iter().copied())
            .collect();
        let y: Vec<i64> = idx.iter().map(|&i| data.train_y[i]).collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [BATCH, 64]), &device);
        let y = Tensor::<1, Int>::from_data(TensorData::new(y, [BATCH]), &device);
        let l = loss(&model, x, y)?;
        let value = l
            .clone()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| format!("{e:?}"))?[0];
        if step == 0 {
            first_loss = value;
        }
        last_loss = value;
        let grads = l.backward();
        model = match (&mut optim, model) {
            (Optim::None, m) => {
                drop(grads);
                m
            }
            (Optim::Burn(o), Model::Plain(m)) => {
                let grads = GradientsParams::from_grads(grads, m.as_ref());
                Model::Plain(Box::new(o.step(lr, *m, grads)))
            }
            (Optim::Lpmm(o), Model::Plain(m)) => {
                let grads = GradientsParams::from_grads(grads, m.as_ref());
                Model::Plain(Box::new(o.step(lr, *m, grads).map_err(|e| e.to_string())?))
            }
            (Optim::Lpmm(o), Model::Layers(m)) => {
                let grads = GradientsParams::from_grads(grads, m.as_ref());
                Model::Layers(Box::new(o.step(lr, *m, grads).map_err(|e| e.to_string())?))
            }
            (Optim::Burn(_), Model::Layers(_)) => {
                return Err("burn's optimizer on lpmm layers".into());
            }
        };
    }
    device.sync().map_err(|e| format!("{e:?}"))?;
    let steady_kib = status_kib("VmRSS:");
    // Validation accuracy.
    let nv = data.val_y.len();
    let x = Tensor::<2>::from_data(TensorData::new(data.val_x.clone(), [nv, 64]), &device);
    let pred = model.forward(x)?.argmax(1).into_data().convert::<i64>();
    let pred = pred.try_to_vec::<i64>().map_err(|e| format!("{e:?}"))?;
    let correct = pred.iter().zip(&data.val_y).filter(|(a, b)| a == b).count();
    let lpmm_bytes = match &optim {
        Optim::Lpmm(o) => o.memory_report().total(),
        _ => 0,
    };
    Ok(Run {
        backend: backend.into(),
        optimizer: opt.into(),
        params,
        steps,
        first_loss,
        last_loss,
        val_accuracy: correct as f32 / nv as f32,
        lpmm_bytes,
        peak_kib: status_kib("VmHWM:"),
        steady_kib,
    })
}

#[allow(dead_code)]
/// Peak and steady process memory of one training process per optimizer and backend.
#[derive(Debug, clap::Parser)]
struct Args {
    /// Training steps per process.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// lpmm-wgpu's segment size, MiB.
    #[arg(long)]
    lpmm_segment_mib: Option<u64>,
    /// Width of the model's hidden layers.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// Child mode: train `backend/optimizer` in this process and print its JSON.
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Backends, comma-separated.
    #[arg(long, default_value = "ndarray,wgpu")]
    backends: String,
    /// Runs of every configuration (round robin, a fresh process each).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
}

#[allow(dead_code)]
fn main() {
    let args = <Args as clap::Parser>::parse();
    let steps = args.steps;
    if let Some(mib) = args.lpmm_segment_mib {
        SEGMENT_MIB.store(mib, Ordering::Relaxed);
    }
    let segment_mib = SEGMENT_MIB.load(Ordering::Relaxed).to_string();
    let h = args.hidden;
    if let Some(spec) = &args.child {
        let (backend, opt) = spec.split_once('/').expect("--child backend/optimizer");
        match train(backend, opt, steps, h) {
            Ok(run) => println!("{}", serde_json::to_string(&run).expect("json")),
            Err(e) => {
                eprintln!("{backend}/{opt}: {e}");
                std::process::exit(2);
            }
        }
        return;
    }
    let (backends, repeat) = (args.backends, args.repeat);
    let exe = std::env::current_exe().expect("the example's path");
    // Every configuration `repeat` times, round robin (one fresh process each).
    let mut runs: Vec<Vec<Run>> = Vec::new();
    for backend in backends.split(',') {
        let mut rows: Vec<Vec<Run>> = vec![Vec::new(); OPTIMIZERS.len()];
        for _ in 0..repeat {
            for (row, opt) in rows.iter_mut().zip(OPTIMIZERS) {
                let out = std::process::Command::new(&exe)
                    .args(["--child", &format!("{backend}/{opt}")])
                    .args(["--steps", &steps.to_string(), "--hidden", &h.to_string()])
                    .args(["--lpmm-segment-mib", &segment_mib])
                    .output()
                    .expect("the child process runs");
                if !out.status.success() {
                    eprintln!(
                        "{backend}/{opt} failed: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    continue;
                }
                let line = String::from_utf8_lossy(&out.stdout);
                let run: Run = serde_json::from_str(line.lines().last().unwrap_or_default())
                    .expect("the child's report");
                eprintln!("{backend}/{opt}: done");
                row.push(run);
            }
        }
        runs.extend(rows.into_iter().filter(|r| !r.is_empty()));
    }
    let params = runs.first().and_then(|r| r.first()).map_or(0, |r| r.params);
    println!(
        "burn digits MLP 64-{h}-{h}-10 ({params} parameters, {:.1} MiB in f32), batch {BATCH}, {steps} steps, lr 1e-3; one process per run, {repeat} run(s) per row: median (min-max); lpmm-wgpu segments of {segment_mib} MiB",
        params as f64 * 4.0 / (1 << 20) as f64
    );
    println!();
    println!(
        "| backend | optimizer | peak RSS (MiB) | steady RSS (MiB) | lpmm state (MiB) | loss first -> last | val acc |"
    );
    println!("|---|---|---:|---:|---:|---|---:|");
    let mib = |kib: u64| kib as f64 / 1024.0;
    let stat = |mut v: Vec<u64>| {
        v.sort_unstable();
        let (lo, hi, mid) = (v[0], v[v.len() - 1], v[v.len() / 2]);
        if lo == hi {
            format!("{:.1}", mib(mid))
        } else {
            format!("{:.1} ({:.1}-{:.1})", mib(mid), mib(lo), mib(hi))
        }
    };
    for row in &runs {
        let r = &row[0];
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.3} -> {:.3} | {:.1}% |",
            r.backend,
            describe(&r.optimizer),
            stat(row.iter().map(|r| r.peak_kib).collect()),
            stat(row.iter().map(|r| r.steady_kib).collect()),
            r.lpmm_bytes as f64 / (1 << 20) as f64,
            r.first_loss,
            r.last_loss,
            100.0 * r.val_accuracy
        );
    }
}
