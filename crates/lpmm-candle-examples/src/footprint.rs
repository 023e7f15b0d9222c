//! The memory a training process holds, measured: one process trains a wide MLP for a few steps
//! with one optimizer (an *arm*: candle-nn's own, or lpmm with a preset) and reports its peak and
//! steady resident memory beside what the optimizers account for. Run each arm in a process of
//! its own (`examples/compare.rs --memory-probe ARM`): a process's peak never comes down.
//!
//! The model is a stack of square linear layers with ReLU between, trained on a fixed regression
//! batch; it is wide and the batch is small so that model memory dominates the process (the
//! activations of a step are `batch x width` per layer).

use std::time::Instant;

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{Linear, Optimizer as _, VarMap};
use lpmm_optim::presets;
use serde::{Deserialize, Serialize};

use lpmm_candle::nn::QLinear;
use lpmm_candle::{LpmmConfig, LpmmOptimizer};

use crate::experiments::Rng;

/// The probe's model and run.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ProbeShape {
    /// Width of every layer.
    pub width: usize,
    /// Number of `width x width` layers.
    pub depth: usize,
    /// Rows of the batch.
    pub batch: usize,
    /// Steps before the steady memory is read.
    pub steps: usize,
}

impl ProbeShape {
    /// The README's main command: 32 layers of 1024 (33.6M parameters; f32 AdamW's model memory
    /// is 16 bytes a parameter, 513 MiB), a batch of 32, 5 steps.
    pub fn default_run() -> Self {
        ProbeShape {
            width: 1024,
            depth: 32,
            batch: 32,
            steps: 5,
        }
    }

    /// The smoke run: 4 layers of 512.
    pub fn quick() -> Self {
        ProbeShape {
            width: 512,
            depth: 4,
            batch: 16,
            steps: 3,
        }
    }

    /// Parameters of the model (weights and biases).
    pub fn params(&self) -> usize {
        self.depth * (self.width * self.width + self.width)
    }
}

/// One optimizer setup the probe measures.
#[derive(Debug, Clone, Copy)]
pub struct Arm {
    /// Its name in the report.
    pub name: &'static str,
    /// The arm its peak is compared with.
    pub reference: &'static str,
    /// The goal of issue 16 for this arm: at most this fraction of the reference's peak.
    pub goal: Option<f64>,
    /// What trains.
    pub kind: ArmKind,
}

/// What an [`Arm`] trains with.
#[derive(Debug, Clone, Copy)]
pub enum ArmKind {
    /// No model at all: the process's floor (code, candle's and lpmm's thread pools, the
    /// allocator's arenas, the batch), which every arm also holds.
    Floor,
    /// Nothing: the model and its forward and backward passes without any optimizer, the Vars
    /// in f32 (what the process holds before optimizer memory).
    NoOptimizer,
    /// `candle_nn::AdamW` (f32 Vars, f32 moments).
    CandleAdamW,
    /// `candle_nn::SGD` (f32 Vars; candle-nn's SGD has no momentum).
    CandleSgd,
    /// An lpmm preset over candle `Var`s created in the storage's dtype
    /// ([`LpmmConfig::var_dtype`]): each `Var` is lpmm's parameter.
    Lpmm(fn(f64) -> lpmm_optim::ParamConfig, f64),
    /// An lpmm preset over parameters lpmm holds itself, in lpmm layers ([`QLinear`]).
    LpmmLayers(fn(f64) -> lpmm_optim::ParamConfig, f64),
}

