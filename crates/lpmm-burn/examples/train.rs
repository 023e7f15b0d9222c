//! burn-train on the handwritten digits, as burn's book trains: a `Learner` with burn-nn layers
//! (64 -> H -> H -> 10, ReLU, cross-entropy), `SupervisedTraining` with its accuracy and loss
//! metrics and its checkpointer, once with burn's `AdamWConfig` and once with lpmm's
//! `Lpmm8bitAdamWConfig` -- the optimizer line is the only difference -- on burn-flex and on
//! burn's wgpu device (Mesa's lavapipe where there is no GPU). Each arm runs in a process of its
//! own, the two arms interleaved, and reports validation accuracy and loss, its peak (`VmHWM`) and
//! steady (`VmRSS` after training) resident memory, the optimizer state its checkpoint holds,
//! device memory on wgpu (cubecl's pool and lpmm-wgpu's buffers) and its time per training step.
//!
//! ```sh
//! cargo run --profile bench -p lpmm-burn --example train                  # flex and wgpu, 3 runs per arm
//! cargo run --profile bench -p lpmm-burn --example train -- --backends flex --repeat 5
//! ```

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn_core as burn;

use burn::data::dataloader::{DataLoader, DataLoaderBuilder, batcher::Batcher};
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ParamGroup};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_nn::loss::CrossEntropyLossConfig;
use burn_nn::{Linear, LinearConfig, Relu};
use burn_optim::lr_scheduler::constant::ConstantLr;
use burn_optim::{AdamWConfig, ModuleOptimizer};
use burn_train::checkpoint::KeepLastNCheckpoints;
use burn_train::logger::InMemoryMetricLogger;
use burn_train::metric::{AccuracyMetric, LossMetric};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, LearningResult, SupervisedTraining, TrainOutput,
    TrainStep,
};

#[path = "common/digits.rs"]
mod digits;
#[path = "common/quiet.rs"]
pub mod quiet;
pub use digits::{Digits, digits, status_kib};

/// One digit: its 64 pixels and its label.
#[derive(Debug, Clone)]
pub struct Digit {
    pub pixels: Vec<f32>,
    pub label: i64,
}

/// A batch of digits on the device.
#[derive(Debug, Clone)]
pub struct DigitBatch {
    pub images: Tensor<2>,
    pub targets: Tensor<1, Int>,
}

/// Makes [`DigitBatch`]es.
#[derive(Debug, Clone, Default)]
pub struct DigitBatcher;

impl Batcher<Digit, DigitBatch> for DigitBatcher {
    fn batch(&self, items: Vec<Digit>, device: &Device) -> DigitBatch {
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|d| d.pixels.iter().copied())
            .collect();
        let labels: Vec<i64> = items.iter().map(|d| d.label).collect();
        DigitBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, 64]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// The training and validation digits as burn datasets' items.
pub fn items(d: &Digits) -> (Vec<Digit>, Vec<Digit>) {
    let split = |x: &[f32], y: &[i64]| {
        x.chunks(64)
            .zip(y)
            .map(|(p, &label)| Digit {
                pixels: p.to_vec(),
                label,
            })
            .collect::<Vec<_>>()
    };
    (split(&d.train_x, &d.train_y), split(&d.val_x, &d.val_y))
}

/// 64 -> h -> h -> 10, ReLU.
#[derive(Module, Debug)]
pub struct Classifier {
    l1: Linear,
    l2: Linear,
    l3: Linear,
    relu: Relu,
}

/// When each training step began (the time per step is the difference to the next).
pub static STEP_STARTS: Mutex<Vec<Instant>> = Mutex::new(Vec::new());

/// The process's minor page faults when each training step began.
pub static STEP_FAULTS: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// Minor page faults of this process so far (`/proc/self/stat`'s tenth field; 0 where there is
/// none): what a fresh allocation's first writes cost, where the allocator gave memory back to the
/// system since the last step.
pub fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let fields = &s[s.rfind(')')? + 1..];
            fields.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

