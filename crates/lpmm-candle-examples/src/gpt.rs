//! A byte-level GPT trained through candle on the CPU or a CUDA device (feature `cuda`), one
//! optimizer setup (an *arm*) per process: `examples/gpt.rs` runs the arms and reports the
//! memory a training process holds, its speed, and the quality each arm reaches.
//!
//! The model is GPT-2's shape: token and learned position embeddings over the 256 byte values,
//! pre-norm blocks (layer norm, causal multi-head attention, layer norm, an MLP of 4x the width
//! with GELU), a final layer norm and an output head (not tied to the embedding), no biases and
//! no dropout. Its layer norms and attention softmax are [`lpmm_candle::ops`]'s differentiable
//! ones (candle-nn's fused ones have no backward pass). The weights are `Var`s, or, in the
//! arms that say so, lpmm's layers ([`lpmm_candle::nn`]: the optimizer holds the weight in its
//! own storage; the layer norms' gains stay `Var`s).
//!
//! Two sizes ([`Recipe::memory`], [`Recipe::quality`]), and their small twins for the CPU
//! ([`Recipe::tiny_memory`], [`Recipe::tiny_quality`]).

use std::time::Instant;

use candle_core::{D, DType, Device, Module, Result, Tensor, Var};
use candle_nn::{Embedding, Linear, Optimizer as _, VarMap};
use lpmm_candle::nn::{QEmbedding, QLinear};
use lpmm_candle::ops::LayerNorm;
use lpmm_candle::{LpmmConfig, LpmmOptimizer};
use lpmm_optim::{Hybrid, MissingGradientPolicy, ParamConfig, presets};
use serde::{Deserialize, Serialize};

use crate::device_memory::{DeviceMemory, HostMemory, MemoryWatch};
use crate::experiments::{Rng, Text, window_starts, windows_of};

/// Byte-level: one token per byte value.
pub const VOCAB: usize = 256;

/// The model's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptShape {
    /// Blocks.
    pub layers: usize,
    /// Width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Context length.
    pub context: usize,
}

impl GptShape {
    /// Parameters: per block 12 width² (attention 4, MLP 8) and two layer-norm gains; the token
    /// and position embeddings, the head and the final norm's gain.
    pub fn params(&self) -> usize {
        let w = self.width;
        self.layers * (12 * w * w + 2 * w) + 2 * VOCAB * w + self.context * w + w
    }
}

/// How a run trains.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Recipe {
    /// The model.
    pub shape: GptShape,
    /// Sequences per step.
    pub batch: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// Peak learning rate of the AdamW arms.
    pub adamw_lr: f64,
    /// Peak learning rate of LPMM-SGDM.
    pub sgd_lr: f64,
    /// Peak learning rate of Muon's matrices in the Muon arms (torch's examples: 0.02).
    pub muon_lr: f64,
    /// AdamW's beta2 (beta1 0.9, eps 1e-8).
    pub beta2: f64,
    /// AdamW's decoupled weight decay (every parameter, as candle-nn's AdamW applies it).
    pub weight_decay: f64,
    /// Steps of linear warmup.
    pub warmup: usize,
    /// The last step's learning rate as a fraction of the peak (cosine decay after the warmup).
    pub final_lr_fraction: f64,
    /// Standard deviation of the weights at initialisation (the residual projections: divided by
    /// sqrt(2 layers), as GPT-2).
    pub init_std: f64,
    /// Validation windows (spread evenly over the validation split); 0: no evaluation.
    pub val_windows: usize,
}

impl Recipe {
    /// The memory size: 24 blocks of width 1024 (16 heads), context 256: 302.8M parameters;
    /// batches of 4 sequences, a few steps.
    pub fn memory() -> Recipe {
        Recipe {
            shape: GptShape {
                layers: 24,
                width: 1024,
                heads: 16,
                context: 256,
            },
            batch: 4,
            steps: 6,
            val_windows: 0,
            ..Recipe::quality()
        }
    }

