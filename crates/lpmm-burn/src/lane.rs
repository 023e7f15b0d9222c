//! How one family of burn backends meets one lpmm backend: burn's tensor primitive as lpmm's
//! input and output buffers, in place.
//!
//! A [`Lane`] takes a (non-autodiff) burn tensor apart into its backend primitive, lends its memory
//! to lpmm as the backend's [`Backend::Input`] / [`Backend::Output`] (a host slice on the CPU, a
//! `wgpu::Buffer` range on wgpu), and puts the primitive back into a burn tensor. Nothing is copied
//! unless the tensor's memory is shared with another tensor (a clone the caller kept) or not
//! contiguous; [`Lane::prepare`] then makes the private contiguous copy burn's own in-place
//! operations would make, and says so.

use burn_core::tensor::{Device, Tensor};
use lpmm_optim::backend::Backend;
use lpmm_optim::backend::Dtype;

use crate::BurnError;

/// One burn backend family with its lpmm backend.
pub(crate) trait Lane: Send + 'static {
    /// The lpmm backend.
    type B: Backend;
    /// burn's float primitive (and whatever keeps its memory lent).
    type Prim: Send;

    /// A short name ("cpu", "wgpu", "cuda").
    fn name(&self) -> &'static str;
    /// The lpmm backend.
    fn backend(&self) -> &Self::B;
    /// Whether tensors on `device` belong to this lane.
    fn owns(&self, device: &Device) -> bool;
    /// The primitive of a tensor without autodiff (on a device this lane owns).
    fn take<const D: usize>(&self, t: Tensor<D>) -> Result<Self::Prim, BurnError>;
    /// The tensor of a primitive.
    fn give<const D: usize>(&self, p: Self::Prim) -> Tensor<D>;
    /// Its element type, when lpmm can read it in place (f32, bf16).
    fn dtype(&self, p: &Self::Prim) -> Option<Dtype>;
    /// Its element count.
    fn numel(&self, p: &Self::Prim) -> usize;
    /// Makes the primitive lendable: contiguous, and for `write` not shared with another tensor
    /// (a private copy where it is, as burn's in-place operations make). Returns whether it
    /// copied.
    fn prepare(&self, p: &mut Self::Prim, write: bool) -> Result<bool, BurnError>;
    /// The prepared primitive as lpmm's input buffer.
    fn input<'a>(&self, p: &'a Self::Prim) -> Result<<Self::B as Backend>::Input<'a>, BurnError>;
    /// The prepared (for writing) primitive as lpmm's output buffer.
    fn output<'a>(
        &self,
        p: &'a mut Self::Prim,
    ) -> Result<<Self::B as Backend>::Output<'a>, BurnError>;
    /// Its values on the host as f32 (registration of a parameter lpmm holds; records).
    fn to_host(&self, p: &Self::Prim) -> Result<Vec<f32>, BurnError>;
    /// Its values on the host in its own dtype, little-endian (records of lent parameters).
    fn to_host_bytes(&self, p: &Self::Prim) -> Result<Vec<u8>, BurnError>;
    /// A tensor sharing the prepared primitive's memory, where lpmm writes device memory in
    /// place whoever else holds it (device lanes): the module keeps it during the step. `None` on
    /// the CPU, whose slices need the primitive's sole ownership (the module holds an empty
    /// stand-in until the primitive is put back).
    fn share<const D: usize>(&self, p: &Self::Prim) -> Option<Tensor<D>> {
        let _ = p;
        None
    }
    /// Waits until lpmm's work on lent tensors is done before they go back to burn, where the two
    /// run on different streams (CUDA); nothing where they share one queue.
    fn settle(&self) -> Result<(), BurnError> {
        Ok(())
    }
    /// Host reads (buffer maps) lpmm's backend has made so far and the bytes they brought
    /// back, where it counts them.
    fn host_reads(&self) -> Option<(u64, u64)> {
        None
    }
}

/// The element type of a burn dtype, where lpmm can read it in place.
pub(crate) fn lpmm_dtype(d: burn_core::tensor::DType) -> Option<Dtype> {
    match d {
        burn_core::tensor::DType::F32 => Some(Dtype::F32),
        burn_core::tensor::DType::BF16 => Some(Dtype::Bf16),
        _ => None,
    }
}

#[cfg(any(feature = "ndarray", feature = "flex"))]
// burn 0.22 deprecates its ndarray backend in favour of flex; the CPU backend is ndarray,
// so both are supported here (flex is the one to choose).
#[allow(deprecated)]
pub(crate) mod cpu {
    //! burn's CPU backends (ndarray, flex) with lpmm's CPU backend: host slices in place.

    use burn_backend::DType;
    use burn_core::backend::DispatchDevice;
    use burn_core::tensor::{Device, Tensor, TensorData};
    use lpmm_optim::Cpu;
    use lpmm_optim::backend::{Dtype, HostValues, HostValuesMut};

