//! How a tensor's memory meets an lpmm backend: a tensor as the backend's input, a `Var`'s
//! storage as its output, written in place inside a candle in-place operation (the CPU here,
//! CUDA in cuda.rs).

use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Error, InplaceOp1, Layout, Result, Storage, Tensor};
use lpmm_optim::backend::{Backend, HostValues, HostValuesMut};
use lpmm_optim::{Cpu, OptimError};

use crate::error::candle_error;

/// How tensors of one candle device meet one lpmm backend: a tensor's memory as the backend's
/// input, a `Var`'s as its output (in place). The CPU: host slices; CUDA (feature `cuda`):
/// lpmm-cuda views of candle's device memory.
pub(crate) trait Lane: Backend + Clone {
    /// Calls `f` with a tensor's values as this backend's input: where they are for a
    /// contiguous f32 or bf16 tensor, converted otherwise.
    fn input<T>(&self, t: &Tensor, f: impl FnOnce(Self::Input<'_>) -> Result<T>) -> Result<T>;
    /// Calls `f` with a `Var`'s storage as this backend's output, written in place (inside a
    /// candle in-place operation).
    fn output(&self, t: &Tensor, f: LentFn<'_, Self>) -> std::result::Result<(), OptimError>;
}

impl Lane for Cpu {
    fn input<T>(&self, t: &Tensor, f: impl FnOnce(HostValues<'_>) -> Result<T>) -> Result<T> {
        with_values(t, f)
    }

    fn output(&self, t: &Tensor, f: LentFn<'_, Cpu>) -> std::result::Result<(), OptimError> {
        let op = InPlace::<Cpu>::new(f);
        let result = t.inplace_op1(&op);
        op.finish(result)
    }
}

/// Calls `f` with a contiguous CPU tensor's values (f32 or bf16 in place; other float dtypes
/// converted to f32).
pub(crate) fn with_values<T>(t: &Tensor, f: impl FnOnce(HostValues<'_>) -> Result<T>) -> Result<T> {
    let n = t.elem_count();
    let (storage, layout) = t.storage_and_layout();
    if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
        match cpu {
            CpuStorage::F32(v) => return f(HostValues::F32(&v[start..end])),
            CpuStorage::BF16(v) => return f(HostValues::Bf16(&v[start..end])),
            _ => {}
        }
    }
    drop(storage);
    if !t.device().is_cpu() {
        return Err(Error::Msg(
            "lpmm-candle steps CPU tensors (CUDA: feature `cuda`)".into(),
        ));
    }
    let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    debug_assert_eq!(values.len(), n);
    f(HostValues::F32(&values))
}

/// Calls `f` with a CPU tensor's values as f32 (in place where the tensor is contiguous f32).
pub(crate) fn with_f32<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<T>) -> Result<T> {
    with_values(t, |v| match v {
        HostValues::F32(v) => f(v),
        HostValues::Bf16(v) => f(&v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>()),
    })
}

/// Calls `f` with a tensor's values as f32 to initialise a parameter lpmm holds: in place on the
/// CPU where they are contiguous f32, and a device tensor's through the host, once.
pub(crate) fn initial_f32<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<T>) -> Result<T> {
    if t.device().is_cpu() {
        with_f32(t, f)
    } else {
        f(&t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }
}

/// Calls lpmm's `f` with a tensor's values as `backend`'s input: lpmm's error as it is, candle's
/// (reading the tensor) as a lent-buffer error.
pub(crate) fn lend_input<B: Lane>(
    backend: &B,
    t: &Tensor,
    f: impl FnOnce(B::Input<'_>) -> std::result::Result<(), OptimError>,
) -> std::result::Result<(), OptimError> {
    let mut out = Ok(());
    backend
        .input(t, |v| {
            out = f(v);
            Ok(())
        })
        .map_err(candle_error)?;
    out
}

/// What lpmm does with a lent buffer.
pub(crate) type LentFn<'f, B> =
    &'f mut dyn FnMut(<B as Backend>::Output<'_>) -> std::result::Result<(), OptimError>;

/// Steps a `Var`'s storage in place (candle hands it out only inside an in-place operation).
pub(crate) struct InPlace<'f, B: Backend> {
    f: Mutex<LentFn<'f, B>>,
    /// lpmm's error, kept typed (candle's error type would only keep its message).
    error: Mutex<Option<OptimError>>,
}

impl<'f, B: Backend> InPlace<'f, B> {
    pub(crate) fn new(f: LentFn<'f, B>) -> Self {
        InPlace {
            f: Mutex::new(f),
            error: Mutex::new(None),
        }
    }

    /// Keeps `e` as the operation's error and gives candle its message.
    pub(crate) fn fail(&self, e: OptimError) -> Error {
        let message = e.to_string();
        *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        Error::Msg(message)
    }

    /// The operation's result, with lpmm's error typed where it failed in lpmm.
    pub(crate) fn finish(self, result: Result<()>) -> std::result::Result<(), OptimError> {
        result.map_err(|e| {
            self.error
                .into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| candle_error(e))
        })
    }

    pub(crate) fn run(&self, values: B::Output<'_>) -> Result<()> {
        let mut f = self.f.lock().unwrap_or_else(|e| e.into_inner());
        (*f)(values).map_err(|e| self.fail(e))
    }
}

impl InplaceOp1 for InPlace<'_, Cpu> {
    fn name(&self) -> &'static str {
        "lpmm-step"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(Error::Msg("a lent Var must be contiguous".into()));
        };
        let outside = || Error::Msg("a lent Var's layout lies outside its storage".into());
        match storage {
            CpuStorage::F32(v) => self.run(HostValuesMut::F32(
                v.get_mut(start..end).ok_or_else(outside)?,
            )),
            CpuStorage::BF16(v) => self.run(HostValuesMut::Bf16(
                v.get_mut(start..end).ok_or_else(outside)?,
            )),
            _ => Err(Error::Msg("a lent Var is f32 or bf16".into())),
        }
    }
}
