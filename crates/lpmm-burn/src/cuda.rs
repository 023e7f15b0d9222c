//! burn's CUDA device with lpmm-cuda on burn's CUDA memory (feature `cuda`).
//!
//! Both sides run in the device's primary context, so lpmm-cuda reads and writes burn's device
//! memory where it is ([`lpmm_cuda::CudaView`] of the buffer cubecl hands out). They run on two
//! streams: before lpmm touches a tensor burn's stream is synchronised (its pending work done),
//! and lpmm's stream is synchronised before the tensor goes back to burn.
//!
//! Compile-checked (`DOCS_RS=1 cargo check -p lpmm-burn --features cuda`, not part of CI); not yet
//! run on a GPU.

use std::any::Any;
use std::sync::Mutex;

use burn_backend::{TensorMetadata, ops::FloatTensorOps};
use burn_core::backend::DispatchDevice;
use burn_core::tensor::{Device, Tensor};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::{CubeBackend, CubeDevice};
use lpmm_cuda::{Cuda, CudaView, DeviceInput, DeviceOutput};
use lpmm_optim::backend::Dtype;

use crate::BurnError;
use crate::lane::{Lane, lpmm_dtype};

use crate::cube::{Cube, FusionPrim};
type CudaServer = <CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

/// lpmm's backend on each burn CUDA device it met.
static OPENED: Mutex<Vec<(CubeDevice, Cuda)>> = Mutex::new(Vec::new());

fn cube_device(device: &Device) -> Option<(CubeDevice, usize)> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(c @ CubeDevice::Cuda(d)) => Some((c.clone(), d.index)),
        _ => None,
    }
}

fn to_err(e: impl std::fmt::Display) -> BurnError {
    BurnError::device("cuda", e.to_string())
}

/// burn's CUDA device with lpmm-cuda.
#[derive(Debug)]
pub(crate) struct CudaLane {
    cuda: Cuda,
    device: CubeDevice,
}

impl CudaLane {
    /// The lane of `device` (`None` when it is not a CUDA device): lpmm-cuda on the device's
    /// primary context, opened once per device.
    pub fn for_device(device: &Device) -> Result<Option<Self>, BurnError> {
        let Some((cube, ordinal)) = cube_device(device) else {
            return Ok(None);
        };
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, cuda)) = opened.iter().find(|(d, _)| *d == cube) {
            return Ok(Some(CudaLane {
                cuda: cuda.clone(),
                device: cube,
            }));
        }
        let cuda = Cuda::new(ordinal).map_err(to_err)?;
        opened.push((cube.clone(), cuda.clone()));
        Ok(Some(CudaLane { cuda, device: cube }))
    }

    fn data(&self, p: &CudaPrim) -> Result<burn_core::tensor::TensorData, BurnError> {
        burn_backend::try_read_sync(Cube::float_into_data(p.fusion.clone()))
            .ok_or_else(|| to_err("the backend cannot read synchronously"))?
            .map_err(|e| to_err(format!("{e:?}")))
    }

    fn view<'a>(&self, p: &'a CudaPrim) -> Result<CudaView<'a>, BurnError> {
        let ptr = p
            .ptr
            .ok_or_else(|| to_err("internal: tensor not prepared"))?;
        let dtype = self
            .dtype(p)
            .ok_or_else(|| to_err("lpmm reads f32 and bf16 CUDA tensors"))?;
        // SAFETY: `ptr` is the device address of the tensor's `numel` contiguous values of
        // `dtype` in the device's primary context (lpmm-cuda's context too), pinned by the guard
        // `p` holds for as long as the view borrows `p`; burn's stream was synchronised in
        // `prepare`, and lpmm's is before the tensor is given back to burn (`settle`).
        Ok(unsafe { CudaView::from_raw(ptr, self.numel(p), dtype) })
    }
}

/// A CUDA tensor's primitive, with its memory pinned while lpmm uses it.
pub(crate) struct CudaPrim {
    fusion: FusionPrim,
    guard: Option<Box<dyn Any + Send>>,
    ptr: Option<u64>,
}

impl std::fmt::Debug for CudaPrim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPrim")
            .field("fusion", &self.fusion)
            .field("lent", &self.ptr.is_some())
            .finish()
    }
}