    /// The quality size: nanoGPT's shakespeare-char model (6 blocks of width 384, 6 heads,
    /// context 256; 10.9M parameters with the 256 byte values and an untied head), batches of
    /// 64, its AdamW settings (peak 1e-3, beta2 0.99, weight decay 0.1, 100 warmup steps, cosine
    /// to a tenth). Steps: as many as the GPU run's time allows (`--steps`).
    pub fn quality() -> Recipe {
        Recipe {
            shape: GptShape {
                layers: 6,
                width: 384,
                heads: 6,
                context: 256,
            },
            batch: 64,
            steps: 600,
            adamw_lr: 1e-3,
            sgd_lr: 0.1,
            muon_lr: 0.02,
            beta2: 0.99,
            weight_decay: 0.1,
            warmup: 100,
            final_lr_fraction: 0.1,
            init_std: 0.02,
            val_windows: 128,
        }
    }

    /// The memory run at CPU scale (CI): 2 blocks of width 128, context 64.
    pub fn tiny_memory() -> Recipe {
        Recipe {
            shape: GptShape {
                layers: 2,
                width: 128,
                heads: 4,
                context: 64,
            },
            batch: 4,
            steps: 3,
            ..Recipe::memory()
        }
    }

    /// The quality run at CPU scale (CI): 2 blocks of width 64, context 64, 60 steps of 8
    /// sequences.
    pub fn tiny_quality() -> Recipe {
        Recipe {
            shape: GptShape {
                layers: 2,
                width: 64,
                heads: 4,
                context: 64,
            },
            batch: 8,
            steps: 60,
            warmup: 10,
            adamw_lr: 3e-3,
            val_windows: 16,
            ..Recipe::quality()
        }
    }

