//! The operators on burn-autodiff's primitives, generic over the inner backend `B` and the
//! checkpointing strategy `C`.
//!
//! Each one is a burn custom backward op (`Backward::prepare` → `compute_bound` → `stateful` →
//! `finish(state, output)`): what the graph keeps for the backward pass is exactly the `State`
//! type below, nothing is registered with the checkpointer, and the op is compute-bound so that no
//! strategy recomputes it (or keeps its input to do so). The lpmm-act kernels run on the host:
//! the tensors are read with `B::float_into_data` and written back with `B::float_from_data`,
//! which on burn-flex is a copy in the same memory (on a GPU, a round trip through the host).
//!
//! | op | saved state (beside shapes and scalars) |
//! |---|---|
//! | [`gelu_few_bit`] | the packed `b`-bit codes of the input (`b / 8` bytes per element) |
//! | [`gelu_from_output`] | a handle to the output (shared with the next layer, which saves it anyway) and a 1-bit branch mask (per 64 Ki-element chunk) |
//! | [`layer_norm_from_output`] | a handle to the output (shared likewise), one f32 rstd per row, handles to γ and β (parameters) |
//! | [`softmax_dropout`] | the softmax output (4 bytes per element) and a 1-bit keep mask; the dropout output is returned, not saved |
//! | [`softmax_dropout_matmul`] | the softmax output, the 1-bit keep mask and a handle to `v` (its own input, the value projection); the dropout output is recomputed in the backward pass and never saved |

use std::sync::Arc;

use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};
use burn_backend::{Backend, DType, Shape, TensorData, TensorMetadata, tensor::FloatTensor};
use lpmm_act::{BitMask, LayerNormSaved, Table};
use lpmm_quant::RandomStream;
use rayon::prelude::*;

/// A float tensor of the autodiff backend over `B`.
pub type AdTensor<B, C> = FloatTensor<Autodiff<B, C>>;

/// Reads a tensor of `B` to the host as f32.
pub fn to_host<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    let data = burn_backend::try_read_sync(B::float_into_data(t))
        .expect("the backend reads synchronously")
        .expect("the tensor can be read");
    data.try_into_vec_as::<f32>().expect("float data")
}

/// Writes host f32 values as a tensor of `B` with `shape` and `dtype` on `device`.
pub fn from_host<B: Backend>(
    values: Vec<f32>,
    shape: Shape,
    dtype: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    let data = TensorData::new(values, shape);
    let data = if dtype == DType::F32 {
        data
    } else {
        data.convert_dtype(dtype)
    };
    B::float_from_data(data, device)
}

/// `(rows, cols)` of a tensor seen as rows of its last dimension.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let dims = shape.num_dims();
    assert!(dims >= 1, "the operator needs at least one dimension");
    let cols = shape[dims - 1];
    let rows = shape.num_elements().checked_div(cols).unwrap_or(0);
    (rows, cols)
}

/// The gradient of a unary op from host values: `f(dy) -> dx`, same shape, dtype and device.
fn host_unary<B: Backend>(
    grad: FloatTensor<B>,
    f: impl FnOnce(&[f32]) -> Vec<f32>,
) -> FloatTensor<B> {
    let (shape, dtype, device) = (grad.shape(), grad.dtype(), grad.device());
    let dy = to_host::<B>(grad);
    from_host::<B>(f(&dy), shape, dtype, &device)
}

// ---------------------------------------------------------------------------------------------
// Few-bit GELU

/// What [`gelu_few_bit`] saves: the table and the packed codes of the input.
#[derive(Debug, Clone)]
pub struct FewBitState {
    table: Arc<Table>,
    packed: Arc<Vec<u8>>,
}

impl FewBitState {
    /// Bytes of the codes.
    pub fn bytes(&self) -> usize {
        self.packed.len()
    }
}

#[derive(Debug)]
struct FewBitGelu;

impl<B: Backend> Backward<B, 1> for FewBitGelu {
    type State = FewBitState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let state = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            host_unary::<B>(grad, |dy| {
                state
                    .table
                    .backward(dy, &state.packed)
                    .expect("the codes were packed for this many elements")
            })
        });
    }
}

/// GELU whose backward multiplies by `table`'s piecewise-constant derivative: the forward pass is
/// the backend's exact GELU, the graph keeps only the packed `table.bits`-bit codes of the input.
pub fn gelu_few_bit<B: Backend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    table: Arc<Table>,
) -> AdTensor<B, C> {
    let (x, node) = x.into_parts();
    match FewBitGelu.prepare::<C>([node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let packed = table.encode(&to_host::<B>(x.clone()));
            let state = FewBitState {
                table,
                packed: Arc::new(packed),
            };
            prep.finish(state, B::gelu(x))
        }
        OpsKind::UnTracked(prep) => prep.finish(B::gelu(x)),
    }
}

// ---------------------------------------------------------------------------------------------
// GELU from its output

/// Elements per chunk of the GELU-from-output kernels, which run chunks in parallel (each chunk
/// has its own mask: at most 7 bits of padding per chunk).
pub const GELU_CHUNK: usize = 1 << 16;