/// The arms, references first.
pub fn arms() -> Vec<Arm> {
    let arm = |name, reference, goal, kind| Arm {
        name,
        reference,
        goal,
        kind,
    };
    vec![
        arm(
            "candle-nn AdamW",
            "candle-nn AdamW",
            None,
            ArmKind::CandleAdamW,
        ),
        arm(
            "candle-nn SGD (no momentum)",
            "candle-nn AdamW",
            None,
            ArmKind::CandleSgd,
        ),
        arm(
            "lpmm f32 SGDM",
            "lpmm f32 SGDM",
            None,
            ArmKind::Lpmm(|lr| presets::sgdm_f32(lr, 0.9).build(), 1e-2),
        ),
        arm(
            "lpmm f32 AdamW",
            "candle-nn AdamW",
            None,
            ArmKind::Lpmm(|lr| presets::adamw_f32(lr).build(), 1e-3),
        ),
        arm(
            "lpmm 8-bit AdamW, f32 params",
            "candle-nn AdamW",
            None,
            ArmKind::Lpmm(|lr| presets::adamw_8bit(lr).build(), 1e-3),
        ),
        arm(
            "lpmm 8-bit AdamW, bf16 SR",
            "candle-nn AdamW",
            Some(0.45),
            ArmKind::Lpmm(|lr| presets::adamw_8bit_bf16_sr(lr).build(), 1e-3),
        ),
        arm(
            "lpmm 4-bit AdamW, split f32",
            "candle-nn AdamW",
            None,
            ArmKind::Lpmm(|lr| presets::adamw_4bit_split(lr).build(), 1e-3),
        ),
        arm(
            "lpmm 4-bit AdamW, bf16 SR, released",
            "candle-nn AdamW",
            None,
            ArmKind::Lpmm(|lr| presets::adamw_4bit_bf16_sr_released(lr).build(), 1e-3),
        ),
        arm(
            "lpmm 4-bit AdamW, bf16 SR, released (lpmm layers)",
            "candle-nn AdamW",
            None,
            ArmKind::LpmmLayers(|lr| presets::adamw_4bit_bf16_sr_released(lr).build(), 1e-3),
        ),
        arm(
            "LPMM-SGDM (lpmm layers)",
            "lpmm f32 SGDM",
            Some(0.30),
            ArmKind::LpmmLayers(|lr| presets::lpmm_sgdm(lr, 0.9).build(), 1e-2),
        ),
        arm(
            "Adafactor LPMM (lpmm layers)",
            "candle-nn AdamW",
            None,
            ArmKind::LpmmLayers(|lr| presets::adafactor_lpmm().lr(lr).build(), 1e-3),
        ),
        arm(
            "CAME LPMM (lpmm layers)",
            "candle-nn AdamW",
            None,
            ArmKind::LpmmLayers(|lr| presets::came_lpmm(lr).build(), 1e-4),
        ),
        arm(
            "lpmm 8-bit AdEMAMix, f32 params",
            "candle-nn AdamW",
            None,
            ArmKind::Lpmm(|lr| presets::ademamix_8bit(lr).build(), 1e-3),
        ),
        arm(
            "lpmm 8-bit schedule-free AdamW, f32 params",
            "candle-nn AdamW",
            None,
            ArmKind::Lpmm(|lr| presets::schedule_free_adamw_8bit(lr).build(), 1e-3),
        ),
        arm(
            "process floor (no model)",
            "candle-nn AdamW",
            None,
            ArmKind::Floor,
        ),
        arm(
            "no optimizer (forward + backward only)",
            "candle-nn AdamW",
            None,
            ArmKind::NoOptimizer,
        ),
    ]
}

/// What one probe process measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Probe {
    /// The arm.
    pub arm: String,
    /// The model and run.
    pub shape: ProbeShape,
    /// Parameters trained.
    pub params: usize,
    /// Bytes of the candle `Var`s (in their dtype), lent to lpmm or not.
    pub candle_var_bytes: usize,
    /// Bytes of model memory lpmm accounts for (a lent parameter is counted in
    /// `candle_var_bytes`, not here). For candle's optimizers: the moments they keep.
    pub optimizer_bytes: usize,
    /// The process's peak resident memory (`VmHWM`), bytes.
    pub peak_rss: u64,
    /// Its resident memory after the last step (`VmRSS`), bytes.
    pub steady_rss: u64,
    /// Its resident memory once the allocator has returned the memory it keeps freed
    /// (`malloc_trim`, glibc; the steady figure elsewhere): what is live.
    pub live_rss: u64,
    /// Loss before the first and after the last step.
    pub first_loss: f64,
    /// Loss after the last step.
    pub last_loss: f64,
    /// Seconds per step (the last steps' mean).
    pub seconds_per_step: f64,
}

