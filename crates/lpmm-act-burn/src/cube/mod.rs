//! The operators on burn's cubecl backend ([`crate::Cube`]: wgpu, CUDA and every cubecl runtime):
//! CubeCL kernels ([`kernels`]) launched on the tensors' own device buffers, no host read.
//!
//! burn's fusion stream is drained for the inputs (`resolve_tensor_float`: the queued operations
//! are submitted, nothing waits for the device), the kernels are launched on the resolved cube
//! tensors, and the outputs are registered back with fusion as new tensors. Codes, masks and
//! LayerNorm's rows statistics stay device buffers (cube tensors held by the autodiff graph).
//!
//! Where the host kernels compute in f64 (GELU and its inversion, LayerNorm's moments,
//! softmax's sum) these compute in f32, with CubeCL's `erf` (an approximation to 1.5e-7): the
//! values agree with the host kernels within the bounds `tests/gradients/device.rs` states; codes, masks
//! and packing are bit for bit the host's.

// CubeCL's kernel language has indexed loops and shifts, not iterators and `rotate_left`.
#[allow(clippy::needless_range_loop, clippy::manual_rotate)]
pub mod kernels;

use burn_backend::{DType, Shape, TensorMetadata, ops::FloatTensorOps, tensor::FloatTensor};
use burn_cubecl::cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};
use burn_cubecl::{CubeBackend, kernel::into_contiguous, tensor::CubeTensor};
use burn_fusion::{NoOp, stream::StreamId};
use burn_ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};
use lpmm_act::Table;
use lpmm_act::tempo::{GAMMA_GUARD, GELU_ARGMIN};
use lpmm_formats::CodeMap;
use lpmm_quant::{BlockSize, RandomStream};

use crate::Cube;
use crate::kernels::{ActBackend, check_p, rows_cols};

/// A float tensor of [`Cube`] (burn's fusion tensor).
type Tensor = FloatTensor<Cube>;

/// Columns per row whose `x̂` LayerNorm's forward pass saves where `|γ| <` [`GAMMA_GUARD`]: the
/// output cannot give them back. A row with more such columns gets NaN gradients (the host
/// kernels have no such cap).
pub const GUARDED_COLUMNS: u32 = 8;

/// The smallest f32 at or above GELU's minimum: `x >= argmin_f32()` exactly when
/// `f64::from(x) >= GELU_ARGMIN`, the host kernels' branch test.
fn argmin_f32() -> f32 {
    let t = GELU_ARGMIN as f32;
    if f64::from(t) < GELU_ARGMIN {
        t.next_up()
    } else {
        t
    }
}

/// The device buffer of `t` as a contiguous f32 cube tensor (fusion's queue drained).
fn resolve(t: Tensor) -> CubeTensor {
    let t = if t.dtype() == DType::F32 {
        t
    } else {
        Cube::float_cast(t, DType::F32.into())
    };
    let client = t.client.clone();
    let c = client.resolve_tensor_float::<CubeBackend>(t);
    if c.is_contiguous() {
        c
    } else {
        into_contiguous(c)
    }
}

/// The fusion client of a [`Cube`] device.
type FusionClient = burn_fusion::Client<burn_cubecl::fusion::FusionCubeRuntime>;

/// A new fusion tensor holding the f32 cube tensor `c`, cast to `dtype`.
fn wrap(c: CubeTensor, like: &Tensor, dtype: DType) -> Tensor {
    wrap_with(c, &like.client, dtype)
}

/// [`wrap`] with the device's fusion client.
fn wrap_with(c: CubeTensor, client: &FusionClient, dtype: DType) -> Tensor {
    let shape = c.shape();
    let handle = CubeBackend::float_tensor_handle(c);
    let desc = InitOperationIr::create(shape, DType::F32, || client.register_tensor_handle(handle));
    let t: Tensor = client
        .register(
            StreamId::current(),
            OperationIr::Init(desc),
            NoOp::<CubeBackend>::new(),
        )
        .output();
    if dtype == DType::F32 {
        t
    } else {
        Cube::float_cast(t, dtype.into())
    }
}

