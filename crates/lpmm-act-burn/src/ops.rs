//! The operators on burn-autodiff's primitives, generic over the inner backend `B` and the
//! checkpointing strategy `C`.
//!
//! Each one is a burn custom backward op (`Backward::prepare` → `compute_bound` → `stateful` →
//! `finish(state, output)`): what the graph keeps for the backward pass is exactly the `State`
//! type below, nothing is registered with the checkpointer, and the op is compute-bound so that no
//! strategy recomputes it (or keeps its input to do so). The kernels are the inner backend's
//! ([`ActBackend`]): lpmm-act's host kernels on burn-flex, CubeCL kernels on burn's cubecl
//! devices (no host read).
//!
//! | op | saved state (beside shapes and scalars) |
//! |---|---|
//! | [`few_bit`] ([`gelu_few_bit`]) | the packed `b`-bit codes of the input (`b / 8` bytes per element) |
//! | [`gelu_from_output`] | a handle to the output (shared with the next layer, which saves it anyway) and a 1-bit branch mask |
//! | [`layer_norm_from_output`] | a handle to the output (shared likewise), one f32 rstd per row (and `x̂` of the columns whose γ is below lpmm-act's guard in magnitude), handles to γ and β (parameters) |
//! | [`softmax_dropout`] | the softmax output (4 bytes per element) and a 1-bit keep mask; the dropout output is returned, not saved |
//! | [`matmul_compressed`] | the input compressed to 2, 4 or 8 bits per element (+ one f32 per block) and a handle to the weight |
//! | [`softmax_dropout_matmul`] | the softmax output, the 1-bit keep mask and a handle to `v` (its own input, the value projection); the dropout output is recomputed in the backward pass and never saved |
//!
//! The few-bit op takes any activation of [`FewBit`] (GELU, SiLU, tanh, sigmoid, ReLU) with its
//! table.

use std::sync::Arc;

use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};
use burn_backend::{Backend, DType, Shape, TensorMetadata, tensor::FloatTensor};
use lpmm_act::Table;
use lpmm_quant::{BlockSize, RandomStream};

pub use crate::kernels::{ActBackend, GELU_CHUNK, from_host, host_reads, to_host};

/// A float tensor of the autodiff backend over `B`.
pub type AdTensor<B, C> = FloatTensor<Autodiff<B, C>>;

// ---------------------------------------------------------------------------------------------
// Few-bit activations

/// The activation a few-bit op computes in its forward pass (the backend's own kernel); its
/// backward multiplies by the table's piecewise-constant derivative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FewBit {
    /// `x Φ(x)` (burn's GELU).
    Gelu,
    /// `x σ(x)`.
    Silu,
    /// `tanh x`.
    Tanh,
    /// `σ(x)`.
    Sigmoid,
    /// `max(x, 0)` (with [`Table::relu`] the backward is exact, 1 bit per element).
    Relu,
}

impl FewBit {
    /// The activation of `x` on backend `B`.
    fn apply<B: Backend>(self, x: FloatTensor<B>) -> FloatTensor<B> {
        match self {
            FewBit::Gelu => B::gelu(x),
            FewBit::Silu => B::float_mul(x.clone(), B::sigmoid(x)),
            FewBit::Tanh => B::float_tanh(x),
            FewBit::Sigmoid => B::sigmoid(x),
            FewBit::Relu => B::relu(x),
        }
    }
}

/// What a few-bit op saves: the table and the packed codes of the input.
#[derive(Debug, Clone)]
pub struct FewBitState<K> {
    table: Arc<Table>,
    codes: K,
    bytes: usize,
}

impl<K> FewBitState<K> {
    /// Bytes of the codes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[derive(Debug)]
struct FewBitOp;

impl<B: ActBackend> Backward<B, 1> for FewBitOp {
    type State = FewBitState<B::Codes>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let state = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::few_bit_backward(grad, &state.codes, &state.table)
        });
    }
}