impl Lane for CudaLane {
    type B = Cuda;
    type Prim = CudaPrim;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn backend(&self) -> &Cuda {
        &self.cuda
    }

    fn owns(&self, device: &Device) -> bool {
        cube_device(device).is_some_and(|(d, _)| d == self.device)
    }

    fn take<const D: usize>(&self, t: Tensor<D>) -> Result<CudaPrim, BurnError> {
        let device = t.device();
        let fusion = t
            .try_into_primitive::<Cube>()
            .map_err(|e| BurnError::device(&device, format!("its tensor primitive: {e:?}")))?;
        Ok(CudaPrim {
            fusion,
            guard: None,
            ptr: None,
        })
    }

    fn give<const D: usize>(&self, p: CudaPrim) -> Tensor<D> {
        let CudaPrim { fusion, guard, .. } = p;
        drop(guard);
        Tensor::from_primitive::<Cube>(fusion)
    }

    fn share<const D: usize>(&self, p: &Self::Prim) -> Option<Tensor<D>> {
        Some(Tensor::from_primitive::<Cube>(p.fusion.clone()))
    }

    fn dtype(&self, p: &CudaPrim) -> Option<Dtype> {
        lpmm_dtype(p.fusion.dtype())
    }

    fn numel(&self, p: &CudaPrim) -> usize {
        p.fusion.shape().num_elements()
    }

    fn prepare(&self, p: &mut CudaPrim, write: bool) -> Result<bool, BurnError> {
        if p.ptr.is_some() {
            return Ok(false);
        }
        if self.dtype(p).is_none() {
            return Err(to_err(format!(
                "a CUDA tensor of {:?}: lpmm reads f32 and bf16",
                p.fusion.dtype()
            )));
        }
        let client = p.fusion.client.clone();
        let mut cube: burn_cubecl::tensor::CubeTensor =
            client.resolve_tensor_float::<CubeBackend>(p.fusion.clone());
        let mut copied = false;
        if write && (!p.fusion.can_mut() || !cube.is_contiguous()) {
            // Shared with another tensor (burn-train's `Learner` keeps the model it steps), or
            // not contiguous: a private contiguous copy, made on the device (counted).
            let copy = if cube.is_contiguous() {
                cube.copy()
            } else {
                burn_cubecl::kernel::into_contiguous(cube.copy())
            };
            p.fusion = crate::cube::register(copy, &client);
            cube = client.resolve_tensor_float::<CubeBackend>(p.fusion.clone());
            copied = true;
        }
        if !cube.is_contiguous() {
            cube = burn_cubecl::kernel::into_contiguous(cube);
        }
        let resource = cube
            .client
            .get_resource::<CudaServer>(cube.handle.clone())
            .map_err(|e| to_err(format!("the tensor's memory: {e}")))?;
        // burn's stream: its work on the tensor done before lpmm's stream touches it.
        burn_cubecl::cubecl::future::block_on(cube.client.sync()).map_err(to_err)?;
        p.ptr = Some(resource.resource().ptr);
        p.guard = Some(Box::new((cube, resource)));
        Ok(copied)
    }

    fn input<'a>(
        &self,
        p: &'a CudaPrim,
    ) -> Result<DeviceInput<'a, lpmm_cuda::CudaRuntime>, BurnError> {
        Ok(DeviceInput::Device(self.view(p)?))
    }

    fn output<'a>(
        &self,
        p: &'a mut CudaPrim,
    ) -> Result<DeviceOutput<'a, lpmm_cuda::CudaRuntime>, BurnError> {
        Ok(DeviceOutput::Device(self.view(p)?))
    }

    fn to_host(&self, p: &CudaPrim) -> Result<Vec<f32>, BurnError> {
        self.data(p)?
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| to_err(format!("{e:?}")))
    }

    fn to_host_bytes(&self, p: &CudaPrim) -> Result<Vec<u8>, BurnError> {
        let data = self.data(p)?;
        Ok(data.as_bytes().to_vec())
    }

    fn settle(&self) -> Result<(), BurnError> {
        Ok(self.cuda.synchronize()?)
    }
}