/// An uninitialised contiguous cube tensor of `shape` and `dtype` beside `like`.
fn empty(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    let bytes = (shape.num_elements() * dtype.size()).max(4);
    let handle = like.client.empty(bytes);
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        handle,
        dtype,
    )
}

/// `values` uploaded beside `like` (a host write).
fn upload_f32(like: &CubeTensor, values: &[f32]) -> CubeTensor {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    upload(like, &bytes, values.len(), DType::F32)
}

fn upload(like: &CubeTensor, bytes: &[u8], len: usize, dtype: DType) -> CubeTensor {
    let handle = like.client.create_from_slice(bytes);
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::new([len]),
        handle,
        dtype,
    )
}

/// Launch geometry for `units` threads.
fn grid(c: &CubeTensor, units: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&c.client, units);
    (calculate_cube_count_elemwise(&c.client, units, dim), dim)
}

/// Elements as a u32 kernel argument (the kernels index with u32 counts).
fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| {
        panic!("lpmm-act-burn's device kernels take up to 2^32 - 1 elements, not {n}")
    })
}

/// A tensor compressed on the device: packed codes, one absmax per block, the map's values.
#[derive(Clone)]
pub struct CubeCompressed {
    words: CubeTensor,
    absmax: CubeTensor,
    values: CubeTensor,
    bits: u32,
    block: usize,
    shape: Shape,
    /// The device's fusion client (which registers the decompressed tensor; not a tensor, which
    /// would keep the uncompressed input alive).
    client: FusionClient,
}

impl std::fmt::Debug for CubeCompressed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CubeCompressed")
            .field("bits", &self.bits)
            .field("block", &self.block)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

/// What [`Cube`]'s LayerNorm keeps: one rstd per row and `x̂` of the guarded columns.
#[derive(Debug, Clone)]
pub struct CubeLayerNormSaved {
    rstd: CubeTensor,
    xhat: CubeTensor,
    cols: usize,
}

impl ActBackend for Cube {
    type Codes = CubeTensor;
    type Mask = CubeTensor;
    type LayerNormSaved = CubeLayerNormSaved;
    type Compressed = CubeCompressed;

    fn few_bit_encode(x: Tensor, table: &Table) -> Self::Codes {
        let x = resolve(x);
        let n = x.shape().num_elements();
        let bits = table.bits;
        let words = n.div_ceil(32) * bits as usize;
        let out = empty(&x, Shape::new([words]), DType::U32);
        let thresholds = upload_f32(&x, &table.thresholds);
        if words > 0 {
            let (cubes, dim) = grid(&x, n.div_ceil(32));
            kernels::few_bit_encode::launch(
                &x.client.clone(),
                cubes,
                dim,
                x.into_buffer_arg(),
                thresholds.into_buffer_arg(),
                out.clone().into_buffer_arg(),
                count(n),
                bits,
            );
        }
        out
    }

    fn few_bit_backward(dy: Tensor, codes: &Self::Codes, table: &Table) -> Tensor {
        let dtype = dy.dtype();
        let like = dy.clone();
        let dy = resolve(dy);
        let n = dy.shape().num_elements();
        let dx = empty(&dy, dy.shape(), DType::F32);
        let levels = upload_f32(&dy, &table.levels);
        if n > 0 {
            let (cubes, dim) = grid(&dy, n);
            kernels::few_bit_backward::launch(
                &dy.client.clone(),
                cubes,
                dim,
                dy.into_buffer_arg(),
                codes.clone().into_buffer_arg(),
                levels.into_buffer_arg(),
                dx.clone().into_buffer_arg(),
                table.bits,
            );
        }
        wrap(dx, &like, dtype)
    }

    fn gelu_mask_forward(x: Tensor) -> (Tensor, Self::Mask) {
        let dtype = x.dtype();
        let like = x.clone();
        let x = resolve(x);
        let n = x.shape().num_elements();
        let y = empty(&x, x.shape(), DType::F32);
        let mask = empty(&x, Shape::new([n.div_ceil(32)]), DType::U32);
        if n > 0 {
            let (cubes, dim) = grid(&x, n.div_ceil(32));
            kernels::gelu_forward::launch(
                &x.client.clone(),
                cubes,
                dim,
                x.into_buffer_arg(),
                y.clone().into_buffer_arg(),
                mask.clone().into_buffer_arg(),
                argmin_f32(),
            );
        }
        (wrap(y, &like, dtype), mask)
    }