/// `act` whose backward multiplies by `table`'s piecewise-constant derivative: the forward pass
/// is the backend's exact activation, the graph keeps only the packed `table.bits`-bit codes of
/// the input.
pub fn few_bit<B: ActBackend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    act: FewBit,
    table: Arc<Table>,
) -> AdTensor<B, C> {
    let (x, node) = x.into_parts();
    match FewBitOp.prepare::<C>([node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let codes = B::few_bit_encode(x.clone(), &table);
            let state = FewBitState {
                table,
                bytes: B::codes_bytes(&codes),
                codes,
            };
            prep.finish(state, act.apply::<B>(x))
        }
        OpsKind::UnTracked(prep) => prep.finish(act.apply::<B>(x)),
    }
}

/// [`few_bit`] GELU.
pub fn gelu_few_bit<B: ActBackend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    table: Arc<Table>,
) -> AdTensor<B, C> {
    few_bit::<B, C>(x, FewBit::Gelu, table)
}

// ---------------------------------------------------------------------------------------------
// GELU from its output

/// What [`gelu_from_output`] saves: a handle to its own output (the next layer's saved input:
/// sharing it costs nothing) and the branch mask.
#[derive(Debug, Clone)]
pub struct GeluOutputState<P, M> {
    output: P,
    mask: M,
    bytes: usize,
}

impl<P, M> GeluOutputState<P, M> {
    /// Bytes of the mask.
    pub fn mask_bytes(&self) -> usize {
        self.bytes
    }
}

#[derive(Debug)]
struct GeluFromOutput;

impl<B: ActBackend> Backward<B, 1> for GeluFromOutput {
    type State = GeluOutputState<FloatTensor<B>, B::Mask>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let GeluOutputState { output, mask, .. } = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::gelu_output_backward(grad, output, &mask)
        });
    }
}

/// Exact GELU whose backward recovers the input from the output and a 1-bit branch mask
/// (lpmm-act's `gelu_forward` / `gelu_backward_from_output` on the host).
pub fn gelu_from_output<B: ActBackend, C: CheckpointStrategy>(x: AdTensor<B, C>) -> AdTensor<B, C> {
    let (x, node) = x.into_parts();
    let (y, mask) = B::gelu_mask_forward(x);
    match GeluFromOutput
        .prepare::<C>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = GeluOutputState {
                output: y.clone(),
                bytes: B::mask_bytes(&mask),
                mask,
            };
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm from its output

/// What [`layer_norm_from_output`] saves: a handle to its output (shared with the next layer),
/// the backend's per-row statistics (one rstd per row, and the `x̂` of columns whose `|γ|` is
/// below lpmm-act's guard), and handles to γ and β, which are parameters and live anyway.
#[derive(Debug, Clone)]
pub struct LayerNormState<P, S> {
    output: P,
    gamma: P,
    beta: P,
    saved: S,
}

#[derive(Debug)]
struct LayerNormFromOutput;

impl<B: ActBackend> Backward<B, 3> for LayerNormFromOutput {
    type State = LayerNormState<FloatTensor<B>, B::LayerNormSaved>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let LayerNormState {
            output,
            gamma,
            beta,
            saved,
        } = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [px, pg, pb] = ops.parents;
        if px.is_none() && pg.is_none() && pb.is_none() {
            return;
        }
        let (dx, dg, db) = B::layer_norm_backward(grad, output, &saved, gamma, beta);
        if let Some(node) = px {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = pg {
            grads.register::<B>(node.id, dg);
        }
        if let Some(node) = pb {
            grads.register::<B>(node.id, db);
        }
    }
}

/// LayerNorm over the last dimension, `y = (x - mean) · rstd · γ + β`, whose backward works from
/// the output and one rstd per row (lpmm-act's `layernorm_forward` /
/// `layernorm_backward_from_output` on the host). γ and β have the last dimension's length.
pub fn layer_norm_from_output<B: ActBackend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    gamma: AdTensor<B, C>,
    beta: AdTensor<B, C>,
    eps: f32,
) -> AdTensor<B, C> {
    let (x, nx) = x.into_parts();
    let (gamma, ng) = gamma.into_parts();
    let (beta, nb) = beta.into_parts();
    let (y, saved) = B::layer_norm_forward(x, gamma.clone(), beta.clone(), eps);
    match LayerNormFromOutput
        .prepare::<C>([nx, ng, nb])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = LayerNormState {
                output: y.clone(),
                gamma,
                beta,
                saved,
            };
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

// ---------------------------------------------------------------------------------------------
// softmax · dropout

/// What [`softmax_dropout`] saves: the softmax output and the keep mask.
#[derive(Debug, Clone)]
pub struct SoftmaxDropoutState<P, M> {
    softmax: P,
    mask: M,
    p: f32,
}

#[derive(Debug)]
struct SoftmaxDropout;

impl<B: ActBackend> Backward<B, 1> for SoftmaxDropout {
    type State = SoftmaxDropoutState<FloatTensor<B>, B::Mask>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let SoftmaxDropoutState { softmax, mask, p } = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::softmax_dropout_backward(grad, softmax, &mask, p)
        });
    }
}