    /// The learning rate at `step` for the peak `peak`: linear warmup, then cosine decay to
    /// `final_lr_fraction * peak` at the last step.
    pub fn lr(&self, peak: f64, step: usize) -> f64 {
        let warmup = self.warmup.min(self.steps / 2);
        if step < warmup {
            return peak * (step + 1) as f64 / warmup as f64;
        }
        let span = self.steps.saturating_sub(warmup + 1).max(1);
        let progress = ((step - warmup) as f64 / span as f64).min(1.0);
        let f = self.final_lr_fraction;
        peak * (f + (1.0 - f) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
    }
}

/// What an arm trains with.
#[derive(Debug, Clone, Copy)]
pub enum ArmKind {
    /// `candle_nn::AdamW` over f32 `Var`s.
    CandleAdamW,
    /// An lpmm preset over `Var`s created in the dtype it stores ([`LpmmConfig::var_dtype`]).
    Vars(fn(&Recipe) -> ParamConfig),
    /// An lpmm preset over lpmm's layers (the layer norms' gains as f32 `Var`s).
    Layers(fn(&Recipe) -> ParamConfig),
    /// Muon for the blocks' matrices and AdamW for the rest (the embeddings `wte`, `wpe` and the
    /// `head` by [`lpmm_optim::DEFAULT_OTHERS`], the gains by their shape), over `Var`s created
    /// in the dtype AdamW's part stores.
    Hybrid(fn(&Recipe) -> Hybrid),
}

/// One optimizer setup.
#[derive(Debug, Clone, Copy)]
pub struct Arm {
    /// Its name on the command line (`--arms`).
    pub key: &'static str,
    /// Its name in reports.
    pub name: &'static str,
    /// What it trains with.
    pub kind: ArmKind,
}

fn adamw(preset: lpmm_optim::presets::Preset<lpmm_optim::Adam>, r: &Recipe) -> ParamConfig {
    preset
        .betas(0.9, r.beta2)
        .weight_decay(r.weight_decay)
        .build()
}

/// The arms, the f32 reference first.
pub fn arms() -> Vec<Arm> {
    vec![
        Arm {
            key: "candle-adamw",
            name: "candle-nn AdamW (f32)",
            kind: ArmKind::CandleAdamW,
        },
        Arm {
            key: "adamw-f32",
            name: "lpmm adamw_f32",
            kind: ArmKind::Vars(|r| adamw(presets::adamw_f32(r.adamw_lr), r)),
        },
        Arm {
            key: "adamw-8bit",
            name: "lpmm adamw_8bit (f32 Vars)",
            kind: ArmKind::Vars(|r| adamw(presets::adamw_8bit(r.adamw_lr), r)),
        },
        Arm {
            key: "adamw-8bit-bf16-sr",
            name: "lpmm adamw_8bit_bf16_sr (bf16 Vars)",
            kind: ArmKind::Vars(|r| adamw(presets::adamw_8bit_bf16_sr(r.adamw_lr), r)),
        },
        Arm {
            key: "adamw-4bit-released-layers",
            name: "lpmm adamw_4bit_bf16_sr_released (lpmm layers)",
            kind: ArmKind::Layers(|r| adamw(presets::adamw_4bit_bf16_sr_released(r.adamw_lr), r)),
        },
        Arm {
            key: "lpmm-sgdm-layers",
            name: "LPMM-SGDM (lpmm layers)",
            kind: ArmKind::Layers(|r| presets::lpmm_sgdm(r.sgd_lr, 0.9).build()),
        },
        Arm {
            key: "muon-f32",
            name: "lpmm Muon + AdamW, f32 (muon_adamw_f32)",
            kind: ArmKind::Hybrid(|r| {
                Hybrid::new(
                    presets::muon_f32(r.muon_lr),
                    adamw(presets::adamw_f32(r.adamw_lr), r),
                )
            }),
        },
        Arm {
            key: "muon-8bit-bf16-sr",
            name: "lpmm 8-bit Muon + 8-bit AdamW, bf16 SR (bf16 Vars)",
            kind: ArmKind::Hybrid(|r| {
                Hybrid::new(
                    presets::muon_8bit_bf16_sr(r.muon_lr),
                    adamw(presets::adamw_8bit_bf16_sr(r.adamw_lr), r),
                )
            }),
        },
    ]
}

/// The arm named `key`.
pub fn arm(key: &str) -> Result<Arm> {
    arms().into_iter().find(|a| a.key == key).ok_or_else(|| {
        let keys: Vec<&str> = arms().iter().map(|a| a.key).collect();
        candle_core::Error::Msg(format!("unknown arm {key}; arms: {}", keys.join(", ")))
    })
}

/// A name's 64-bit FNV-1a hash: each tensor's initial values are drawn from their own stream,
/// so every arm starts from the same weights whatever it creates first.
fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// GPT-2's initialisation of tensor `name`: layer-norm gains 1, the residual projections
/// (`proj`, `down`) N(0, std² / (2 layers)), every other weight N(0, std²).
fn init_values(name: &str, n: usize, seed: u64, r: &Recipe) -> Vec<f32> {
    if name.contains("ln") {
        return vec![1.0; n];
    }
    let sd = if name.ends_with("proj.weight") || name.ends_with("down.weight") {
        r.init_std / (2.0 * r.shape.layers.max(1) as f64).sqrt()
    } else {
        r.init_std
    };
    let mut rng = Rng::new(seed ^ name_key(name));
    (0..n).map(|_| (rng.normal() * sd) as f32).collect()
}

#[derive(Debug)]
enum Lin {
    Var(Linear),
    Held(Box<QLinear>),
}

impl Lin {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Lin::Var(l) => l.forward(x),
            Lin::Held(l) => l.forward(x),
        }
    }
}

#[derive(Debug)]
enum Emb {
    Var(Embedding),
    Held(QEmbedding),
}

impl Emb {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Emb::Var(e) => e.forward(ids),
            Emb::Held(e) => e.forward(ids),
        }
    }
}

#[derive(Debug)]
struct Block {
    ln1: LayerNorm,
    qkv: Lin,
    proj: Lin,
    ln2: LayerNorm,
    up: Lin,
    down: Lin,
}

/// The byte-level GPT.
#[derive(Debug)]
pub struct Gpt {
    shape: GptShape,
    wte: Emb,
    wpe: Emb,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Lin,
}