impl Classifier {
    /// burn-nn's default initialisation, from the device's seeded generator.
    pub fn new(device: &Device, hidden: usize) -> Self {
        Classifier {
            l1: LinearConfig::new(64, hidden).init(device),
            l2: LinearConfig::new(hidden, hidden).init(device),
            l3: LinearConfig::new(hidden, 10).init(device),
            relu: Relu::new(),
        }
    }

    pub fn forward(&self, images: Tensor<2>) -> Tensor<2> {
        let x = self.relu.forward(self.l1.forward(images));
        let x = self.relu.forward(self.l2.forward(x));
        self.l3.forward(x)
    }

    pub fn forward_classification(&self, batch: DigitBatch) -> ClassificationOutput {
        let output = self.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, output, batch.targets)
    }
}

impl TrainStep for Classifier {
    type Input = DigitBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: DigitBatch) -> TrainOutput<ClassificationOutput> {
        // The previous step's work done (a device queues it): the time between two starts is
        // one whole step, forward, backward and optimizer, on every backend alike.
        let _ = batch.images.device().sync();
        STEP_STARTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Instant::now());
        STEP_FAULTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(minor_faults());
        let item = self.forward_classification(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Classifier {
    type Input = DigitBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: DigitBatch) -> ClassificationOutput {
        self.forward_classification(batch)
    }
}

/// How a run trains.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Settings {
    pub hidden: usize,
    pub epochs: usize,
    pub batch: usize,
    pub lr: f64,
    pub seed: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            hidden: 512,
            epochs: 5,
            batch: 64,
            lr: 1e-3,
            seed: 42,
        }
    }
}

/// The two arms the table compares: burn's AdamW and lpmm's 8-bit AdamW.
pub const ARMS: [&str; 2] = ["burn-adamw", "lpmm-adamw8"];

/// [`ARMS`] and `lpmm-muon8`: the hidden layer's weight (`l2`) with lpmm's 8-bit Muon, the rest
/// with lpmm's 8-bit AdamW (burn's parameter groups route; Muon on the CPU only).
pub const ALL_ARMS: [&str; 3] = ["burn-adamw", "lpmm-adamw8", "lpmm-muon8"];

/// The arm's optimizer, with handles on lpmm's optimizers (none for burn's). The optimizer line
/// a burn user changes is the one in each arm.
pub fn optimizer(
    arm: &str,
) -> Result<(ModuleOptimizer, Vec<lpmm_burn::LpmmTensorOptimizer>), String> {
    let adamw8 = || {
        // `Lpmm8bitAdamWConfig::new().init()?` gives the same `ModuleOptimizer`; `build` keeps a
        // handle on its counters.
        lpmm_burn::Lpmm8bitAdamWConfig::new()
            .build()
            .map_err(|e| e.to_string())
    };
    match arm {
        "burn-adamw" => Ok((AdamWConfig::new().init(), Vec::new())),
        "lpmm-adamw8" => {
            let lpmm = adamw8()?;
            Ok((ModuleOptimizer::from(lpmm.clone()), vec![lpmm]))
        }
        "lpmm-muon8" => {
            // Moonshot's shape adjustment: Muon's update has AdamW's RMS, so burn's one learning
            // rate serves both groups; the weight decay and the gradients (read where burn wrote
            // them, no accumulator) as `Lpmm8bitAdamWConfig`'s.
            let muon = lpmm_burn::LpmmOptimizerConfig::from(
                lpmm_optim::presets::muon_8bit(0.0)
                    .adjust_lr(lpmm_optim::AdjustLr::MatchRmsAdamW)
                    .weight_decay(1e-4)
                    .with_grad(lpmm_optim::Storage::None),
            )
            .build()
            .map_err(|e| e.to_string())?;
            let adamw = adamw8()?;
            let hidden = ParamGroup::from_path("l2.weight");
            let optim = ModuleOptimizer::from(adamw.clone()).with_group(hidden, muon.clone(), None);
            Ok((optim, vec![adamw, muon]))
        }
        other => Err(format!(
            "unknown arm {other}; arms: {}",
            ALL_ARMS.join(", ")
        )),
    }
}