/// A `/proc/self/status` field in bytes (Linux; `None` elsewhere).
pub fn proc_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line[field.len()..]
        .trim_start_matches(':')
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Asks glibc to return freed memory to the system, so `VmRSS` shows what is live.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_freed_memory() {
    unsafe extern "C" {
        fn malloc_trim(pad: usize) -> i32;
    }
    // SAFETY: malloc_trim takes no pointers and may be called at any time from any thread; it
    // only releases memory the allocator holds free. (Exercised by the probe's test.)
    unsafe {
        malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_freed_memory() {}

/// Uniform initial values in ±1/sqrt(fan_in) (candle-nn's linear default), from a fixed seed.
fn init(rng: &mut Rng, n: usize, fan_in: usize) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    (0..n)
        .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
        .collect()
}

/// The model: candle layers over `Var`s, or lpmm layers.
enum Model {
    Vars(Vec<Linear>),
    Held(Vec<QLinear>),
}

impl Model {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = match self {
            Model::Vars(l) => l.len(),
            Model::Held(l) => l.len(),
        };
        let mut h = x.clone();
        for k in 0..n {
            h = match self {
                Model::Vars(l) => l[k].forward(&h)?,
                Model::Held(l) => l[k].forward(&h)?,
            };
            if k + 1 < n {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Builds the model's `Var`s in `dtype`, registered in a `VarMap` by path.
fn var_model(shape: &ProbeShape, dtype: DType, varmap: &VarMap) -> Result<Model> {
    let mut rng = Rng::new(0);
    let w = shape.width;
    let mut layers = Vec::new();
    for k in 0..shape.depth {
        let weight =
            Tensor::from_vec(init(&mut rng, w * w, w), (w, w), &Device::Cpu)?.to_dtype(dtype)?;
        let bias = Tensor::from_vec(init(&mut rng, w, w), w, &Device::Cpu)?.to_dtype(dtype)?;
        let (weight, bias) = (Var::from_tensor(&weight)?, Var::from_tensor(&bias)?);
        layers.push(Linear::new(
            weight.as_tensor().clone(),
            Some(bias.as_tensor().clone()),
        ));
        let mut data = varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        data.insert(format!("l{k:02}.weight"), weight);
        data.insert(format!("l{k:02}.bias"), bias);
    }
    Ok(Model::Vars(layers))
}

/// The optimizer of an arm.
enum Opt {
    None,
    CandleAdamW(candle_nn::AdamW),
    CandleSgd(candle_nn::SGD),
    Lpmm(LpmmOptimizer),
}

impl Opt {
    fn step(&mut self, loss: &Tensor) -> Result<()> {
        match self {
            Opt::None => loss.backward().map(drop),
            Opt::CandleAdamW(o) => o.backward_step(loss),
            Opt::CandleSgd(o) => o.backward_step(loss),
            Opt::Lpmm(o) => o.backward_step(loss),
        }
    }
}

/// Trains `arm` in this process and measures it. Call it in a fresh process, first thing: the
/// peak it reports is the process's.
pub fn probe(arm: &Arm, shape: &ProbeShape) -> Result<Probe> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let (model, mut opt, var_dtype) = match arm.kind {
        ArmKind::Floor => (Model::Vars(Vec::new()), Opt::None, DType::F32),
        ArmKind::NoOptimizer => (
            var_model(shape, DType::F32, &varmap)?,
            Opt::None,
            DType::F32,
        ),
        ArmKind::CandleAdamW => {
            let model = var_model(shape, DType::F32, &varmap)?;
            let params = candle_nn::ParamsAdamW {
                lr: 1e-3,
                ..Default::default()
            };
            let opt = candle_nn::AdamW::new(varmap.all_vars(), params)?;
            (model, Opt::CandleAdamW(opt), DType::F32)
        }
        ArmKind::CandleSgd => {
            let model = var_model(shape, DType::F32, &varmap)?;
            let opt = candle_nn::SGD::new(varmap.all_vars(), 1e-2)?;
            (model, Opt::CandleSgd(opt), DType::F32)
        }
        ArmKind::Lpmm(config, lr) => {
            let config = LpmmConfig::from(config(lr));
            let dtype = config.var_dtype();
            let model = var_model(shape, dtype, &varmap)?;
            let opt = LpmmOptimizer::from_varmap(&varmap, config)?;
            (model, Opt::Lpmm(opt), dtype)
        }
        ArmKind::LpmmLayers(config, lr) => {
            let opt = LpmmOptimizer::empty(LpmmConfig::from(config(lr)))?;
            let mut rng = Rng::new(0);
            let w = shape.width;
            let mut layers = Vec::new();
            for k in 0..shape.depth {
                let weight = Tensor::from_vec(init(&mut rng, w * w, w), (w, w), &dev)?;
                let bias = Tensor::from_vec(init(&mut rng, w, w), w, &dev)?;
                layers.push(opt.linear(&format!("l{k:02}"), &weight, Some(&bias))?);
            }
            (Model::Held(layers), Opt::Lpmm(opt), DType::F32)
        }
    };
    // A fixed regression batch.
    let mut rng = Rng::new(1);
    let (b, w) = (shape.batch, shape.width);
    let x: Vec<f32> = (0..b * w).map(|_| rng.normal() as f32).collect();
    let y: Vec<f32> = (0..b * w).map(|_| 0.1 * rng.normal() as f32).collect();
    let x = Tensor::from_vec(x, (b, w), &dev)?.to_dtype(var_dtype)?;
    let y = Tensor::from_vec(y, (b, w), &dev)?;
    let loss = |m: &Model| -> Result<Tensor> {
        m.forward(&x)?
            .to_dtype(DType::F32)?
            .sub(&y)?
            .sqr()?
            .mean_all()
    };
    let first_loss = loss(&model)?.to_scalar::<f32>()? as f64;

    let mut times = Vec::new();
    for _ in 0..shape.steps {
        let t = Instant::now();
        opt.step(&loss(&model)?)?;
        times.push(t.elapsed().as_secs_f64());
    }
    let last_loss = loss(&model)?.to_scalar::<f32>()? as f64;
    let steady_rss = proc_status_bytes("VmRSS").unwrap_or(0);
    let peak_rss = proc_status_bytes("VmHWM").unwrap_or(0);
    release_freed_memory();
    let live_rss = proc_status_bytes("VmRSS").unwrap_or(0);
    let later = &times[times.len() / 2..];
    let candle_var_bytes: usize = varmap
        .all_vars()
        .iter()
        .map(|v| v.elem_count() * v.dtype().size_in_bytes())
        .sum();
    let optimizer_bytes = match &opt {
        Opt::Lpmm(o) => o.memory_report().total(),
        // candle-nn's AdamW keeps two f32 moments of every Var; its SGD keeps none.
        Opt::CandleAdamW(_) => 2 * candle_var_bytes,
        Opt::CandleSgd(_) | Opt::None => 0,
    };
    Ok(Probe {
        arm: arm.name.to_string(),
        shape: *shape,
        params: shape.params(),
        candle_var_bytes,
        optimizer_bytes,
        peak_rss,
        steady_rss,
        live_rss,
        first_loss,
        last_loss,
        seconds_per_step: later.iter().sum::<f64>() / later.len().max(1) as f64,
    })
}