    fn gelu_output_backward(dy: Tensor, y: Tensor, mask: &Self::Mask) -> Tensor {
        let dtype = dy.dtype();
        let like = dy.clone();
        let (dy, y) = (resolve(dy), resolve(y));
        let n = dy.shape().num_elements();
        let dx = empty(&dy, dy.shape(), DType::F32);
        if n > 0 {
            let ymin = lpmm_act::Activation::Gelu.value(GELU_ARGMIN) as f32;
            let (cubes, dim) = grid(&dy, n);
            kernels::gelu_backward::launch(
                &dy.client.clone(),
                cubes,
                dim,
                dy.into_buffer_arg(),
                y.into_buffer_arg(),
                mask.clone().into_buffer_arg(),
                dx.clone().into_buffer_arg(),
                argmin_f32(),
                ymin,
            );
        }
        wrap(dx, &like, dtype)
    }

    fn layer_norm_forward(
        x: Tensor,
        gamma: Tensor,
        beta: Tensor,
        eps: f32,
    ) -> (Tensor, Self::LayerNormSaved) {
        let dtype = x.dtype();
        let like = x.clone();
        let (rows, cols) = rows_cols(&x.shape());
        let (gn, bn) = (gamma.shape().num_elements(), beta.shape().num_elements());
        if gn != cols || bn != cols {
            panic!(
                "layer_norm_from_output: γ has {gn} and β {bn} elements, the last dimension {cols}"
            );
        }
        let (x, gamma, beta) = (resolve(x), resolve(gamma), resolve(beta));
        let y = empty(&x, x.shape(), DType::F32);
        let rstd = empty(&x, Shape::new([rows]), DType::F32);
        let cap = GUARDED_COLUMNS.min(count(cols));
        let xhat = empty(&x, Shape::new([rows * cap as usize]), DType::F32);
        if rows > 0 && cols > 0 {
            let (cubes, dim) = grid(&x, rows);
            kernels::layer_norm_forward::launch(
                &x.client.clone(),
                cubes,
                dim,
                x.into_buffer_arg(),
                gamma.into_buffer_arg(),
                beta.into_buffer_arg(),
                y.clone().into_buffer_arg(),
                rstd.clone().into_buffer_arg(),
                xhat.clone().into_buffer_arg(),
                count(cols),
                eps,
                GAMMA_GUARD,
                cap,
            );
        }
        (
            wrap(y, &like, dtype),
            CubeLayerNormSaved { rstd, xhat, cols },
        )
    }

    fn layer_norm_backward(
        dy: Tensor,
        y: Tensor,
        saved: &Self::LayerNormSaved,
        gamma: Tensor,
        beta: Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let (dtype, g_dtype, b_dtype) = (dy.dtype(), gamma.dtype(), beta.dtype());
        let like = dy.clone();
        let (rows, cols) = rows_cols(&dy.shape());
        let (dy, y) = (resolve(dy), resolve(y));
        let (gamma, beta) = (resolve(gamma), resolve(beta));
        let dx = empty(&dy, dy.shape(), DType::F32);
        let dgamma = empty(&dy, gamma.shape(), DType::F32);
        let dbeta = empty(&dy, beta.shape(), DType::F32);
        let cap = GUARDED_COLUMNS.min(count(saved.cols));
        if rows > 0 && cols > 0 {
            let client = dy.client.clone();
            let (cubes, dim) = grid(&dy, rows);
            kernels::layer_norm_backward_dx::launch(
                &client,
                cubes,
                dim,
                dy.clone().into_buffer_arg(),
                y.clone().into_buffer_arg(),
                gamma.clone().into_buffer_arg(),
                beta.clone().into_buffer_arg(),
                saved.rstd.clone().into_buffer_arg(),
                saved.xhat.clone().into_buffer_arg(),
                dx.clone().into_buffer_arg(),
                count(cols),
                GAMMA_GUARD,
                cap,
                f32::NAN,
            );
            let (cubes, dim) = grid(&dy, cols);
            kernels::layer_norm_backward_params::launch(
                &client,
                cubes,
                dim,
                dy.into_buffer_arg(),
                y.into_buffer_arg(),
                gamma.into_buffer_arg(),
                beta.into_buffer_arg(),
                saved.xhat.clone().into_buffer_arg(),
                dgamma.clone().into_buffer_arg(),
                dbeta.clone().into_buffer_arg(),
                count(rows),
                GAMMA_GUARD,
                cap,
                f32::NAN,
            );
        }
        (
            wrap(dx, &like, dtype),
            wrap(dgamma, &like, g_dtype),
            wrap(dbeta, &like, b_dtype),
        )
    }

