//! candle's CUDA device with lpmm-cuda (feature `cuda`): the `Var`s stepped where candle keeps
//! them.
//!
//! candle-core 0.11.1's `cuda` feature and lpmm-cuda use the same cudarc (0.19.10, one crate in
//! the build), so lpmm-cuda runs on candle's own stream ([`lpmm_cuda::Cuda::with_stream`] with
//! the device's `cuda_stream()`) in candle's context (the device's primary context): lpmm's copies
//! and launches are enqueued after candle's work on the `Var`s and gradients, and candle's next
//! operations after lpmm's, in stream order, with no synchronisation of either side. A `Var`'s
//! storage is lent inside a candle in-place operation as an lpmm-cuda [`CudaView`] of its
//! contiguous range (the layout's start offset included); a gradient is read the same way from
//! the `GradStore`. Nothing goes through the host per step, except a `Var` lpmm holds a copy of
//! whose dtype is neither f32 nor bf16 (f16, f64: set from the host after each step, as on the
//! CPU).

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::{
    CpuStorage, DType, Device, Error, InplaceOp1, Layout, Result, Storage, Tensor, Var,
};
use lpmm_cuda::{Cuda, CudaOptions, CudaRuntime, CudaView, DeviceInput, DeviceOutput, ViewElement};
use lpmm_optim::Out;
use lpmm_optim::{OptimError, Optimizer, OptimizerOptions, ParamId, Parts, SlotKind};

use crate::error::wrap;
use crate::lane::{InPlace, Lane, LentFn, with_values};

/// lpmm-cuda on one candle CUDA device's stream.
#[derive(Debug)]
pub(crate) struct CudaEngine {
    pub(crate) opt: Optimizer<Cuda>,
    device: CudaDevice,
}

impl CudaEngine {
    /// lpmm-cuda on `device`'s context and stream.
    pub(crate) fn new(device: &CudaDevice, options: OptimizerOptions) -> Result<Self> {
        let backend =
            Cuda::with_stream(device.cuda_stream(), CudaOptions::default()).map_err(Error::wrap)?;
        let opt = Optimizer::with_backend(backend, options).map_err(wrap)?;
        Ok(CudaEngine {
            opt,
            device: device.clone(),
        })
    }

    /// "cuda:N".
    pub(crate) fn name(&self) -> String {
        match self.device.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
            other => format!("{other:?}"),
        }
    }

    /// Whether `device` is this candle device (the same stream: candle's own `same_device`).
    pub(crate) fn owns(&self, device: &Device) -> bool {
        matches!(device, Device::Cuda(d) if d.same_device(&self.device))
    }

    /// Sets every `Var` lpmm holds a copy of to the parameter: decoded on the device into the
    /// `Var`'s storage for f32 and bf16, through the host for other dtypes.
    pub(crate) fn sync<'v>(&self, vars: impl Iterator<Item = (ParamId, &'v Var)>) -> Result<()> {
        let backend = Parts::of(&self.opt).backend().clone();
        for (id, var) in vars {
            if matches!(var.dtype(), DType::F32 | DType::BF16) {
                backend
                    .output(var.as_tensor(), &mut |out| {
                        self.opt.read(id, SlotKind::Param, Out::Backend(out))
                    })
                    .map_err(wrap)?;
            } else {
                let mut values = vec![0f32; var.elem_count()];
                self.opt
                    .read(id, SlotKind::Param, &mut values)
                    .map_err(wrap)?;
                let t =
                    Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
                var.set(&t)?;
            }
        }
        Ok(())
    }
}

fn outside() -> Error {
    Error::Msg("a tensor's layout lies outside its CUDA storage".into())
}

/// Calls `f` with `s[start..end]` as a read-only view.
fn with_read<T, R>(
    backend: &Cuda,
    s: &CudaSlice<T>,
    (start, end): (usize, usize),
    f: impl FnOnce(DeviceInput<'_, CudaRuntime>) -> Result<R>,
) -> Result<R>
where
    T: ViewElement + DeviceRepr,
{
    let range = s.try_slice(start..end).ok_or_else(outside)?;
    let view = CudaView::read_only(backend, &range).map_err(Error::wrap)?;
    f(DeviceInput::Device(view))
}

impl Lane for Cuda {
    fn input<T>(
        &self,
        t: &Tensor,
        f: impl FnOnce(DeviceInput<'_, CudaRuntime>) -> Result<T>,
    ) -> Result<T> {
        {
            let (storage, layout) = t.storage_and_layout();
            if let (Storage::Cuda(cuda), Some(range)) = (&*storage, layout.contiguous_offsets()) {
                match &cuda.slice {
                    CudaStorageSlice::F32(s) => return with_read(self, s, range, f),
                    CudaStorageSlice::BF16(s) => return with_read(self, s, range, f),
                    _ => {}
                }
            }
        }
        match t.device() {
            // Another dtype, or not contiguous: an f32 copy on the device.
            Device::Cuda(_) => {
                let copy = t.to_dtype(DType::F32)?.contiguous()?;
                let (storage, layout) = copy.storage_and_layout();
                match (&*storage, layout.contiguous_offsets()) {
                    (Storage::Cuda(cuda), Some(range)) => {
                        with_read(self, cuda.as_cuda_slice::<f32>()?, range, f)
                    }
                    _ => Err(Error::Msg(
                        "internal: a contiguous f32 CUDA copy is not contiguous f32".into(),
                    )),
                }
            }
            Device::Cpu => with_values(t, |v| f(DeviceInput::Host(v))),
            other => Err(Error::Msg(format!(
                "lpmm-candle steps CPU and CUDA tensors, not {:?}",
                other.location()
            ))),
        }
    }

    fn output(&self, t: &Tensor, f: LentFn<'_, Cuda>) -> std::result::Result<(), OptimError> {
        let op = CudaInPlace {
            op: InPlace::new(f),
            backend: self.clone(),
        };
        let result = t.inplace_op1(&op);
        op.op.finish(result)
    }
}

/// Steps a CUDA `Var`'s storage in place.
struct CudaInPlace<'f> {
    op: InPlace<'f, Cuda>,
    backend: Cuda,
}

impl CudaInPlace<'_> {
    fn run<T: ViewElement + DeviceRepr>(
        &self,
        s: &mut CudaSlice<T>,
        (start, end): (usize, usize),
    ) -> Result<()> {
        let mut range = s.try_slice_mut(start..end).ok_or_else(outside)?;
        let view = CudaView::new(&self.backend, &mut range)
            .map_err(|e| self.op.fail(OptimError::Backend(e)))?;
        self.op.run(DeviceOutput::Device(view))
    }
}

impl InplaceOp1 for CudaInPlace<'_> {
    fn name(&self) -> &'static str {
        "lpmm-step"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        Err(Error::Msg(
            "a CPU Var given to the optimizer of a CUDA device".into(),
        ))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> Result<()> {
        let Some(range) = layout.contiguous_offsets() else {
            return Err(Error::Msg("a lent Var must be contiguous".into()));
        };
        match &mut storage.slice {
            CudaStorageSlice::F32(s) => self.run(s, range),
            CudaStorageSlice::BF16(s) => self.run(s, range),
            _ => Err(Error::Msg("a lent Var is f32 or bf16".into())),
        }
    }
}