/// softmax over the last dimension, then dropout with drop probability `p` (kept values scaled by
/// `1 / (1 - p)`), the keep mask drawn from `stream` (element `i` uses its word `i`): the graph
/// keeps the softmax output and a 1-bit mask (lpmm-act's `softmax_dropout_forward` /
/// `softmax_dropout_backward` on the host).
pub fn softmax_dropout<B: ActBackend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    p: f32,
    stream: &RandomStream,
) -> AdTensor<B, C> {
    let (x, node) = x.into_parts();
    let (out, s, mask) = B::softmax_dropout_forward(x, p, stream);
    match SoftmaxDropout
        .prepare::<C>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = SoftmaxDropoutState {
                softmax: s,
                mask,
                p,
            };
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

// ---------------------------------------------------------------------------------------------
// softmax · dropout · matmul

/// What [`softmax_dropout_matmul`] saves: the softmax output, the keep mask and a handle to `v`.
#[derive(Debug, Clone)]
pub struct AttentionState<P, M> {
    softmax: P,
    mask: M,
    p: f32,
    v: P,
}

#[derive(Debug)]
struct SoftmaxDropoutMatmul;

impl<B: ActBackend> Backward<B, 2> for SoftmaxDropoutMatmul {
    type State = AttentionState<FloatTensor<B>, B::Mask>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let AttentionState {
            softmax,
            mask,
            p,
            v,
        } = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [p_scores, p_v] = ops.parents;
        if let Some(node) = p_v {
            // dv = dropout(s)ᵀ · dy, the dropout output recomputed from s and the mask.
            let out = B::dropout_apply(softmax.clone(), &mask, p);
            let dv = B::float_matmul(B::float_transpose(out), grad.clone());
            grads.register::<B>(node.id, dv);
        }
        if let Some(node) = p_scores {
            // d(dropout output) = dy · vᵀ, then softmax·dropout's backward.
            let d_out = B::float_matmul(grad, B::float_transpose(v));
            let dx = B::softmax_dropout_backward(d_out, softmax, &mask, p);
            grads.register::<B>(node.id, dx);
        }
    }
}

/// `dropout(softmax(scores)) · v` (softmax over the last dimension of `scores`, `[.., n, m]` times
/// `[.., m, k]`), fused so that the dropout output, which a separate matmul would save, is
/// recomputed from the softmax output and the 1-bit mask in the backward pass instead.
pub fn softmax_dropout_matmul<B: ActBackend, C: CheckpointStrategy>(
    scores: AdTensor<B, C>,
    v: AdTensor<B, C>,
    p: f32,
    stream: &RandomStream,
) -> AdTensor<B, C> {
    let (scores, ns) = scores.into_parts();
    let (v, nv) = v.into_parts();
    let (out, s, mask) = B::softmax_dropout_forward(scores, p, stream);
    match SoftmaxDropoutMatmul
        .prepare::<C>([ns, nv])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::float_matmul(out, v.clone());
            let state = AttentionState {
                softmax: s,
                mask,
                p,
                v,
            };
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::float_matmul(out, v)),
    }
}