    use super::{Lane, lpmm_dtype};
    use crate::BurnError;

    /// A contiguous copy of a flex tensor that shares its memory with another, written in
    /// chunks on every thread.
    #[cfg(feature = "flex")]
    fn private_copy(t: &burn_flex::FlexTensor) -> Result<burn_flex::FlexTensor, BurnError> {
        fn copy<T: Copy + Send + Sync>(from: &[T]) -> Vec<T> {
            use rayon::prelude::*;
            const CHUNK: usize = 1 << 16;
            if from.len() <= CHUNK {
                return from.to_vec();
            }
            // rayon writes each part of the new vector in place: no pass zeroing it first.
            from.par_iter().copied().with_min_len(CHUNK).collect()
        }
        let (start, end) = t
            .layout()
            .contiguous_offsets()
            .ok_or_else(|| unsupported("a non-contiguous flex tensor"))?;
        let shape = t.layout().shape().clone();
        let data = match t.dtype() {
            DType::F32 => TensorData::new(copy(&t.storage::<f32>()[start..end]), shape),
            DType::BF16 => {
                TensorData::new(copy(&t.storage::<lpmm_formats::bf16>()[start..end]), shape)
            }
            d => return Err(unsupported(&format!("a flex tensor of {d:?}"))),
        };
        Ok(burn_flex::FlexTensor::from_data(data))
    }

    #[cfg(feature = "ndarray")]
    type NdArray = burn_core::backend::NdArray;
    #[cfg(feature = "flex")]
    type Flex = burn_core::backend::Flex;

    /// A CPU tensor's primitive.
    #[derive(Debug)]
    pub(crate) enum CpuPrim {
        /// burn-ndarray.
        #[cfg(feature = "ndarray")]
        NdArray(burn_ndarray::NdArrayTensor),
        /// burn-flex.
        #[cfg(feature = "flex")]
        Flex(burn_flex::FlexTensor),
    }

    /// burn's ndarray and flex backends on lpmm's CPU backend.
    #[derive(Debug, Default)]
    pub(crate) struct CpuLane;

    fn unsupported(what: &str) -> BurnError {
        BurnError::Param {
            param: "tensor".into(),
            reason: format!("{what}: lpmm reads f32 (ndarray, flex) and bf16 (flex) tensors"),
        }
    }

    impl Lane for CpuLane {
        type B = Cpu;
        type Prim = CpuPrim;

        fn name(&self) -> &'static str {
            "cpu"
        }

        fn backend(&self) -> &Cpu {
            &Cpu
        }

        fn owns(&self, device: &Device) -> bool {
            let inner = device.clone().inner();
            match inner.as_dispatch() {
                #[cfg(feature = "ndarray")]
                DispatchDevice::NdArray(_) => true,
                #[cfg(feature = "flex")]
                DispatchDevice::Flex(_) => true,
                #[allow(unreachable_patterns)]
                _ => false,
            }
        }

        fn take<const D: usize>(&self, t: Tensor<D>) -> Result<CpuPrim, BurnError> {
            let device = t.device().inner();
            let fail = |e: burn_core::tensor::PrimitiveConversionError| {
                BurnError::device(&device, format!("its tensor primitive: {e:?}"))
            };
            match device.as_dispatch() {
                #[cfg(feature = "ndarray")]
                DispatchDevice::NdArray(_) => Ok(CpuPrim::NdArray(
                    t.try_into_primitive::<NdArray>().map_err(fail)?,
                )),
                #[cfg(feature = "flex")]
                DispatchDevice::Flex(_) => {
                    Ok(CpuPrim::Flex(t.try_into_primitive::<Flex>().map_err(fail)?))
                }
                #[allow(unreachable_patterns)]
                _ => Err(BurnError::device(
                    &device,
                    "not a CPU device of burn's ndarray or flex backend",
                )),
            }
        }

        fn give<const D: usize>(&self, p: CpuPrim) -> Tensor<D> {
            match p {
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(t) => Tensor::from_primitive::<NdArray>(t),
                #[cfg(feature = "flex")]
                CpuPrim::Flex(t) => Tensor::from_primitive::<Flex>(t),
            }
        }

        fn dtype(&self, p: &CpuPrim) -> Option<Dtype> {
            match p {
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(burn_ndarray::NdArrayTensor::F32(_)) => Some(Dtype::F32),
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(_) => None,
                #[cfg(feature = "flex")]
                CpuPrim::Flex(t) => lpmm_dtype(t.dtype()),
            }
        }

        fn numel(&self, p: &CpuPrim) -> usize {
            use burn_backend::TensorMetadata;
            match p {
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(t) => t.shape().num_elements(),
                #[cfg(feature = "flex")]
                CpuPrim::Flex(t) => t.layout().num_elements(),
            }
        }

