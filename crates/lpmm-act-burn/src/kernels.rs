//! The operators' kernels, per backend: [`ActBackend`] is what [`crate::ops`] asks of the inner
//! backend, and what each backend keeps for the backward pass.
//!
//! - burn-flex ([`crate::Cpu`]): lpmm-act's host kernels, on the tensors' own memory (a read into
//!   host memory is a copy there).
//! - burn's cubecl backend ([`crate::Cube`], feature `wgpu`): CubeCL kernels in [`crate::cube`],
//!   run on the device, no host read; codes and masks stay device buffers.
//!
//! Both pack bits the same way (bit `i % 8` of byte `i / 8`, lpmm-act's packing; the device's
//! u32 words read as little-endian bytes) and draw the dropout mask from the same random words,
//! so [`ActBackend::read_codes`] and [`ActBackend::read_mask`] are equal byte for byte across
//! backends.

use std::cell::Cell;
use std::fmt::Debug;
use std::sync::Arc;

use burn_backend::{Backend, DType, Shape, TensorData, TensorMetadata, tensor::FloatTensor};
use lpmm_act::{BitMask, Compressed, LayerNormSaved, Table};
use lpmm_quant::{BlockSize, RandomStream};
use rayon::prelude::*;

/// Elements per chunk of the host GELU-from-output kernels, which run chunks in parallel (each
/// chunk has its own mask).
pub const GELU_CHUNK: usize = 1 << 16;

thread_local! {
    static HOST_READS: Cell<usize> = const { Cell::new(0) };
}

/// Tensors this thread's operators have read into host memory so far (each [`to_host`] call):
/// the device kernels read none.
pub fn host_reads() -> usize {
    HOST_READS.with(Cell::get)
}

/// Reads a tensor of `B` to the host as f32 (counted in [`host_reads`]).
pub fn to_host<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    HOST_READS.with(|c| c.set(c.get() + 1));
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

/// `(rows, cols)` of a shape seen as rows of its last dimension.
pub(crate) fn rows_cols(shape: &Shape) -> (usize, usize) {
    let dims = shape.num_dims();
    assert!(dims >= 1, "the operator needs at least one dimension");
    let cols = shape[dims - 1];
    let rows = shape.num_elements().checked_div(cols).unwrap_or(0);
    (rows, cols)
}

/// Panics unless `p` is a drop probability in `[0, 1)` (lpmm-act's check, as the op's message).
pub(crate) fn check_p(p: f32) {
    if !(0.0..1.0).contains(&p) {
        panic!("softmax_dropout: {}", lpmm_act::ActError::Probability(p));
    }
}

/// What the operators need of a backend: each kernel pair and the state it keeps between them.
pub trait ActBackend: Backend {
    /// Few-bit codes as this backend keeps them.
    type Codes: Clone + Debug + Send + Sync + 'static;
    /// A bit mask (GELU's branch, dropout's keep) as this backend keeps it.
    type Mask: Clone + Debug + Send + Sync + 'static;
    /// What LayerNorm's backward needs besides its output, γ and β.
    type LayerNormSaved: Clone + Debug + Send + Sync + 'static;
    /// A compressed tensor.
    type Compressed: Clone + Debug + Send + Sync + 'static;