/// What [`gelu_from_output`] saves: a handle to its own output (the next layer's saved input:
/// sharing it costs nothing) and the branch mask, one [`BitMask`] per [`GELU_CHUNK`] elements.
#[derive(Debug, Clone)]
pub struct GeluOutputState<P> {
    output: P,
    masks: Arc<Vec<BitMask>>,
}

impl<P> GeluOutputState<P> {
    /// Bytes of the masks.
    pub fn mask_bytes(&self) -> usize {
        self.masks.iter().map(BitMask::bytes).sum()
    }
}

#[derive(Debug)]
struct GeluFromOutput;

impl<B: Backend> Backward<B, 1> for GeluFromOutput {
    type State = GeluOutputState<FloatTensor<B>>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let GeluOutputState { output, masks } = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let y = to_host::<B>(output);
            host_unary::<B>(grad, |dy| {
                let mut dx = vec![0f32; dy.len()];
                dx.par_chunks_mut(GELU_CHUNK)
                    .zip(dy.par_chunks(GELU_CHUNK))
                    .zip(y.par_chunks(GELU_CHUNK))
                    .zip(masks.par_iter())
                    .for_each(|(((dx, dy), y), mask)| {
                        let part = lpmm_act::gelu_backward_from_output(dy, y, mask)
                            .expect("output, gradient and mask have the same length");
                        dx.copy_from_slice(&part);
                    });
                dx
            })
        });
    }
}

/// Exact GELU whose backward recovers the input from the output and a 1-bit branch mask
/// (lpmm-act's `gelu_forward` / `gelu_backward_from_output`, on [`GELU_CHUNK`]-element chunks in
/// parallel).
pub fn gelu_from_output<B: Backend, C: CheckpointStrategy>(x: AdTensor<B, C>) -> AdTensor<B, C> {
    let (x, node) = x.into_parts();
    let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
    let mut x = to_host::<B>(x);
    let masks: Vec<BitMask> = x
        .par_chunks_mut(GELU_CHUNK)
        .map(|chunk| {
            let (y, mask) = lpmm_act::gelu_forward(chunk);
            chunk.copy_from_slice(&y);
            mask
        })
        .collect();
    let y = from_host::<B>(x, shape, dtype, &device);
    match GeluFromOutput
        .prepare::<C>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = GeluOutputState {
                output: y.clone(),
                masks: Arc::new(masks),
            };
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm from its output

/// What [`layer_norm_from_output`] saves: a handle to its output (shared with the next layer),
/// lpmm-act's per-row rstd (and the `x̂` of any column whose `|γ|` is below the guard), and
/// handles to γ and β, which are parameters and live anyway.
#[derive(Debug, Clone)]
pub struct LayerNormState<P> {
    output: P,
    gamma: P,
    beta: P,
    saved: LayerNormSaved,
}

#[derive(Debug)]
struct LayerNormFromOutput;

impl<B: Backend> Backward<B, 3> for LayerNormFromOutput {
    type State = LayerNormState<FloatTensor<B>>;

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
        let (shape, dtype, device) = (grad.shape(), grad.dtype(), grad.device());
        let (g_shape, g_dtype) = (gamma.shape(), gamma.dtype());
        let (b_shape, b_dtype) = (beta.shape(), beta.dtype());
        let dy = to_host::<B>(grad);
        let y = to_host::<B>(output);
        let (g, b) = (to_host::<B>(gamma), to_host::<B>(beta));
        let (dx, dg, db) = lpmm_act::layernorm_backward_from_output(&dy, &y, &saved, &g, &b)
            .expect("shapes were checked in the forward pass");
        if let Some(node) = px {
            grads.register::<B>(node.id, from_host::<B>(dx, shape, dtype, &device));
        }
        if let Some(node) = pg {
            grads.register::<B>(node.id, from_host::<B>(dg, g_shape, g_dtype, &device));
        }
        if let Some(node) = pb {
            grads.register::<B>(node.id, from_host::<B>(db, b_shape, b_dtype, &device));
        }
    }
}

/// LayerNorm over the last dimension, `y = (x - mean) · rstd · γ + β`, whose backward works from
/// the output and one rstd per row (lpmm-act's `layernorm_forward` /
/// `layernorm_backward_from_output`). γ and β have the last dimension's length.
pub fn layer_norm_from_output<B: Backend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    gamma: AdTensor<B, C>,
    beta: AdTensor<B, C>,
    eps: f32,
) -> AdTensor<B, C> {
    let (x, nx) = x.into_parts();
    let (gamma, ng) = gamma.into_parts();
    let (beta, nb) = beta.into_parts();
    let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
    let (rows, cols) = rows_cols(&shape);
    let (g, b) = (to_host::<B>(gamma.clone()), to_host::<B>(beta.clone()));
    let (y, saved) = lpmm_act::layernorm_forward(&to_host::<B>(x), &g, &b, rows, cols, eps)
        .unwrap_or_else(|e| panic!("layer_norm_from_output: {e}"));
    let y = from_host::<B>(y, shape, dtype, &device);
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
pub struct SoftmaxDropoutState<P> {
    softmax: P,
    mask: BitMask,
    p: f32,
}

#[derive(Debug)]
struct SoftmaxDropout;

impl<B: Backend> Backward<B, 1> for SoftmaxDropout {
    type State = SoftmaxDropoutState<FloatTensor<B>>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let SoftmaxDropoutState { softmax, mask, p } = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let (rows, cols) = rows_cols(&grad.shape());
            let s = to_host::<B>(softmax);
            host_unary::<B>(grad, |dy| {
                lpmm_act::softmax_dropout_backward(dy, &s, &mask, rows, cols, p)
                    .expect("shapes were checked in the forward pass")
            })
        });
    }
}