/// burn-train's data loaders (no shuffling: every run, resumed or not, sees the same order).
pub fn loaders(
    settings: &Settings,
) -> (
    Arc<dyn DataLoader<DigitBatch>>,
    Arc<dyn DataLoader<DigitBatch>>,
) {
    let (train, valid) = items(&digits());
    (
        DataLoaderBuilder::new(DigitBatcher)
            .batch_size(settings.batch)
            .build(InMemDataset::new(train)),
        DataLoaderBuilder::new(DigitBatcher)
            .batch_size(settings.batch)
            .build(InMemDataset::new(valid)),
    )
}

/// Trains `model` with `optim` for `settings.epochs` epochs (from checkpoint `resume`, if given)
/// with burn-train, checkpoints every epoch in `dir`.
pub fn fit(
    model: Classifier,
    optim: ModuleOptimizer,
    settings: &Settings,
    dir: &Path,
    resume: Option<usize>,
) -> LearningResult<Classifier> {
    let (train, valid) = loaders(settings);
    let mut training = SupervisedTraining::new(dir, train, valid)
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .with_default_checkpointers()
        .with_checkpointing_strategy(KeepLastNCheckpoints::new(settings.epochs))
        .with_metric_logger(InMemoryMetricLogger::new())
        .with_application_logger(None)
        .renderer(Box::new(quiet::Quiet))
        .num_epochs(settings.epochs);
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    training.launch(Learner::new(model, optim, ConstantLr::new(settings.lr)))
}

/// Validation accuracy and mean cross-entropy of `model`.
pub fn evaluate(model: &Classifier, device: &Device) -> Result<(f64, f64), String> {
    let (_, valid) = items(&digits());
    let batch = DigitBatcher.batch(valid, device);
    let n = batch.targets.dims()[0];
    let out = model.forward_classification(batch);
    let loss: Vec<f32> = out
        .loss
        .into_data()
        .convert::<f32>()
        .try_to_vec()
        .map_err(|e| format!("{e:?}"))?;
    let pred: Vec<i64> = out
        .output
        .argmax(1)
        .into_data()
        .convert::<i64>()
        .try_to_vec()
        .map_err(|e| format!("{e:?}"))?;
    let truth: Vec<i64> = out
        .targets
        .into_data()
        .convert::<i64>()
        .try_to_vec()
        .map_err(|e| format!("{e:?}"))?;
    let correct = pred.iter().zip(&truth).filter(|(a, b)| a == b).count();
    Ok((correct as f64 / n as f64, f64::from(loss[0])))
}

/// Bytes of the tensors of a burnpack file (an optimizer checkpoint: its state).
pub fn record_tensor_bytes(path: &Path) -> Result<u64, String> {
    let reader = burn_pack::Reader::from_file(path).map_err(|e| e.to_string())?;
    let mut total = 0u64;
    for t in reader.into_tensors().map_err(|e| e.to_string())? {
        let (_, _, _, _, bytes) = t.into_parts().map_err(|e| e.to_string())?;
        total += bytes.len() as u64;
    }
    Ok(total)
}

/// The device of `backend` (burn's wgpu device is shared with lpmm, once per process).
pub fn device(backend: &str) -> Result<Device, String> {
    static WGPU: std::sync::OnceLock<Result<Device, String>> = std::sync::OnceLock::new();
    match backend {
        "flex" => Ok(Device::flex().autodiff()),
        "wgpu" => WGPU
            .get_or_init(|| {
                // lpmm-wgpu's segments sized near this model's state.
                let lpmm = lpmm_burn::wgpu::LpmmWgpuOptions::default()
                    .with_segment_bytes(8 << 20)
                    .with_io_bytes(4 << 20);
                lpmm_burn::wgpu::init_with(Device::wgpu_options(), lpmm).map_err(|e| e.to_string())
            })
            .clone()
            .map(Device::autodiff),
        other => Err(format!("unknown backend {other}")),
    }
}

