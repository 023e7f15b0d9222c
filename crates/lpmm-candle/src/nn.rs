//! Layers over parameters lpmm holds in their storage (8-bit LPMM parameters, or any other):
//! no `Var` holds the weight. Each layer is a candle custom operation that dequantizes its weight
//! while it computes — in the forward pass, and again in the backward pass, where it computes
//! the weight's gradient and hands it straight to lpmm (added into the accumulator, or stepped at
//! once with a released-gradient configuration) — and frees it after. So the full-precision
//! weight of a layer exists only while that layer computes, one layer at a time, and the
//! backward pass never holds a weight gradient in candle's `GradStore`.
//!
//! A layer lives on the device of the weight it is created with: the CPU, or with feature `cuda`
//! a candle CUDA device, where lpmm-cuda holds the weight, decodes it into a device tensor and
//! reads the gradient where candle computed it (the optimizer's device: the first `Var` or
//! layer registered picks it). The operation's input is copied once into a tensor of its own on
//! either device (candle hands a custom operation its storage, not a tensor), and so is the
//! output.
//!
//! A small `Var` (one element, "token") is the operation's second input, so that candle's
//! backward pass reaches it even when the layer's input needs no gradient; its gradient is
//! never produced.

use candle_core::{CpuStorage, DType, Device, Error, Layout, Module, Result, Shape, Tensor, Var};
use lpmm_optim::ParamId;

use crate::LpmmOptimizer;
use crate::optimizer::Shared;

/// A parameter lpmm holds for a layer.
#[derive(Debug, Clone)]
struct Held {
    shared: Shared,
    id: ParamId,
    shape: Vec<usize>,
    device: Device,
}

impl Held {
    fn register(opt: &LpmmOptimizer, name: &str, init: &Tensor) -> Result<Self> {
        let shared = opt.shared().clone();
        let id = shared.lock().register_held(name, init)?;
        Ok(Held {
            shared,
            id,
            shape: init.dims().to_vec(),
            device: init.device().clone(),
        })
    }

    /// The weight as lpmm stores it, in f32 on the layer's device: materialised for the duration
    /// of one use.
    fn values(&self) -> Result<Tensor> {
        let w = Tensor::zeros(self.shape.as_slice(), DType::F32, &self.device)?;
        self.shared.lock().decode_held(self.id, &w)?;
        Ok(w)
    }

    /// Hands a gradient to lpmm: into the accumulator, or a released step where the
    /// configuration keeps none (read where candle computed it: no copy of a contiguous f32
    /// gradient).
    fn give(&self, grad: &Tensor) -> Result<()> {
        self.shared.lock().give_held(self.id, grad)
    }
}

fn token(device: &Device) -> Result<Var> {
    Var::zeros(1, DType::F32, device)
}

/// A CPU f32 tensor from a custom op's input storage.
fn tensor_of(storage: &CpuStorage, layout: &Layout) -> Result<Tensor> {
    let (Some((start, end)), CpuStorage::F32(v)) = (layout.contiguous_offsets(), storage) else {
        return Err(Error::Msg(
            "lpmm layers take contiguous f32 CPU inputs".into(),
        ));
    };
    Tensor::from_slice(&v[start..end], layout.shape(), &Device::Cpu)
}

/// A custom op's output storage from a tensor.
fn storage_of(t: &Tensor) -> Result<(CpuStorage, Shape)> {
    let t = t.contiguous()?;
    let values = t.flatten_all()?.to_vec1::<f32>()?;
    Ok((CpuStorage::F32(values), t.shape().clone()))
}

/// A layer's CUDA tensors (feature `cuda`): a custom op's input storage as a tensor, and a
/// tensor as its output storage, each a copy on the device.
#[cfg(feature = "cuda")]
mod on_cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
    use candle_core::op::BackpropOp;
    use candle_core::{Error, Layout, Result, Shape, Storage, Tensor};

    fn len(s: &CudaStorage) -> Result<usize> {
        Ok(match &s.slice {
            CudaStorageSlice::F32(v) => v.len(),
            CudaStorageSlice::BF16(v) => v.len(),
            CudaStorageSlice::U32(v) => v.len(),
            _ => {
                return Err(Error::Msg(
                    "lpmm layers take f32 or bf16 inputs and u32 ids".into(),
                ));
            }
        })
    }

    /// The input of a custom op as a tensor of its own (a device copy).
    pub(super) fn tensor_of(s: &CudaStorage, layout: &Layout) -> Result<Tensor> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(Error::Msg("lpmm layers take contiguous inputs".into()));
        };
        let copy = s.try_clone(layout)?;
        let n = len(&copy)?;
        Tensor::from_storage(Storage::Cuda(copy), n, BackpropOp::none(), false)
            .narrow(0, start, end - start)?
            .reshape(layout.shape())
    }

    /// A tensor as a custom op's output storage (a device copy, from offset 0).
    pub(super) fn storage_of(t: &Tensor) -> Result<(CudaStorage, Shape)> {
        let t = t.copy()?;
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            return Err(Error::Msg(
                "internal: a CUDA layer's output is not on CUDA".into(),
            ));
        };
        Ok((s.try_clone(layout)?, t.shape().clone()))
    }
}