    /// The packed `table.bits`-bit codes of `x`.
    fn few_bit_encode(x: FloatTensor<Self>, table: &Table) -> Self::Codes;
    /// `dy · table.levels[code]`.
    fn few_bit_backward(
        dy: FloatTensor<Self>,
        codes: &Self::Codes,
        table: &Table,
    ) -> FloatTensor<Self>;
    /// GELU's output and its branch mask.
    fn gelu_mask_forward(x: FloatTensor<Self>) -> (FloatTensor<Self>, Self::Mask);
    /// GELU's input gradient from its output and branch mask.
    fn gelu_output_backward(
        dy: FloatTensor<Self>,
        y: FloatTensor<Self>,
        mask: &Self::Mask,
    ) -> FloatTensor<Self>;
    /// LayerNorm over the last dimension and what its backward needs.
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, Self::LayerNormSaved);
    /// LayerNorm's `(dx, dγ, dβ)` from its output.
    fn layer_norm_backward(
        dy: FloatTensor<Self>,
        y: FloatTensor<Self>,
        saved: &Self::LayerNormSaved,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// softmax over the last dimension then dropout: `(output, softmax, keep mask)`.
    fn softmax_dropout_forward(
        x: FloatTensor<Self>,
        p: f32,
        stream: &RandomStream,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, Self::Mask);
    /// softmax·dropout's input gradient from the softmax output and the keep mask.
    fn softmax_dropout_backward(
        dy: FloatTensor<Self>,
        s: FloatTensor<Self>,
        mask: &Self::Mask,
        p: f32,
    ) -> FloatTensor<Self>;
    /// The dropout output recomputed from the softmax output and the keep mask.
    fn dropout_apply(s: FloatTensor<Self>, mask: &Self::Mask, p: f32) -> FloatTensor<Self>;
    /// `x` compressed to `bits` (2, 4 or 8) per element in blocks of `block`, rounded
    /// stochastically with `stream`'s draws (lpmm-act's `Compressed`).
    fn compress(
        x: FloatTensor<Self>,
        bits: u32,
        block: BlockSize,
        stream: &RandomStream,
    ) -> Self::Compressed;
    /// The decompressed tensor (its shape and device as compressed, f32).
    fn decompress(c: &Self::Compressed) -> FloatTensor<Self>;

    /// Bytes the codes hold.
    fn codes_bytes(codes: &Self::Codes) -> usize;
    /// Bytes the mask holds.
    fn mask_bytes(mask: &Self::Mask) -> usize;
    /// Bytes LayerNorm's saved state holds.
    fn layer_norm_saved_bytes(saved: &Self::LayerNormSaved) -> usize;
    /// Bytes a compressed tensor holds (codes and scales).
    fn compressed_bytes(c: &Self::Compressed) -> usize;
    /// The codes of `len` elements in lpmm-act's packing (a host read, for checks).
    fn read_codes(codes: &Self::Codes, len: usize, bits: u32) -> Vec<u8>;
    /// The mask of `len` elements, one bit each (a host read, for checks).
    fn read_mask(mask: &Self::Mask, len: usize) -> Vec<u8>;
}

/// A tensor compressed on the host, with the shape and device it decompresses to.
#[derive(Debug, Clone)]
pub struct HostCompressed {
    inner: Arc<Compressed>,
    shape: Shape,
    device: <crate::Cpu as burn_backend::BackendTypes>::Device,
}

/// A host bit mask as the host kernels make it: one [`BitMask`] per chunk.
pub type HostMask = Arc<Vec<BitMask>>;

/// `f` applied to a tensor's host values: a tensor of the same shape, dtype and device.
fn host_unary<B: Backend>(
    grad: FloatTensor<B>,
    f: impl FnOnce(&[f32]) -> Vec<f32>,
) -> FloatTensor<B> {
    let (shape, dtype, device) = (grad.shape(), grad.dtype(), grad.device());
    let dy = to_host::<B>(grad);
    from_host::<B>(f(&dy), shape, dtype, &device)
}

/// Chunked masks as one mask of `len` bits in lpmm-act's packing.
fn mask_to_bytes(masks: &[BitMask], len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len.div_ceil(8)];
    let mut i = 0;
    for m in masks {
        for k in 0..m.len() {
            if m.get(k) {
                out[i / 8] |= 1 << (i % 8);
            }
            i += 1;
        }
    }
    out
}

impl ActBackend for crate::Cpu {
    type Codes = Arc<Vec<u8>>;
    type Mask = HostMask;
    type LayerNormSaved = LayerNormSaved;
    type Compressed = HostCompressed;

    fn few_bit_encode(x: FloatTensor<Self>, table: &Table) -> Self::Codes {
        Arc::new(table.encode(&to_host::<Self>(x)))
    }

    fn few_bit_backward(
        dy: FloatTensor<Self>,
        codes: &Self::Codes,
        table: &Table,
    ) -> FloatTensor<Self> {
        host_unary::<Self>(dy, |dy| {
            table
                .backward(dy, codes)
                .expect("the codes were packed for this many elements")
        })
    }

    fn gelu_mask_forward(x: FloatTensor<Self>) -> (FloatTensor<Self>, Self::Mask) {
        let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
        let mut x = to_host::<Self>(x);
        let masks: Vec<BitMask> = x
            .par_chunks_mut(GELU_CHUNK)
            .map(|chunk| {
                let (y, mask) = lpmm_act::gelu_forward(chunk);
                chunk.copy_from_slice(&y);
                mask
            })
            .collect();
        (from_host::<Self>(x, shape, dtype, &device), Arc::new(masks))
    }