/// One arm's result.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Run {
    pub backend: String,
    pub arm: String,
    pub params: usize,
    pub steps: usize,
    pub val_accuracy: f64,
    pub val_loss: f64,
    /// Median time between the starts of two training steps, ms.
    pub ms_per_step: f64,
    /// Median minor page faults between the starts of two training steps.
    pub faults_per_step: f64,
    pub peak_kib: u64,
    pub steady_kib: u64,
    /// Bytes of tensors in the last optimizer checkpoint (the optimizer state).
    pub state_bytes: u64,
    /// Device memory at the end of training (wgpu): cubecl's pool reserved and in use, lpmm-wgpu's
    /// buffers.
    pub device: Option<lpmm_burn::wgpu::DeviceMemory>,
    /// Failed lpmm steps (0 expected).
    pub lpmm_errors: u64,
}

/// The median of `gap` between consecutive values (NaN for fewer than two).
fn median_gap<T: Copy>(values: &[T], gap: impl Fn(T, T) -> f64) -> f64 {
    let mut gaps: Vec<f64> = values.windows(2).map(|w| gap(w[0], w[1])).collect();
    gaps.sort_by(f64::total_cmp);
    gaps.get(gaps.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Trains one arm on `device` (burn's `backend`) in this process and reports.
pub fn run(
    device: &Device,
    backend: &str,
    arm: &str,
    settings: &Settings,
    dir: &Path,
) -> Result<Run, String> {
    device.seed(settings.seed);
    let model = Classifier::new(device, settings.hidden);
    let params = model.num_params();
    let (optim, handles) = optimizer(arm)?;
    STEP_STARTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
    STEP_FAULTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
    let result = fit(model, optim, settings, dir, None);
    if let Some(e) = &result.error {
        return Err(format!("training failed: {e}"));
    }
    let _ = device.sync();
    let steady_kib = status_kib("VmRSS:");
    let (val_accuracy, val_loss) = evaluate(&result.model, device)?;
    let starts = STEP_STARTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let ms_per_step = median_gap(&starts, |a, b| (b - a).as_secs_f64() * 1e3);
    let faults = STEP_FAULTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let faults_per_step = median_gap(&faults, |a, b| b.saturating_sub(a) as f64);
    for h in &handles {
        eprintln!("lpmm: {:?}", h.stats());
    }
    let state_bytes = record_tensor_bytes(
        &dir.join("checkpoint")
            .join(format!("optim-{}.bpk", settings.epochs)),
    )?;
    Ok(Run {
        backend: backend.into(),
        arm: arm.into(),
        params,
        steps: starts.len(),
        val_accuracy,
        val_loss,
        ms_per_step,
        faults_per_step,
        peak_kib: status_kib("VmHWM:"),
        steady_kib,
        state_bytes,
        device: lpmm_burn::wgpu::memory(device),
        lpmm_errors: handles.iter().map(|h| h.stats().error_count).sum(),
    })
}

#[allow(dead_code)]
/// burn-train with burn's AdamW and with lpmm's 8-bit AdamW, one process per run.
#[derive(Debug, clap::Parser)]
struct Args {
    /// Epochs per run.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Width of the hidden layers.
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Backends, comma-separated.
    #[arg(long, default_value = "flex,wgpu")]
    backends: String,
    /// Arms, comma-separated (`burn-adamw`, `lpmm-adamw8`, `lpmm-muon8`; the last on flex only).
    #[arg(long, default_value = "burn-adamw,lpmm-adamw8")]
    arms: String,
    /// Runs of each arm (the arms alternate, a fresh process each).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Child mode: train `backend/arm` in this process and print its JSON.
    #[arg(long, hide = true)]
    child: Option<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[allow(dead_code)]
fn main() {
    let args = <Args as clap::Parser>::parse();
    let settings = Settings {
        hidden: args.hidden,
        epochs: args.epochs,
        ..Settings::default()
    };
    if let Some(spec) = &args.child {
        let (backend, arm) = spec.split_once('/').expect("--child backend/arm");
        let dir = std::env::temp_dir().join(format!("lpmm-burn-train-{}", std::process::id()));
        let result = device(backend).and_then(|d| run(&d, backend, arm, &settings, &dir));
        let _ = std::fs::remove_dir_all(&dir);
        match result {
            Ok(run) => println!("{}", serde_json::to_string(&run).expect("json")),
            Err(e) => {
                eprintln!("{backend}/{arm}: {e}");
                std::process::exit(2);
            }
        }
        return;
    }
    let exe = std::env::current_exe().expect("the example's path");
    let mut rows: Vec<Vec<Run>> = Vec::new();
    for backend in args.backends.split(',') {
        let arms: Vec<&str> = args.arms.split(',').collect();
        let mut runs: Vec<Vec<Run>> = vec![Vec::new(); arms.len()];
        for _ in 0..args.repeat {
            for (row, &arm) in runs.iter_mut().zip(&arms) {
                let out = std::process::Command::new(&exe)
                    .args(["--child", &format!("{backend}/{arm}")])
                    .args(["--epochs", &args.epochs.to_string()])
                    .args(["--hidden", &args.hidden.to_string()])
                    .output()
                    .expect("the child process runs");
                if !out.status.success() {
                    eprintln!(
                        "{backend}/{arm} failed: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    continue;
                }
                let line = String::from_utf8_lossy(&out.stdout);
                let run: Run = serde_json::from_str(line.lines().last().unwrap_or_default())
                    .expect("the child's report");
                eprintln!(
                    "{backend}/{arm}: {:.1}% {:.2} ms/step",
                    100.0 * run.val_accuracy,
                    run.ms_per_step
                );
                row.push(run);
            }
        }
        rows.extend(runs.into_iter().filter(|r| !r.is_empty()));
    }
    let first = rows.first().and_then(|r| r.first());
    let (params, steps) = first.map_or((0, 0), |r| (r.params, r.steps));
    println!(
        "burn-train, digits MLP 64-{h}-{h}-10 ({params} parameters), batch {b}, {e} epochs ({steps} steps), lr {lr}, constant; {n} run(s) per arm, arms alternating, one process each: median (min-max)",
        h = settings.hidden,
        b = settings.batch,
        e = settings.epochs,
        lr = settings.lr,
        n = args.repeat,
    );
    println!();
    println!(
        "| backend | optimizer | val acc | val loss | optimizer state (KiB) | peak RSS (MiB) | steady RSS (MiB) | device: cubecl pool / lpmm-wgpu (MiB) | ms/step | page faults/step |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let span = |v: Vec<f64>, digits: usize| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mid = median(v);
        if (hi - lo).abs() < f64::EPSILON {
            format!("{mid:.digits$}")
        } else {
            format!("{mid:.digits$} ({lo:.digits$}-{hi:.digits$})")
        }
    };
    let mib = |kib: u64| kib as f64 / 1024.0;
    for row in &rows {
        let r = &row[0];
        let device = match &r.device {
            Some(_) => {
                let pool = span(
                    row.iter()
                        .filter_map(|r| r.device.as_ref())
                        .map(|d| d.burn_reserved as f64 / (1 << 20) as f64)
                        .collect(),
                    1,
                );
                let lpmm = span(
                    row.iter()
                        .filter_map(|r| r.device.as_ref())
                        .map(|d| d.lpmm_reserved as f64 / (1 << 20) as f64)
                        .collect(),
                    1,
                );
                format!("{pool} / {lpmm}")
            }
            None => "-".into(),
        };
        println!(
            "| {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} |",
            r.backend,
            match r.arm.as_str() {
                "burn-adamw" => "burn `AdamWConfig`",
                "lpmm-muon8" => "lpmm 8-bit Muon (`l2`) + `Lpmm8bitAdamWConfig`",
                _ => "lpmm `Lpmm8bitAdamWConfig`",
            },
            span(row.iter().map(|r| 100.0 * r.val_accuracy).collect(), 1) + "%",
            span(row.iter().map(|r| r.val_loss).collect(), 3),
            r.state_bytes as f64 / 1024.0,
            span(row.iter().map(|r| mib(r.peak_kib)).collect(), 1),
            span(row.iter().map(|r| mib(r.steady_kib)).collect(), 1),
            device,
            span(row.iter().map(|r| r.ms_per_step).collect(), 2),
            span(row.iter().map(|r| r.faults_per_step).collect(), 0),
        );
    }
}