/// Where the model's tensors go: `Var`s in a `VarMap` (in `dtype`), or lpmm's layers (the
/// gains as f32 `Var`s, registered with the optimizer at the end).
enum Maker<'a> {
    Vars {
        varmap: &'a VarMap,
        dtype: DType,
    },
    Layers {
        opt: &'a LpmmOptimizer,
        gains: Vec<(String, Var)>,
    },
}

struct Builder<'a> {
    maker: Maker<'a>,
    device: Device,
    seed: u64,
    recipe: Recipe,
}

impl Builder<'_> {
    fn tensor(&self, name: &str, dims: &[usize], dtype: DType) -> Result<Tensor> {
        let values = init_values(name, dims.iter().product(), self.seed, &self.recipe);
        Tensor::from_vec(values, dims, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(&self.device)
    }

    fn var(&mut self, name: &str, dims: &[usize], dtype: DType) -> Result<Tensor> {
        let var = Var::from_tensor(&self.tensor(name, dims, dtype)?)?;
        let t = var.as_tensor().clone();
        match &mut self.maker {
            Maker::Vars { varmap, .. } => {
                varmap
                    .data()
                    .lock()
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?
                    .insert(name.to_string(), var);
            }
            Maker::Layers { gains, .. } => gains.push((name.to_string(), var)),
        }
        Ok(t)
    }

    fn linear(&mut self, name: &str, d_in: usize, d_out: usize) -> Result<Lin> {
        let weight = format!("{name}.weight");
        match &self.maker {
            Maker::Vars { dtype, .. } => {
                let dtype = *dtype;
                Ok(Lin::Var(Linear::new(
                    self.var(&weight, &[d_out, d_in], dtype)?,
                    None,
                )))
            }
            Maker::Layers { opt, .. } => {
                let w = self.tensor(&weight, &[d_out, d_in], DType::F32)?;
                Ok(Lin::Held(Box::new(opt.linear(name, &w, None)?)))
            }
        }
    }

    fn embedding(&mut self, name: &str, rows: usize, dim: usize) -> Result<Emb> {
        let weight = format!("{name}.weight");
        match &self.maker {
            Maker::Vars { dtype, .. } => {
                let dtype = *dtype;
                Ok(Emb::Var(Embedding::new(
                    self.var(&weight, &[rows, dim], dtype)?,
                    dim,
                )))
            }
            Maker::Layers { opt, .. } => {
                let t = self.tensor(&weight, &[rows, dim], DType::F32)?;
                Ok(Emb::Held(opt.embedding(name, &t)?))
            }
        }
    }

    fn layer_norm(&mut self, name: &str, dim: usize) -> Result<LayerNorm> {
        let dtype = match &self.maker {
            Maker::Vars { dtype, .. } => *dtype,
            Maker::Layers { .. } => DType::F32,
        };
        Ok(LayerNorm::new_no_bias(
            self.var(&format!("{name}.weight"), &[dim], dtype)?,
            1e-5,
        ))
    }
}

impl Gpt {
    fn build(b: &mut Builder<'_>) -> Result<Gpt> {
        let s = b.recipe.shape;
        let w = s.width;
        if s.heads == 0 || !w.is_multiple_of(s.heads) {
            return Err(candle_core::Error::Msg(format!(
                "width {w} is not a multiple of {} heads",
                s.heads
            )));
        }
        let wte = b.embedding("wte", VOCAB, w)?;
        let wpe = b.embedding("wpe", s.context, w)?;
        let mut blocks = Vec::with_capacity(s.layers);
        for i in 0..s.layers {
            let p = format!("h{i:02}");
            blocks.push(Block {
                ln1: b.layer_norm(&format!("{p}.ln1"), w)?,
                qkv: b.linear(&format!("{p}.qkv"), w, 3 * w)?,
                proj: b.linear(&format!("{p}.proj"), w, w)?,
                ln2: b.layer_norm(&format!("{p}.ln2"), w)?,
                up: b.linear(&format!("{p}.up"), w, 4 * w)?,
                down: b.linear(&format!("{p}.down"), 4 * w, w)?,
            });
        }
        let ln_f = b.layer_norm("ln_f", w)?;
        let head = b.linear("head", w, VOCAB)?;
        Ok(Gpt {
            shape: s,
            wte,
            wpe,
            blocks,
            ln_f,
            head,
        })
    }

