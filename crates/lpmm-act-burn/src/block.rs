//! A pre-LN transformer block, `x + MHA(LN(x))` then `+ MLP(LN(·))` with a GELU MLP, built from
//! burn's tensor operators, in variants that differ only in the operators whose saved state
//! lpmm-act shrinks:
//!
//! | variant | LayerNorm | attention probabilities | GELU |
//! |---|---|---|---|
//! | [`Variant::Baseline`] | burn's `layer_norm` | burn's `softmax`, then dropout as burn's `nn::Dropout` computes it (`x · bernoulli(1-p) / (1-p)`), then `matmul` | burn's `gelu` |
//! | [`Variant::LpmmUnfused`] | [`layer_norm_from_output`] | [`softmax_dropout`], then `matmul` | [`gelu_from_output`] |
//! | [`Variant::Lpmm`] | [`layer_norm_from_output`] | [`softmax_dropout_matmul`] | [`gelu_from_output`] |
//! | [`Variant::LpmmFewBit`] | [`layer_norm_from_output`] | [`softmax_dropout_matmul`] | [`gelu_few_bit`], 2 bits |
//! | [`Variant::LpmmCompressed`] | [`layer_norm_from_output`] | [`softmax_dropout_matmul`] | [`gelu_few_bit`], 2 bits; the output projection and the MLP's down projection keep their inputs 8-bit ([`matmul_compressed`]) |
//!
//! Everything else (the linear layers, the head split, the residuals, the loss) is the same burn
//! code in every variant, and the parameters are identical.

use std::sync::Arc;

use burn_tensor::{Device, Distribution, Gradients, Tensor, TensorData, activation, module};
use lpmm_act::Table;
use lpmm_quant::RandomStream;

use crate::{
    gelu_few_bit, gelu_from_output, gelu_table, layer_norm_from_output, matmul_compressed,
    softmax_dropout, softmax_dropout_matmul,
};

/// Which operators the block uses (see the module's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// burn's own LayerNorm, softmax, dropout and GELU.
    Baseline,
    /// lpmm-act's LayerNorm and GELU from their outputs and softmax·dropout, followed by burn's
    /// matmul (which saves the dropout output).
    LpmmUnfused,
    /// lpmm-act's LayerNorm and GELU from their outputs and the fused softmax·dropout·matmul.
    Lpmm,
    /// As [`Variant::Lpmm`] with the 2-bit few-bit GELU instead of GELU from its output.
    LpmmFewBit,
    /// As [`Variant::LpmmFewBit`], with the attention output projection and the MLP's down
    /// projection keeping their inputs compressed to 8 bits per element ([`matmul_compressed`]).
    LpmmCompressed,
}

impl Variant {
    /// All five, the baseline first.
    pub const ALL: [Variant; 5] = [
        Variant::Baseline,
        Variant::LpmmUnfused,
        Variant::Lpmm,
        Variant::LpmmFewBit,
        Variant::LpmmCompressed,
    ];

    /// A short name.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Baseline => "baseline (burn ops)",
            Variant::LpmmUnfused => "lpmm-act, unfused attention",
            Variant::Lpmm => "lpmm-act",
            Variant::LpmmFewBit => "lpmm-act, 2-bit GELU",
            Variant::LpmmCompressed => "lpmm-act, 2-bit GELU, 8-bit projection inputs",
        }
    }
}

/// The block's sizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockConfig {
    /// Model width.
    pub d_model: usize,
    /// Attention heads (dividing `d_model`).
    pub heads: usize,
    /// MLP width.
    pub d_ff: usize,
    /// Sequence length.
    pub seq: usize,
    /// Batch size.
    pub batch: usize,
    /// Dropout probability on the attention probabilities.
    pub dropout: f32,
    /// LayerNorm epsilon.
    pub eps: f32,
}

impl Default for BlockConfig {
    /// d_model 256, 4 heads, d_ff 1024, sequence 128, batch 8, dropout 0.1.
    fn default() -> Self {
        Self {
            d_model: 256,
            heads: 4,
            d_ff: 1024,
            seq: 128,
            batch: 8,
            dropout: 0.1,
            eps: 1e-5,
        }
    }
}