// ---------------------------------------------------------------------------------------------
// matmul with a compressed saved input

/// What [`matmul_compressed`] saves: the input compressed, a handle to the weight (a parameter)
/// and the input's shape.
#[derive(Debug, Clone)]
pub struct CompressedState<P, K> {
    x: K,
    w: P,
    x_shape: Shape,
    x_dtype: DType,
    bytes: usize,
}

impl<P, K> CompressedState<P, K> {
    /// Bytes of the compressed input (codes and scales).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[derive(Debug)]
struct MatmulCompressed;

impl<B: ActBackend> Backward<B, 2> for MatmulCompressed {
    type State = CompressedState<FloatTensor<B>, B::Compressed>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let CompressedState {
            x,
            w,
            x_shape,
            x_dtype,
            ..
        } = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [px, pw] = ops.parents;
        let k = x_shape[x_shape.num_dims() - 1];
        let rows = x_shape.num_elements().checked_div(k).unwrap_or(0);
        let m = w.shape()[1];
        let dy = B::float_reshape(grad, Shape::new([rows, m]));
        if let Some(node) = pw {
            // dw = x̃ᵀ · dy, x̃ the decompressed input (an unbiased estimate of x).
            let mut xt = B::float_reshape(B::decompress(&x), Shape::new([rows, k]));
            if w.dtype() != DType::F32 {
                xt = B::float_cast(xt, w.dtype().into());
            }
            let dw = B::float_matmul(B::float_transpose(xt), dy.clone());
            grads.register::<B>(node.id, dw);
        }
        if let Some(node) = px {
            let dx = B::float_matmul(dy, B::float_transpose(w));
            let dx = B::float_reshape(dx, x_shape);
            let dx = if x_dtype == DType::F32 || x_dtype == dx.dtype() {
                dx
            } else {
                B::float_cast(dx, x_dtype.into())
            };
            grads.register::<B>(node.id, dx);
        }
    }
}

/// `x · w` (`x` of shape `[.., k]`, `w` of shape `[k, m]`) whose backward pass computes `dw`
/// from `x` compressed to `bits` (2, 4 or 8) per element in blocks of `block` with stochastic
/// rounding from `stream` (lpmm-act's `Compressed`: `dw` is an unbiased estimate); the graph keeps
/// the compressed input instead of `x`.
pub fn matmul_compressed<B: ActBackend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    w: AdTensor<B, C>,
    bits: u32,
    block: BlockSize,
    stream: &RandomStream,
) -> AdTensor<B, C> {
    let (x, nx) = x.into_parts();
    let (w, nw) = w.into_parts();
    let x_shape = x.shape();
    let (w_shape, dims) = (w.shape(), x_shape.num_dims());
    assert!(
        dims >= 1 && w_shape.num_dims() == 2 && w_shape[0] == x_shape[dims - 1],
        "matmul_compressed: x {x_shape:?} · w {w_shape:?} (w must be [k, m], x [.., k])"
    );
    let (k, m) = (w_shape[0], w_shape[1]);
    let rows = x_shape.num_elements().checked_div(k).unwrap_or(0);
    let mut y_shape = x_shape.clone();
    y_shape[dims - 1] = m;
    let forward = |x: FloatTensor<B>, w: FloatTensor<B>| {
        let y = B::float_matmul(B::float_reshape(x, Shape::new([rows, k])), w);
        B::float_reshape(y, y_shape.clone())
    };
    match MatmulCompressed
        .prepare::<C>([nx, nw])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let compressed = B::compress(x.clone(), bits, block, stream);
            let state = CompressedState {
                bytes: B::compressed_bytes(&compressed),
                x: compressed,
                w: w.clone(),
                x_dtype: x.dtype(),
                x_shape,
            };
            prep.finish(state, forward(x, w))
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x, w)),
    }
}