/// The forward kernel of both softmax·dropout ops: `(output, softmax, mask)` as tensors of `B`
/// (the output) and host values.
fn softmax_dropout_host<B: Backend>(
    x: FloatTensor<B>,
    p: f32,
    stream: &RandomStream,
) -> (Vec<f32>, Vec<f32>, BitMask) {
    let (rows, cols) = rows_cols(&x.shape());
    lpmm_act::softmax_dropout_forward(&to_host::<B>(x), rows, cols, p, stream)
        .unwrap_or_else(|e| panic!("softmax_dropout: {e}"))
}

/// softmax over the last dimension, then dropout with drop probability `p` (kept values scaled by
/// `1 / (1 - p)`), the keep mask drawn from `stream` (element `i` uses its word `i`): the graph
/// keeps the softmax output and a 1-bit mask (lpmm-act's `softmax_dropout_forward` /
/// `softmax_dropout_backward`).
pub fn softmax_dropout<B: Backend, C: CheckpointStrategy>(
    x: AdTensor<B, C>,
    p: f32,
    stream: &RandomStream,
) -> AdTensor<B, C> {
    let (x, node) = x.into_parts();
    let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
    let (out, s, mask) = softmax_dropout_host::<B>(x, p, stream);
    let out = from_host::<B>(out, shape.clone(), dtype, &device);
    match SoftmaxDropout
        .prepare::<C>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = SoftmaxDropoutState {
                softmax: from_host::<B>(s, shape, dtype, &device),
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
pub struct AttentionState<P> {
    softmax: P,
    mask: BitMask,
    p: f32,
    v: P,
}

#[derive(Debug)]
struct SoftmaxDropoutMatmul;

impl<B: Backend> Backward<B, 2> for SoftmaxDropoutMatmul {
    type State = AttentionState<FloatTensor<B>>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let AttentionState {
            softmax,
            mask,
            p,
            v,
        } = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [p_scores, p_v] = ops.parents;
        let (shape, dtype, device) = (softmax.shape(), softmax.dtype(), softmax.device());
        let (rows, cols) = rows_cols(&shape);
        let s = to_host::<B>(softmax);
        if let Some(node) = p_v {
            // dv = dropout(s)ᵀ · dy, the dropout output recomputed from s and the mask.
            let scale = 1.0 / (1.0 - p);
            let out: Vec<f32> = s
                .iter()
                .enumerate()
                .map(|(i, &v)| if mask.get(i) { v * scale } else { 0.0 })
                .collect();
            let out = from_host::<B>(out, shape.clone(), dtype, &device);
            let dv = B::float_matmul(B::float_transpose(out), grad.clone());
            grads.register::<B>(node.id, dv);
        }
        if let Some(node) = p_scores {
            // d(dropout output) = dy · vᵀ, then softmax·dropout's backward.
            let d_out = B::float_matmul(grad, B::float_transpose(v));
            let d_out = to_host::<B>(d_out);
            let dx = lpmm_act::softmax_dropout_backward(&d_out, &s, &mask, rows, cols, p)
                .expect("shapes were checked in the forward pass");
            grads.register::<B>(node.id, from_host::<B>(dx, shape, dtype, &device));
        }
    }
}

/// `dropout(softmax(scores)) · v` (softmax over the last dimension of `scores`, `[.., n, m]` times
/// `[.., m, k]`), fused so that the dropout output, which a separate matmul would save, is
/// recomputed from the softmax output and the 1-bit mask in the backward pass instead.
pub fn softmax_dropout_matmul<B: Backend, C: CheckpointStrategy>(
    scores: AdTensor<B, C>,
    v: AdTensor<B, C>,
    p: f32,
    stream: &RandomStream,
) -> AdTensor<B, C> {
    let (scores, ns) = scores.into_parts();
    let (v, nv) = v.into_parts();
    let (shape, dtype, device) = (scores.shape(), scores.dtype(), scores.device());
    let (out, s, mask) = softmax_dropout_host::<B>(scores, p, stream);
    let out = from_host::<B>(out, shape.clone(), dtype, &device);
    match SoftmaxDropoutMatmul
        .prepare::<C>([ns, nv])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::float_matmul(out, v.clone());
            let state = AttentionState {
                softmax: from_host::<B>(s, shape, dtype, &device),
                mask,
                p,
                v,
            };
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::float_matmul(out, v)),
    }
}