    fn softmax_dropout_forward(
        x: Tensor,
        p: f32,
        stream: &RandomStream,
    ) -> (Tensor, Tensor, Self::Mask) {
        check_p(p);
        let dtype = x.dtype();
        let like = x.clone();
        let (rows, cols) = rows_cols(&x.shape());
        let x = resolve(x);
        let n = rows * cols;
        let mask = empty(&x, Shape::new([n.div_ceil(32)]), DType::U32);
        let out = empty(&x, x.shape(), DType::F32);
        let s = empty(&x, x.shape(), DType::F32);
        if n > 0 {
            let client = x.client.clone();
            // lpmm-act's cut: keep where the word is at or above p · 2^32 (p < 1: it fits).
            let cut = (f64::from(p) * 4_294_967_296.0) as u64;
            let cut = u32::try_from(cut).expect("p < 1");
            let key = stream_key(stream);
            let key = upload(&x, &key, 10, DType::U32);
            let (cubes, dim) = grid(&x, n.div_ceil(32));
            kernels::dropout_mask::launch(
                &client,
                cubes,
                dim,
                key.into_buffer_arg(),
                mask.clone().into_buffer_arg(),
                count(n),
                cut,
            );
            let (cubes, dim) = grid(&x, rows);
            kernels::softmax_dropout_forward::launch(
                &client,
                cubes,
                dim,
                x.into_buffer_arg(),
                mask.clone().into_buffer_arg(),
                out.clone().into_buffer_arg(),
                s.clone().into_buffer_arg(),
                count(cols),
                1.0 / (1.0 - p),
            );
        }
        (wrap(out, &like, dtype), wrap(s, &like, dtype), mask)
    }

    fn softmax_dropout_backward(dy: Tensor, s: Tensor, mask: &Self::Mask, p: f32) -> Tensor {
        let dtype = dy.dtype();
        let like = dy.clone();
        let (rows, cols) = rows_cols(&dy.shape());
        let (dy, s) = (resolve(dy), resolve(s));
        let dx = empty(&dy, dy.shape(), DType::F32);
        if rows * cols > 0 {
            let (cubes, dim) = grid(&dy, rows);
            kernels::softmax_dropout_backward::launch(
                &dy.client.clone(),
                cubes,
                dim,
                dy.into_buffer_arg(),
                s.into_buffer_arg(),
                mask.clone().into_buffer_arg(),
                dx.clone().into_buffer_arg(),
                count(cols),
                1.0 / (1.0 - p),
            );
        }
        wrap(dx, &like, dtype)
    }

    fn dropout_apply(s: Tensor, mask: &Self::Mask, p: f32) -> Tensor {
        let dtype = s.dtype();
        let like = s.clone();
        let s = resolve(s);
        let n = s.shape().num_elements();
        let out = empty(&s, s.shape(), DType::F32);
        if n > 0 {
            let (cubes, dim) = grid(&s, n);
            kernels::dropout_apply::launch(
                &s.client.clone(),
                cubes,
                dim,
                s.into_buffer_arg(),
                mask.clone().into_buffer_arg(),
                out.clone().into_buffer_arg(),
                1.0 / (1.0 - p),
            );
        }
        wrap(out, &like, dtype)
    }