/// `y = x W^T + b` with `W` (`out x in`) and `b` held by lpmm.
#[derive(Debug, Clone)]
pub struct QLinear {
    weight: Held,
    bias: Option<Held>,
    token: Var,
}

impl LpmmOptimizer {
    /// A linear layer whose weight (`out x in`, initialised with `weight`) and bias lpmm holds in
    /// their configured storage (`name.weight`, `name.bias`; parameter groups apply), on
    /// `weight`'s device.
    pub fn linear(&self, name: &str, weight: &Tensor, bias: Option<&Tensor>) -> Result<QLinear> {
        if weight.rank() != 2 || bias.is_some_and(|b| b.dims() != [weight.dims()[0]]) {
            return Err(Error::Msg(format!(
                "linear {name}: weight {:?} and bias {:?} are not out x in and out",
                weight.dims(),
                bias.map(Tensor::dims)
            )));
        }
        Ok(QLinear {
            weight: Held::register(self, &format!("{name}.weight"), weight)?,
            bias: bias
                .map(|b| Held::register(self, &format!("{name}.bias"), b))
                .transpose()?,
            token: token(weight.device())?,
        })
    }

    /// An embedding whose table (`vocab x dim`, initialised with `table`) lpmm holds
    /// (`name.weight`), on `table`'s device.
    pub fn embedding(&self, name: &str, table: &Tensor) -> Result<QEmbedding> {
        if table.rank() != 2 {
            return Err(Error::Msg(format!(
                "embedding {name}: table {:?} is not vocab x dim",
                table.dims()
            )));
        }
        Ok(QEmbedding {
            table: Held::register(self, &format!("{name}.weight"), table)?,
            token: token(table.device())?,
        })
    }
}

impl QLinear {
    fn output(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.values()?;
        let y = x.broadcast_matmul(&w.t()?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(&b.values()?),
            None => Ok(y),
        }
    }
}

impl Module for QLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op2(self.token.as_tensor(), self.clone())
    }
}

impl candle_core::CustomOp2 for QLinear {
    fn name(&self) -> &'static str {
        "lpmm-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        storage_of(&self.output(&tensor_of(s1, l1)?)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let x = on_cuda::tensor_of(s1, l1)?.to_dtype(DType::F32)?;
        on_cuda::storage_of(&self.output(&x)?)
    }

    fn bwd(
        &self,
        x: &Tensor,
        _token: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let in_f = self.weight.shape[1];
        let out_f = self.weight.shape[0];
        let x2 = x.reshape(((), in_f))?;
        let dy2 = dy.reshape(((), out_f))?;
        // dx with the weight materialised again, before a released configuration steps it;
        // then the weight's gradient, straight to lpmm.
        let dx = x
            .track_op()
            .then(|| dy.broadcast_matmul(&self.weight.values()?))
            .transpose()?;
        self.weight.give(&dy2.t()?.matmul(&x2)?)?;
        if let Some(b) = &self.bias {
            b.give(&dy2.sum(0)?)?;
        }
        Ok((dx, None))
    }
}

/// Rows of a `vocab x dim` table lpmm holds, by token id.
#[derive(Debug, Clone)]
pub struct QEmbedding {
    table: Held,
    token: Var,
}

impl Module for QEmbedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let ids = ids.to_dtype(DType::U32)?;
        ids.apply_op2(self.token.as_tensor(), self.clone())
    }
}

impl QEmbedding {
    /// The table's rows for `ids` (flat), shaped `ids_shape x dim`.
    fn rows(&self, ids: &Tensor, ids_shape: &Shape) -> Result<Tensor> {
        let rows = self.table.values()?.index_select(ids, 0)?;
        let mut dims = ids_shape.dims().to_vec();
        dims.push(self.table.shape[1]);
        rows.reshape(dims)
    }
}

impl candle_core::CustomOp2 for QEmbedding {
    fn name(&self) -> &'static str {
        "lpmm-embedding"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (Some((start, end)), CpuStorage::U32(v)) = (l1.contiguous_offsets(), s1) else {
            return Err(Error::Msg("lpmm embeddings take contiguous u32 ids".into()));
        };
        let ids = Tensor::from_slice(&v[start..end], end - start, &Device::Cpu)?;
        storage_of(&self.rows(&ids, l1.shape())?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let ids = on_cuda::tensor_of(s1, l1)?.flatten_all()?;
        on_cuda::storage_of(&self.rows(&ids, l1.shape())?)
    }

    fn bwd(
        &self,
        ids: &Tensor,
        _token: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (vocab, dim) = (self.table.shape[0], self.table.shape[1]);
        let ids = ids.flatten_all()?;
        let dy2 = dy.reshape(((), dim))?;
        let grad =
            Tensor::zeros((vocab, dim), DType::F32, dy.device())?.index_add(&ids, &dy2, 0)?;
        self.table.give(&grad)?;
        Ok((None, None))
    }
}