    fn gelu_output_backward(
        dy: FloatTensor<Self>,
        y: FloatTensor<Self>,
        mask: &Self::Mask,
    ) -> FloatTensor<Self> {
        let y = to_host::<Self>(y);
        host_unary::<Self>(dy, |dy| {
            let mut dx = vec![0f32; dy.len()];
            dx.par_chunks_mut(GELU_CHUNK)
                .zip(dy.par_chunks(GELU_CHUNK))
                .zip(y.par_chunks(GELU_CHUNK))
                .zip(mask.par_iter())
                .for_each(|(((dx, dy), y), mask)| {
                    let part = lpmm_act::gelu_backward_from_output(dy, y, mask)
                        .expect("output, gradient and mask have the same length");
                    dx.copy_from_slice(&part);
                });
            dx
        })
    }

    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, Self::LayerNormSaved) {
        let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
        let (rows, cols) = rows_cols(&shape);
        let (g, b) = (to_host::<Self>(gamma), to_host::<Self>(beta));
        let (y, saved) = lpmm_act::layernorm_forward(&to_host::<Self>(x), &g, &b, rows, cols, eps)
            .unwrap_or_else(|e| panic!("layer_norm_from_output: {e}"));
        (from_host::<Self>(y, shape, dtype, &device), saved)
    }

    fn layer_norm_backward(
        dy: FloatTensor<Self>,
        y: FloatTensor<Self>,
        saved: &Self::LayerNormSaved,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (shape, dtype, device) = (dy.shape(), dy.dtype(), dy.device());
        let (g_shape, g_dtype) = (gamma.shape(), gamma.dtype());
        let (b_shape, b_dtype) = (beta.shape(), beta.dtype());
        let dy = to_host::<Self>(dy);
        let y = to_host::<Self>(y);
        let (g, b) = (to_host::<Self>(gamma), to_host::<Self>(beta));
        let (dx, dg, db) = lpmm_act::layernorm_backward_from_output(&dy, &y, saved, &g, &b)
            .expect("shapes were checked in the forward pass");
        (
            from_host::<Self>(dx, shape, dtype, &device),
            from_host::<Self>(dg, g_shape, g_dtype, &device),
            from_host::<Self>(db, b_shape, b_dtype, &device),
        )
    }

    fn softmax_dropout_forward(
        x: FloatTensor<Self>,
        p: f32,
        stream: &RandomStream,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, Self::Mask) {
        let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
        let (rows, cols) = rows_cols(&shape);
        let (out, s, mask) =
            lpmm_act::softmax_dropout_forward(&to_host::<Self>(x), rows, cols, p, stream)
                .unwrap_or_else(|e| panic!("softmax_dropout: {e}"));
        (
            from_host::<Self>(out, shape.clone(), dtype, &device),
            from_host::<Self>(s, shape, dtype, &device),
            Arc::new(vec![mask]),
        )
    }

    fn softmax_dropout_backward(
        dy: FloatTensor<Self>,
        s: FloatTensor<Self>,
        mask: &Self::Mask,
        p: f32,
    ) -> FloatTensor<Self> {
        let (rows, cols) = rows_cols(&dy.shape());
        let s = to_host::<Self>(s);
        host_unary::<Self>(dy, |dy| {
            lpmm_act::softmax_dropout_backward(dy, &s, &mask[0], rows, cols, p)
                .expect("shapes were checked in the forward pass")
        })
    }

    fn dropout_apply(s: FloatTensor<Self>, mask: &Self::Mask, p: f32) -> FloatTensor<Self> {
        let scale = 1.0 / (1.0 - p);
        host_unary::<Self>(s, |s| {
            s.iter()
                .enumerate()
                .map(|(i, &v)| if mask[0].get(i) { v * scale } else { 0.0 })
                .collect()
        })
    }

    fn compress(
        x: FloatTensor<Self>,
        bits: u32,
        block: BlockSize,
        stream: &RandomStream,
    ) -> Self::Compressed {
        let (shape, device) = (x.shape(), x.device());
        let c = Compressed::new(&to_host::<Self>(x), bits, block, *stream)
            .unwrap_or_else(|e| panic!("compressing a saved tensor: {e}"));
        HostCompressed {
            inner: Arc::new(c),
            shape,
            device,
        }
    }

    fn decompress(c: &Self::Compressed) -> FloatTensor<Self> {
        from_host::<Self>(c.inner.decompress(), c.shape.clone(), DType::F32, &c.device)
    }

    fn codes_bytes(codes: &Self::Codes) -> usize {
        codes.len()
    }

    fn mask_bytes(mask: &Self::Mask) -> usize {
        mask.iter().map(BitMask::bytes).sum()
    }

    fn layer_norm_saved_bytes(saved: &Self::LayerNormSaved) -> usize {
        saved.bytes()
    }

    fn compressed_bytes(c: &Self::Compressed) -> usize {
        c.inner.bytes()
    }

    fn read_codes(codes: &Self::Codes, len: usize, bits: u32) -> Vec<u8> {
        codes[..(len * bits as usize).div_ceil(8)].to_vec()
    }

    fn read_mask(mask: &Self::Mask, len: usize) -> Vec<u8> {
        mask_to_bytes(mask, len)
    }
}