    /// Logits `(batch, context, 256)` for byte ids `(batch, context)`, in f32.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (w, h) = (self.shape.width, self.shape.heads);
        let pos = Tensor::arange(0u32, t as u32, ids.device())?;
        let mut x = self
            .wte
            .forward(ids)?
            .broadcast_add(&self.wpe.forward(&pos)?)?;
        for blk in &self.blocks {
            let qkv = blk
                .qkv
                .forward(&blk.ln1.forward(&x)?)?
                .reshape((b, t, 3, h, w / h))?;
            let head = |k: usize| {
                qkv.narrow(2, k, 1)?
                    .squeeze(2)?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, k, v) = (head(0)?, head(1)?, head(2)?);
            let att = lpmm_candle::ops::causal_softmax(
                &q.matmul(&k.transpose(2, 3)?.contiguous()?)?,
                1.0 / ((w / h) as f64).sqrt(),
            )?;
            let y = att
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b, t, w))?;
            x = (x + blk.proj.forward(&y)?)?;
            let m = blk
                .down
                .forward(&blk.up.forward(&blk.ln2.forward(&x)?)?.gelu()?)?;
            x = (x + m)?;
        }
        self.head
            .forward(&self.ln_f.forward(&x)?)?
            .to_dtype(DType::F32)
    }
}

/// The optimizer of an arm.
enum Opt {
    Candle(candle_nn::AdamW),
    Lpmm(LpmmOptimizer),
}

impl Opt {
    fn set_lr(&mut self, lr: f64) {
        match self {
            Opt::Candle(o) => o.set_learning_rate(lr),
            Opt::Lpmm(o) => o.set_learning_rate(lr),
        }
    }
}

/// What one arm's process measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArmRun {
    /// The arm's key.
    pub arm: String,
    /// Its name.
    pub name: String,
    /// "cpu", or the CUDA device ("cuda:0").
    pub device: String,
    /// The recipe.
    pub recipe: Recipe,
    /// The initialisation seed.
    pub seed: u64,
    /// Parameters trained.
    pub params: usize,
    /// Bytes of the candle `Var`s (lent to lpmm or not), in their dtype.
    pub var_bytes: usize,
    /// Bytes lpmm's optimizer holds (parameters lpmm holds, accumulators, states); for
    /// candle-nn's AdamW, its two f32 moments.
    pub optimizer_bytes: usize,
    /// The process's host memory after training.
    pub host: HostMemory,
    /// The device's memory (CUDA only).
    pub cuda: Option<DeviceMemory>,
    /// Tokens per second over the timed steps (every step after the first).
    pub tokens_per_s: f64,
    /// Mean milliseconds of a timed step (forward, backward and optimizer step).
    pub ms_per_step: f64,
    /// Of which the optimizer's step (`step` over candle's gradients), milliseconds: the rest is
    /// forward and backward (with lpmm's layers, their backward passes also hand their
    /// gradients to lpmm, and a released preset steps each layer there).
    pub ms_optimizer: f64,
    /// `ms_optimizer / ms_per_step`.
    pub optimizer_share: f64,
    /// Training loss of the first step.
    pub first_loss: f64,
    /// Mean training loss over the last 10% of steps.
    pub final_train_loss: f64,
    /// Validation loss (nats per byte) and next-byte accuracy, where evaluated.
    pub val_loss: Option<f64>,
    /// Next-byte accuracy on the validation windows.
    pub val_accuracy: Option<f64>,
    /// Training loss every `curve_every` steps (means over those steps).
    pub curve: Vec<f64>,
    /// Steps between curve points.
    pub curve_every: usize,
}

/// Byte ids of `text` (its tokens mapped back to their bytes): (train, validation).
pub fn byte_split(text: &Text) -> (Vec<u32>, Vec<u32>) {
    let bytes = |tokens: &[u32]| -> Vec<u32> {
        tokens
            .iter()
            .map(|&t| u32::from(text.vocab[t as usize]))
            .collect()
    };
    (bytes(&text.train), bytes(&text.val))
}