    fn compress(x: Tensor, bits: u32, block: BlockSize, stream: &RandomStream) -> Self::Compressed {
        let like = x.clone();
        let x = resolve(x);
        let n = x.shape().num_elements();
        let map = CodeMap::linear_signed(bits)
            .ok()
            .filter(|_| matches!(bits, 2 | 4 | 8))
            .unwrap_or_else(|| panic!("compressing a saved tensor: 2, 4 or 8 bits, not {bits}"));
        let b = block.get();
        let values = upload_f32(&x, map.values());
        let words = empty(&x, Shape::new([n.div_ceil(32) * bits as usize]), DType::U32);
        let absmax = empty(&x, Shape::new([n.div_ceil(b)]), DType::F32);
        if n > 0 {
            let client = x.client.clone();
            let (cubes, dim) = grid(&x, n.div_ceil(b));
            kernels::block_absmax::launch(
                &client,
                cubes,
                dim,
                x.clone().into_buffer_arg(),
                absmax.clone().into_buffer_arg(),
                count(b),
                f32::NAN,
            );
            let key = upload(&x, &stream_key(stream), 10, DType::U32);
            let (cubes, dim) = grid(&x, n.div_ceil(32));
            kernels::compress::launch(
                &client,
                cubes,
                dim,
                x.clone().into_buffer_arg(),
                absmax.clone().into_buffer_arg(),
                values.clone().into_buffer_arg(),
                key.into_buffer_arg(),
                words.clone().into_buffer_arg(),
                count(n),
                count(b),
                (1u32 << (bits - 1)) - 1,
                bits,
            );
        }
        CubeCompressed {
            words,
            absmax,
            values,
            bits,
            block: b,
            shape: x.shape(),
            client: like.client.clone(),
        }
    }

    fn decompress(c: &Self::Compressed) -> Tensor {
        let out = empty(&c.words, c.shape.clone(), DType::F32);
        let n = c.shape.num_elements();
        if n > 0 {
            let (cubes, dim) = grid(&c.words, n);
            kernels::decompress::launch(
                &c.words.client.clone(),
                cubes,
                dim,
                c.words.clone().into_buffer_arg(),
                c.absmax.clone().into_buffer_arg(),
                c.values.clone().into_buffer_arg(),
                out.clone().into_buffer_arg(),
                count(c.block),
                c.bits,
            );
        }
        wrap_with(out, &c.client, DType::F32)
    }

    fn compressed_bytes(c: &Self::Compressed) -> usize {
        4 * (c.words.shape().num_elements() + c.absmax.shape().num_elements())
    }

    fn codes_bytes(codes: &Self::Codes) -> usize {
        4 * codes.shape().num_elements()
    }

    fn mask_bytes(mask: &Self::Mask) -> usize {
        4 * mask.shape().num_elements()
    }

    fn layer_norm_saved_bytes(saved: &Self::LayerNormSaved) -> usize {
        4 * (saved.rstd.shape().num_elements() + saved.xhat.shape().num_elements())
    }

    fn read_codes(codes: &Self::Codes, len: usize, bits: u32) -> Vec<u8> {
        let mut bytes = read_words(codes);
        bytes.truncate((len * bits as usize).div_ceil(8));
        bytes
    }

    fn read_mask(mask: &Self::Mask, len: usize) -> Vec<u8> {
        let mut bytes = read_words(mask);
        bytes.truncate(len.div_ceil(8));
        bytes
    }
}

/// The little-endian bytes of a u32 cube tensor (a host read).
fn read_words(t: &CubeTensor) -> Vec<u8> {
    let n = t.shape().num_elements();
    let bytes = t
        .client
        .read_one(t.handle.clone())
        .expect("the device buffer can be read");
    bytes[..4 * n].to_vec()
}

/// The stream's ChaCha8 key words (seed, tensor id, zeros) and nonce words (the step), as the
/// dropout kernel takes them: 10 little-endian u32.
fn stream_key(stream: &RandomStream) -> Vec<u8> {
    let words: [u32; 10] = [
        stream.seed as u32,
        (stream.seed >> 32) as u32,
        stream.tensor as u32,
        (stream.tensor >> 32) as u32,
        0,
        0,
        0,
        0,
        stream.step as u32,
        (stream.step >> 32) as u32,
    ];
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}
