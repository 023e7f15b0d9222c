//! The two models: the digits MLP and the character-level transformer.

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder, VarMap};
use serde::Serialize;

use lpmm_candle::ops::LayerNorm;

use super::Rng;

/// The digits classifier: 64 -> 128 (ReLU) -> 10.
#[derive(Debug)]
pub struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    /// Builds the model in `vb`.
    pub fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Mlp {
            l1: candle_nn::linear(64, 128, vb.pp("l1"))?,
            l2: candle_nn::linear(128, 10, vb.pp("l2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.relu()?)
    }
}

/// Sizes of the character-level transformer.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LmShape {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
    /// Context length.
    pub context: usize,
}

#[derive(Debug)]
struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    up: Linear,
    down: Linear,
}

/// A small causal character-level transformer (nanoGPT-like: pre-norm blocks, learned positions,
/// an MLP of 4x the width, no biases; ReLU instead of GELU, which costs a third of the step time
/// in candle's CPU backward pass). Its layer norms and attention softmax are [`lpmm_candle::ops`]'s
/// differentiable ones: with candle-nn's fused `LayerNorm` and `softmax_last_dim` no gradient
/// would cross them (see the crate's documentation).
#[derive(Debug)]
pub struct CharLm {
    pub(super) shape: LmShape,
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    ln: LayerNorm,
    head: Linear,
    pub(super) device: Device,
}

impl CharLm {
    /// Builds the model in `vb` (candle's initialisation; see [`CharLm::init`]).
    pub fn new(shape: LmShape, vb: VarBuilder, device: &Device) -> Result<Self> {
        let w = shape.width;
        if shape.heads == 0 || !w.is_multiple_of(shape.heads) {
            return Err(candle_core::Error::Msg(format!(
                "width {w} is not a multiple of {} heads",
                shape.heads
            )));
        }
        let blocks = (0..shape.layers)
            .map(|i| {
                let vb = vb.pp(format!("block{i}"));
                Ok(Block {
                    ln1: LayerNorm::load_no_bias(w, 1e-5, vb.pp("ln1"))?,
                    qkv: candle_nn::linear_no_bias(w, 3 * w, vb.pp("qkv"))?,
                    proj: candle_nn::linear_no_bias(w, w, vb.pp("proj"))?,
                    ln2: LayerNorm::load_no_bias(w, 1e-5, vb.pp("ln2"))?,
                    up: candle_nn::linear_no_bias(w, 4 * w, vb.pp("up"))?,
                    down: candle_nn::linear_no_bias(4 * w, w, vb.pp("down"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CharLm {
            shape,
            tokens: candle_nn::embedding(shape.vocab, w, vb.pp("tokens"))?,
            positions: candle_nn::embedding(shape.context, w, vb.pp("positions"))?,
            blocks,
            ln: LayerNorm::load_no_bias(w, 1e-5, vb.pp("ln"))?,
            head: candle_nn::linear_no_bias(w, shape.vocab, vb.pp("head"))?,
            device: device.clone(),
        })
    }

    /// The model's sizes.
    pub fn shape(&self) -> LmShape {
        self.shape
    }

    /// GPT-2's initialisation, deterministic from `seed`: embeddings and weight matrices
    /// N(0, `std`²), the residual projections (`proj`, `down`) N(0, `std`² / (2 layers)),
    /// layer-norm gains 1. (candle's own starts the embeddings at N(0, 1) and the linear weights
    /// at N(0, 2 / fan-in); docs/RESULTS.md has what that costs this model.)
    pub fn init(&self, varmap: &VarMap, seed: u64, std: f64) -> Result<()> {
        let data = varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        let mut rng = Rng::new(seed);
        let residual = std / (2.0 * self.shape.layers.max(1) as f64).sqrt();
        for name in names {
            let var = &data[name];
            let n = var.elem_count();
            let values: Vec<f32> = if name.ends_with(".bias") {
                vec![0.0; n]
            } else if name.starts_with("ln.") || name.contains(".ln") {
                vec![1.0; n]
            } else {
                let sd = if name.contains(".proj.") || name.contains(".down.") {
                    residual
                } else {
                    std
                };
                (0..n).map(|_| (rng.normal() * sd) as f32).collect()
            };
            var.set(&Tensor::from_vec(values, var.shape(), var.device())?)?;
        }
        Ok(())
    }

    /// Logits `(batch, context, vocab)` for token ids `(batch, context)`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (w, h) = (self.shape.width, self.shape.heads);
        let pos = Tensor::arange(0u32, t as u32, ids.device())?;
        let mut x = self
            .tokens
            .forward(ids)?
            .broadcast_add(&self.positions.forward(&pos)?)?;
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
                .forward(&blk.up.forward(&blk.ln2.forward(&x)?)?.relu()?)?;
            x = (x + m)?;
        }
        self.head.forward(&self.ln.forward(&x)?)
    }

    /// Continues `prompt` by `count` tokens, each drawn from the model's distribution at
    /// `temperature` given the last `context` tokens, with random numbers from `rng`.
    pub fn sample(
        &self,
        prompt: &[u32],
        count: usize,
        temperature: f64,
        rng: &mut Rng,
    ) -> Result<Vec<u32>> {
        let mut tokens = prompt.to_vec();
        let dev = &self.device;
        for _ in 0..count {
            let from = tokens.len().saturating_sub(self.shape.context);
            let window = &tokens[from..];
            let ids = Tensor::from_vec(window.to_vec(), (1, window.len()), dev)?;
            let logits = self
                .forward(&ids)?
                .squeeze(0)?
                .get(window.len() - 1)?
                .to_dtype(DType::F64)?;
            let p =
                candle_nn::ops::softmax(&(logits / temperature)?, D::Minus1)?.to_vec1::<f64>()?;
            let u = rng.uniform();
            let mut acc = 0.0;
            let mut next = p.len() - 1;
            for (k, &pk) in p.iter().enumerate() {
                acc += pk;
                if u < acc {
                    next = k;
                    break;
                }
            }
            tokens.push(next as u32);
        }
        Ok(tokens[prompt.len()..].to_vec())
    }
}