impl BlockConfig {
    /// d_model 64, 4 heads, d_ff 256, sequence 32, batch 4 (the rest as the default): the block
    /// the tests step, small enough for a debug build and for lavapipe.
    pub fn small() -> Self {
        Self {
            d_model: 64,
            heads: 4,
            d_ff: 256,
            seq: 32,
            batch: 4,
            ..Self::default()
        }
    }
}

/// A small deterministic generator for the parameters and inputs.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded (any seed; 0 is replaced).
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform on (0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let (a, b) = (self.uniform(), self.uniform());
        ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32
    }

    /// A tensor of `shape` with N(0, std²) entries on `device`.
    pub fn tensor<const D: usize>(
        &mut self,
        shape: [usize; D],
        std: f32,
        device: &Device,
    ) -> Tensor<D> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.normal() * std).collect();
        Tensor::from_data(TensorData::new(v, shape), device)
    }
}

/// A linear layer's parameters.
#[derive(Debug, Clone)]
struct Linear {
    w: Tensor<2>,
    b: Tensor<1>,
}

impl Linear {
    fn new(rng: &mut Rng, d_in: usize, d_out: usize, device: &Device) -> Self {
        Self {
            w: rng
                .tensor([d_in, d_out], 1.0 / (d_in as f32).sqrt(), device)
                .require_grad(),
            b: Tensor::zeros([d_out], device).require_grad(),
        }
    }

    /// `x · W + b` over the last dimension, as one `[batch · seq, d_in]` matmul (a batched
    /// matmul against the broadcast weight would make burn's backward build a per-batch weight
    /// gradient, `batch` times the weight's size, before summing it).
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_with(x, None)
    }

    /// [`Linear::forward`], keeping `x` compressed to 8 bits for the weight gradient when
    /// `compress` gives the random stream.
    fn forward_with(&self, x: Tensor<3>, compress: Option<RandomStream>) -> Tensor<3> {
        let [b, s, d] = x.dims();
        let x = x.reshape([b * s, d]);
        let y = match compress {
            Some(stream) => matmul_compressed(x, self.w.clone(), 8, &stream),
            None => x.matmul(self.w.clone()),
        } + self.b.clone().unsqueeze();
        let d_out = y.dims()[1];
        y.reshape([b, s, d_out])
    }
}

/// A LayerNorm's parameters.
#[derive(Debug, Clone)]
struct Norm {
    gamma: Tensor<1>,
    beta: Tensor<1>,
}

impl Norm {
    fn new(d: usize, device: &Device) -> Self {
        Self {
            gamma: Tensor::ones([d], device).require_grad(),
            beta: Tensor::zeros([d], device).require_grad(),
        }
    }

    fn forward(&self, x: Tensor<3>, variant: Variant, eps: f32) -> Tensor<3> {
        match variant {
            Variant::Baseline => module::layer_norm(
                x,
                self.gamma.clone(),
                Some(self.beta.clone()),
                f64::from(eps),
            ),
            _ => layer_norm_from_output(x, self.gamma.clone(), self.beta.clone(), eps),
        }
    }
}

/// The block: parameters and the few-bit table.
#[derive(Debug, Clone)]
pub struct Block {
    cfg: BlockConfig,
    ln1: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: Norm,
    up: Linear,
    down: Linear,
    table: Arc<Table>,
}

impl Block {
    /// Parameters drawn from `seed` on `device` (an autodiff device for training), requiring
    /// gradients.
    pub fn new(cfg: BlockConfig, device: &Device, seed: u64) -> Self {
        assert!(
            cfg.heads > 0 && cfg.d_model.is_multiple_of(cfg.heads),
            "heads must divide d_model"
        );
        let mut rng = Rng::new(seed);
        let d = cfg.d_model;
        Self {
            cfg,
            ln1: Norm::new(d, device),
            q: Linear::new(&mut rng, d, d, device),
            k: Linear::new(&mut rng, d, d, device),
            v: Linear::new(&mut rng, d, d, device),
            o: Linear::new(&mut rng, d, d, device),
            ln2: Norm::new(d, device),
            up: Linear::new(&mut rng, d, cfg.d_ff, device),
            down: Linear::new(&mut rng, cfg.d_ff, d, device),
            table: gelu_table(2),
        }
    }

    /// The sizes.
    pub fn config(&self) -> BlockConfig {
        self.cfg
    }