/// Validation loss and next-byte accuracy over `count` windows spread evenly over `tokens`.
pub fn evaluate(model: &Gpt, tokens: &[u32], count: usize, dev: &Device) -> Result<(f64, f64)> {
    let t = model.shape.context;
    if tokens.len() < t + 1 || count == 0 {
        return Err(candle_core::Error::Msg(format!(
            "{} tokens cannot hold {count} windows of {t} and their next tokens",
            tokens.len()
        )));
    }
    let starts = window_starts(count, tokens.len() - t - 1);
    let (mut loss_sum, mut correct) = (0.0f64, 0.0f64);
    for chunk in starts.chunks(16) {
        let (x, y) = windows_of(tokens, chunk, t, dev)?;
        let logits = model.forward(&x)?.reshape((chunk.len() * t, VOCAB))?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()?;
        loss_sum += f64::from(loss) * chunk.len() as f64;
        correct += f64::from(
            logits
                .argmax(D::Minus1)?
                .eq(&y)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?,
        );
    }
    Ok((loss_sum / count as f64, correct / (count * t) as f64))
}

/// The name of `device` in reports.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}"),
    }
}

/// Trains `arm` with `recipe` on `device` from initialisation `seed` and measures it. Call it in
/// a process of its own, first thing: the host peak it reports is the process's.
pub fn train(
    arm: &Arm,
    recipe: &Recipe,
    seed: u64,
    device: &Device,
    train_tokens: &[u32],
    val_tokens: &[u32],
    mut progress: impl FnMut(usize, f64),
) -> Result<ArmRun> {
    let t = recipe.shape.context;
    if recipe.steps == 0 || recipe.batch == 0 {
        return Err(candle_core::Error::Msg(
            "a run needs steps and a batch".into(),
        ));
    }
    if train_tokens.len() < t + 2 {
        return Err(candle_core::Error::Msg(format!(
            "{} training tokens cannot hold a window of {t}",
            train_tokens.len()
        )));
    }
    let watch = MemoryWatch::start(device)?;
    let varmap = VarMap::new();
    let builder = |maker| Builder {
        maker,
        device: device.clone(),
        seed,
        recipe: *recipe,
    };
    // Every parameter must receive a gradient: a step that finds one without is an error.
    let lpmm_config =
        |c: ParamConfig| LpmmConfig::from(c).with_missing_gradient(MissingGradientPolicy::Error);
    // lpmm over `Var`s created in the dtype the configuration stores.
    let over_vars = |config: LpmmConfig| -> Result<(Gpt, Opt)> {
        let mut b = builder(Maker::Vars {
            varmap: &varmap,
            dtype: config.var_dtype(),
        });
        let model = Gpt::build(&mut b)?;
        let opt = LpmmOptimizer::from_varmap(&varmap, config)?;
        Ok((model, Opt::Lpmm(opt)))
    };
    let (model, mut opt) = match arm.kind {
        ArmKind::CandleAdamW => {
            let mut b = builder(Maker::Vars {
                varmap: &varmap,
                dtype: DType::F32,
            });
            let model = Gpt::build(&mut b)?;
            let params = candle_nn::ParamsAdamW {
                lr: recipe.adamw_lr,
                beta1: 0.9,
                beta2: recipe.beta2,
                eps: 1e-8,
                weight_decay: recipe.weight_decay,
            };
            let opt = candle_nn::AdamW::new(varmap.all_vars(), params)?;
            (model, Opt::Candle(opt))
        }
        ArmKind::Vars(config) => over_vars(lpmm_config(config(recipe)))?,
        ArmKind::Hybrid(hybrid) => over_vars(
            LpmmConfig::from(hybrid(recipe)).with_missing_gradient(MissingGradientPolicy::Error),
        )?,
        ArmKind::Layers(config) => {
            let mut opt = LpmmOptimizer::empty(lpmm_config(config(recipe)))?;
            let mut b = builder(Maker::Layers {
                opt: &opt,
                gains: Vec::new(),
            });
            let model = Gpt::build(&mut b)?;
            let Maker::Layers { gains, .. } = b.maker else {
                unreachable!("built with layers")
            };
            opt.add_vars(gains)?;
            (model, Opt::Lpmm(opt))
        }
    };
    // The schedule's peak: the rate the arm's configuration sets.
    let peak_lr = match arm.kind {
        ArmKind::CandleAdamW => recipe.adamw_lr,
        ArmKind::Vars(config) | ArmKind::Layers(config) => config(recipe).hyper.lr(),
        // AdamW's rate; lpmm-candle's set_lr keeps Muon's ratio to it.
        ArmKind::Hybrid(hybrid) => hybrid(recipe).others.hyper.lr(),
    };
    let mut data_rng = Rng::new(4321); // the same batches for every arm and seed
    let (mut losses, mut curve) = (Vec::new(), Vec::new());
    let every = (recipe.steps / 50).max(1);
    let (mut timed, mut timed_opt) = (0.0f64, 0.0f64);
    for step in 0..recipe.steps {
        opt.set_lr(recipe.lr(peak_lr, step));
        let starts: Vec<usize> = (0..recipe.batch)
            .map(|_| data_rng.below(train_tokens.len() - t - 1))
            .collect();
        let (x, y) = windows_of(train_tokens, &starts, t, device)?;
        device.synchronize()?;
        let start = Instant::now();
        let logits = model.forward(&x)?.reshape((recipe.batch * t, VOCAB))?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
        let mut grads = loss.backward()?;
        device.synchronize()?;
        let backward_done = Instant::now();
        match &mut opt {
            Opt::Candle(o) => o.step(&grads)?,
            Opt::Lpmm(o) => drop(o.step_grads(&mut grads)?),
        }
        drop(grads);
        device.synchronize()?;
        let done = Instant::now();
        let value = f64::from(loss.to_scalar::<f32>()?);
        if step > 0 {
            timed += (done - start).as_secs_f64();
            timed_opt += (done - backward_done).as_secs_f64();
        }
        losses.push(value);
        if losses.len().is_multiple_of(every) {
            let tail = &losses[losses.len() - every..];
            curve.push(tail.iter().sum::<f64>() / every as f64);
        }
        progress(step + 1, value);
    }
    let timed_steps = recipe.steps.saturating_sub(1).max(1) as f64;
    let ms_per_step = timed * 1e3 / timed_steps;
    let ms_optimizer = timed_opt * 1e3 / timed_steps;
    let (val_loss, val_accuracy) = if recipe.val_windows > 0 {
        let (l, a) = evaluate(&model, val_tokens, recipe.val_windows, device)?;
        (Some(l), Some(a))
    } else {
        (None, None)
    };
    let cuda = watch.finish()?;
    let host = HostMemory::now();
    let var_bytes = |vars: &[Var]| -> usize {
        vars.iter()
            .map(|v| v.elem_count() * v.dtype().size_in_bytes())
            .sum()
    };
    let (params, var_bytes, optimizer_bytes) = match &opt {
        Opt::Candle(_) => {
            let b = var_bytes(&varmap.all_vars());
            (recipe.shape.params(), b, 2 * b)
        }
        Opt::Lpmm(o) => (
            o.memory_report().numel(),
            o.candle_bytes(),
            o.memory_report().total(),
        ),
    };
    let tail = (losses.len() / 10).max(1);
    Ok(ArmRun {
        arm: arm.key.into(),
        name: arm.name.into(),
        device: device_name(device),
        recipe: *recipe,
        seed,
        params,
        var_bytes,
        optimizer_bytes,
        host,
        cuda,
        tokens_per_s: (recipe.batch * t) as f64 / (ms_per_step / 1e3).max(1e-12),
        ms_per_step,
        ms_optimizer,
        optimizer_share: if ms_per_step > 0.0 {
            ms_optimizer / ms_per_step
        } else {
            0.0
        },
        first_loss: losses.first().copied().unwrap_or(f64::NAN),
        final_train_loss: losses[losses.len() - tail..].iter().sum::<f64>() / tail as f64,
        val_loss,
        val_accuracy,
        curve,
        curve_every: every,
    })
}