        fn prepare(&self, p: &mut CpuPrim, write: bool) -> Result<bool, BurnError> {
            match p {
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(t) => {
                    let burn_ndarray::NdArrayTensor::F32(s) = t else {
                        return Err(unsupported("an ndarray tensor that is not f32"));
                    };
                    let mut copied = false;
                    if !s.view().is_standard_layout() {
                        let values: Vec<f32> = s.view().iter().copied().collect();
                        let shape = s.shape().to_vec();
                        *t = burn_ndarray::NdArrayTensor::from_data(
                            burn_core::tensor::TensorData::new(values, shape),
                        );
                        copied = true;
                    }
                    let burn_ndarray::NdArrayTensor::F32(s) = t else {
                        return Err(unsupported("an ndarray tensor that is not f32"));
                    };
                    if write && !s.is_unique() {
                        // `as_slice_mut` below makes the private copy (copy on write).
                        copied = true;
                    }
                    Ok(copied)
                }
                #[cfg(feature = "flex")]
                CpuPrim::Flex(t) => {
                    if lpmm_dtype(t.dtype()).is_none() {
                        return Err(unsupported(&format!("a flex tensor of {:?}", t.dtype())));
                    }
                    let mut copied = false;
                    if t.layout().contiguous_offsets().is_none() {
                        *t = t.to_contiguous();
                        copied = true;
                    }
                    if write && !t.is_unique() {
                        // The private copy burn's in-place operations would make (`storage_mut`'s
                        // copy on write), made on every thread: a fresh allocation's pages are
                        // faulted in as it is written, which costs as much as the copy.
                        *t = private_copy(t)?;
                        copied = true;
                    }
                    Ok(copied)
                }
            }
        }

        fn input<'a>(&self, p: &'a CpuPrim) -> Result<HostValues<'a>, BurnError> {
            match p {
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(burn_ndarray::NdArrayTensor::F32(s)) => s
                    .view()
                    .to_slice()
                    .map(HostValues::F32)
                    .ok_or_else(|| unsupported("a non-contiguous ndarray tensor")),
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(_) => Err(unsupported("an ndarray tensor that is not f32")),
                #[cfg(feature = "flex")]
                CpuPrim::Flex(t) => {
                    let (start, end) = t
                        .layout()
                        .contiguous_offsets()
                        .ok_or_else(|| unsupported("a non-contiguous flex tensor"))?;
                    match t.dtype() {
                        DType::F32 => Ok(HostValues::F32(&t.storage::<f32>()[start..end])),
                        DType::BF16 => Ok(HostValues::Bf16(
                            &t.storage::<lpmm_formats::bf16>()[start..end],
                        )),
                        d => Err(unsupported(&format!("a flex tensor of {d:?}"))),
                    }
                }
            }
        }

        fn output<'a>(&self, p: &'a mut CpuPrim) -> Result<HostValuesMut<'a>, BurnError> {
            match p {
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(burn_ndarray::NdArrayTensor::F32(s)) => s
                    .ensure_owned()
                    .as_slice_mut()
                    .map(HostValuesMut::F32)
                    .ok_or_else(|| unsupported("a non-contiguous ndarray tensor")),
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(_) => Err(unsupported("an ndarray tensor that is not f32")),
                #[cfg(feature = "flex")]
                CpuPrim::Flex(t) => {
                    let (start, end) = t
                        .layout()
                        .contiguous_offsets()
                        .ok_or_else(|| unsupported("a non-contiguous flex tensor"))?;
                    match t.dtype() {
                        DType::F32 => {
                            Ok(HostValuesMut::F32(&mut t.storage_mut::<f32>()[start..end]))
                        }
                        DType::BF16 => Ok(HostValuesMut::Bf16(
                            &mut t.storage_mut::<lpmm_formats::bf16>()[start..end],
                        )),
                        d => Err(unsupported(&format!("a flex tensor of {d:?}"))),
                    }
                }
            }
        }

        fn to_host(&self, p: &CpuPrim) -> Result<Vec<f32>, BurnError> {
            let mut p2 = match p {
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(t) => CpuPrim::NdArray(t.clone()),
                #[cfg(feature = "flex")]
                CpuPrim::Flex(t) => CpuPrim::Flex(t.clone()),
            };
            self.prepare(&mut p2, false)?;
            let values = self.input(&p2)?;
            let mut out = vec![0f32; values.info().1];
            values.read_f32(0, &mut out);
            Ok(out)
        }

        fn to_host_bytes(&self, p: &CpuPrim) -> Result<Vec<u8>, BurnError> {
            let mut p2 = match p {
                #[cfg(feature = "ndarray")]
                CpuPrim::NdArray(t) => CpuPrim::NdArray(t.clone()),
                #[cfg(feature = "flex")]
                CpuPrim::Flex(t) => CpuPrim::Flex(t.clone()),
            };
            self.prepare(&mut p2, false)?;
            Ok(self.input(&p2)?.bytes().to_vec())
        }
    }
}