    /// The 1-D parameters (γ, β, biases) and the 2-D ones (weights).
    pub fn parameters(&self) -> (Vec<Tensor<1>>, Vec<Tensor<2>>) {
        let mut vectors = Vec::new();
        let mut matrices = Vec::new();
        for n in [&self.ln1, &self.ln2] {
            vectors.push(n.gamma.clone());
            vectors.push(n.beta.clone());
        }
        for l in [&self.q, &self.k, &self.v, &self.o, &self.up, &self.down] {
            matrices.push(l.w.clone());
            vectors.push(l.b.clone());
        }
        (vectors, matrices)
    }

    /// `[batch, seq, d_model]` → `[batch, heads, seq, d_head]`.
    fn split(&self, x: Tensor<3>) -> Tensor<4> {
        let c = self.cfg;
        x.reshape([c.batch, c.seq, c.heads, c.d_model / c.heads])
            .swap_dims(1, 2)
    }

    /// The block's output for `x` (`[batch, seq, d_model]`); `stream` draws the lpmm-act dropout
    /// masks (the baseline draws them from the backend's generator).
    pub fn forward(&self, x: Tensor<3>, variant: Variant, stream: RandomStream) -> Tensor<3> {
        let c = self.cfg;
        let d_head = c.d_model / c.heads;
        // Attention.
        let h = self.ln1.forward(x.clone(), variant, c.eps);
        let q = self.split(self.q.forward(h.clone()));
        let k = self.split(self.k.forward(h.clone()));
        let v = self.split(self.v.forward(h));
        let scores = q
            .matmul(k.swap_dims(2, 3))
            .mul_scalar(1.0 / (d_head as f32).sqrt());
        let ctx = match variant {
            Variant::Baseline => {
                let probs = activation::softmax(scores, 3);
                let keep = 1.0 - f64::from(c.dropout);
                let mask = probs.random_like(Distribution::Bernoulli(keep));
                (probs * mask).mul_scalar(1.0 / keep).matmul(v)
            }
            Variant::LpmmUnfused => softmax_dropout(scores, c.dropout, &stream).matmul(v),
            Variant::Lpmm | Variant::LpmmFewBit | Variant::LpmmCompressed => {
                softmax_dropout_matmul(scores, v, c.dropout, &stream)
            }
        };
        let ctx = ctx.swap_dims(1, 2).reshape([c.batch, c.seq, c.d_model]);
        // The compressed projections draw from their own streams (tensor ids after the mask's).
        let compress = |k: u64| {
            (variant == Variant::LpmmCompressed)
                .then(|| RandomStream::new(stream.seed, stream.tensor.wrapping_add(k), stream.step))
        };
        let x = x + self.o.forward_with(ctx, compress(1));
        // MLP.
        let h = self.up.forward(self.ln2.forward(x.clone(), variant, c.eps));
        let h = match variant {
            Variant::Baseline => activation::gelu(h),
            Variant::LpmmUnfused | Variant::Lpmm => gelu_from_output(h),
            Variant::LpmmFewBit | Variant::LpmmCompressed => gelu_few_bit(h, &self.table),
        };
        x + self.down.forward_with(h, compress(2))
    }

    /// One training step's forward and backward pass: mean squared error against `target`, the
    /// gradients of every parameter read (and dropped). Returns the loss and the sum of the
    /// squared gradient entries.
    pub fn train_step(
        &self,
        x: &Tensor<3>,
        target: &Tensor<3>,
        variant: Variant,
        stream: RandomStream,
    ) -> (f32, f32) {
        let out = self.forward(x.clone(), variant, stream);
        let diff = out - target.clone();
        let loss = (diff.clone() * diff).mean();
        let grads = loss.backward();
        let sq = self.grad_square_sum(&grads);
        (loss.into_scalar::<f32>(), sq)
    }

    /// The sum of the squared entries of every parameter's gradient in `grads` (each read back).
    pub fn grad_square_sum(&self, grads: &Gradients) -> f32 {
        let (vectors, matrices) = self.parameters();
        let vectors = vectors.iter().filter_map(|p| p.grad(grads));
        let matrices = matrices.iter().filter_map(|p| p.grad(grads));
        vectors
            .map(|g| g.square().sum().into_scalar::<f32>())
            .sum::<f32>()
            + matrices
                .map(|g| g.square().sum().into_scalar::<f32>())
                .sum::<f32>()
    }
}
