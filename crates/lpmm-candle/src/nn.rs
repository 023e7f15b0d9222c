//! Layers over parameters lpmm holds in their storage (8-bit LPMM parameters, or any other):
//! no `Var` holds the weight. Each layer is a candle custom operation that dequantizes its weight
//! while it computes — in the forward pass, and again in the backward pass, where it computes
//! the weight's gradient and hands it straight to lpmm (added into the accumulator, or stepped at
//! once with a released-gradient configuration) — and frees it after. So the full-precision
//! weight of a layer exists only while that layer computes, one layer at a time, and the
//! backward pass never holds a weight gradient in candle's `GradStore`.
//!
//! A small `Var` (one element, "token") is the operation's second input, so that candle's
//! backward pass reaches it even when the layer's input needs no gradient; its gradient is
//! never produced.

use candle_core::{CpuStorage, DType, Device, Error, Layout, Module, Result, Shape, Tensor, Var};
use lpmm_optim::{ParamId, Storage};

use crate::{LpmmOptimizer, Shared, wrap};

/// A parameter lpmm holds for a layer.
#[derive(Debug, Clone)]
struct Held {
    shared: Shared,
    id: ParamId,
    shape: Vec<usize>,
}

impl Held {
    fn register(opt: &LpmmOptimizer, name: &str, init: &Tensor) -> Result<Self> {
        let shared = opt.shared().clone();
        let shape = init.dims().to_vec();
        let id = crate::with_f32(init, |values| {
            let mut inner = shared.lock();
            let (group, config) = inner.config.config_for(name);
            inner
                .opt
                .cpu_mut()?
                .add_param_with(name, &shape, values, group, config)
                .map_err(wrap)
        })?;
        Ok(Held { shared, id, shape })
    }

    /// The weight as lpmm stores it, in f32: materialised for the duration of one use.
    fn values(&self) -> Result<Tensor> {
        let mut w = vec![0f32; self.shape.iter().product()];
        self.shared
            .lock()
            .opt
            .cpu()?
            .read_param(self.id, &mut w)
            .map_err(wrap)?;
        Tensor::from_vec(w, self.shape.as_slice(), &Device::Cpu)
    }

    /// Hands a gradient to lpmm: into the accumulator, or a released step where the
    /// configuration keeps none.
    fn give(&self, grad: &Tensor) -> Result<()> {
        let mut inner = self.shared.lock();
        let opt = inner.opt.cpu_mut()?;
        let released = opt.config(self.id).map_err(wrap)?.grad == Storage::None;
        // Read where candle computed it (no copy of a contiguous f32 gradient).
        crate::with_values(grad, |g| {
            if released {
                opt.step_param_input(self.id, g, None)
                    .map(drop)
                    .map_err(wrap)
            } else {
                opt.accumulate_input(self.id, g).map_err(wrap)
            }
        })
    }
}

fn token() -> Result<Var> {
    Var::zeros(1, DType::F32, &Device::Cpu)
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

/// `y = x W^T + b` with `W` (`out x in`) and `b` held by lpmm.
#[derive(Debug, Clone)]
pub struct QLinear {
    weight: Held,
    bias: Option<Held>,
    token: Var,
}

impl LpmmOptimizer {
    /// A linear layer whose weight (`out x in`, initialised with `weight`) and bias lpmm holds in
    /// their configured storage (`name.weight`, `name.bias`; parameter groups apply).
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
            token: token()?,
        })
    }

    /// An embedding whose table (`vocab x dim`, initialised with `table`) lpmm holds
    /// (`name.weight`).
    pub fn embedding(&self, name: &str, table: &Tensor) -> Result<QEmbedding> {
        if table.rank() != 2 {
            return Err(Error::Msg(format!(
                "embedding {name}: table {:?} is not vocab x dim",
                table.dims()
            )));
        }
        Ok(QEmbedding {
            table: Held::register(self, &format!("{name}.weight"), table)?,
            token: token()?,
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
        let rows = self.table.values()?.index_select(&ids, 0)?;
        let mut dims = l1.shape().dims().to_vec();
        dims.push(self.table.shape[1]);
        storage_of(&rows.reshape(dims)?)
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
            Tensor::zeros((vocab, dim), DType::F32, &Device::Cpu)?.index_add(&ids, &dy2, 0)?;
        self.table.give(&grad)?;
        Ok((None, None))
    }
}
