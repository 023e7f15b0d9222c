//! burn's wgpu device with lpmm-wgpu on the same `wgpu::Device` and queue (feature `wgpu`).
//!
//! burn 0.22's wgpu backend is cubecl's wgpu runtime, built on the same `wgpu` crate (30) as
//! lpmm-wgpu, so one device serves both: share burn's device with lpmm once, before training,
//!
//! ```no_run
//! // burn alone:  let device = Device::wgpu_options().init()?;
//! let device = lpmm_burn::wgpu::init(burn_core::tensor::Device::wgpu_options())?;
//! # Ok::<(), lpmm_burn::BurnError>(())
//! ```
//!
//! (or [`share`] a device burn initialised with `init_with_setup`), and the optimizer steps the
//! module's parameters in burn's own buffers and reads its gradients where burn wrote them: a step
//! maps nothing back to the host but lpmm's 4-byte non-finite flags when neither clipping nor the
//! skip-step policy needs the gradient norm (`NonFinitePolicy::SkipElements`, no clipping), and
//! the per-parameter norm partials otherwise (lpmm-wgpu reads those back to sum them exactly).
//!
//! Ordering on the shared queue: before lpmm touches a tensor, burn's pending work on it is
//! executed and submitted (the fusion stream is drained when the tensor is resolved, and
//! cubecl's stream is flushed when its buffer is taken), and lpmm submits its own work at once,
//! so burn's next operations, submitted later to the same queue, see its writes.
//!
//! burn's wgpu tensors are f32 here (WGSL has no bf16): parameters stored in bf16 or below are
//! held by lpmm.

use std::any::Any;
use std::sync::Mutex;

use burn_backend::{TensorMetadata, ops::FloatTensorOps};
use burn_core::backend::DispatchDevice;
use burn_core::tensor::{Device, Tensor};
use burn_cubecl::cubecl::wgpu::{AutoCompiler, WgpuServer};
use burn_cubecl::{CubeBackend, CubeDevice};
use lpmm_optim::backend::Dtype;
use lpmm_wgpu::{DeviceInput, DeviceOutput, Wgpu, WgpuView};

use crate::BurnError;
use crate::lane::{Lane, lpmm_dtype};

pub use burn_core::tensor::wgpu::{WgpuOptions as BurnWgpuOptions, WgpuSetup};
pub use lpmm_wgpu::WgpuOptions as LpmmWgpuOptions;

use crate::cube::{Cube, FusionPrim};

/// lpmm's backend on each burn wgpu device shared with it.
static SHARED: Mutex<Vec<(CubeDevice, Wgpu)>> = Mutex::new(Vec::new());

fn cube_device(device: &Device) -> Option<CubeDevice> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(c @ CubeDevice::Wgpu(_)) => Some(c.clone()),
        _ => None,
    }
}

/// Shares burn's wgpu `device` (initialised with `Device::wgpu_options().init_with_setup()`,
/// which returns `setup`) with lpmm: lpmm-wgpu is created on `setup`'s device and queue, and the
/// optimizer uses it for every tensor on `device`.
pub fn share(device: &Device, setup: &WgpuSetup) -> Result<Wgpu, BurnError> {
    share_with(device, setup, LpmmWgpuOptions::default())
}

/// [`share`] with lpmm-wgpu's layout options (see [`init_with`]).
pub fn share_with(
    device: &Device,
    setup: &WgpuSetup,
    options: LpmmWgpuOptions,
) -> Result<Wgpu, BurnError> {
    let Some(cube) = cube_device(device) else {
        return Err(BurnError::device(device, "not a burn wgpu device"));
    };
    let wgpu = Wgpu::with_device(
        setup.adapter.get_info(),
        setup.device.clone(),
        setup.queue.clone(),
        options,
    )
    .map_err(|e| BurnError::device(device, e.to_string()))?;
    let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    shared.retain(|(d, _)| *d != cube);
    shared.push((cube, wgpu.clone()));
    Ok(wgpu)
}

/// Initialises burn's wgpu runtime with `options` and shares its device with lpmm: the device to
/// create the model on.
pub fn init(options: BurnWgpuOptions) -> Result<Device, BurnError> {
    init_with(options, LpmmWgpuOptions::default())
}

/// [`init`] with lpmm-wgpu's layout options. lpmm-wgpu keeps optimizer state in segment buffers
/// of `segment_bytes` (128 MiB by default) and moves host values through a staging buffer of
/// `io_bytes` (64 MiB); wgpu zeroes buffers when it creates them, so a segment is resident in
/// full from the first step. For a small model, segments near its state's size save memory.
pub fn init_with(options: BurnWgpuOptions, lpmm: LpmmWgpuOptions) -> Result<Device, BurnError> {
    let (device, setup) = options
        .init_with_setup()
        .map_err(|e| BurnError::device("wgpu", e.to_string()))?;
    share_with(&device, &setup, lpmm)?;
    Ok(device)
}

/// lpmm's backend on burn's wgpu `device`, if it was shared.
pub fn backend(device: &Device) -> Option<Wgpu> {
    let cube = cube_device(device)?;
    let shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    shared
        .iter()
        .find(|(d, _)| *d == cube)
        .map(|(_, w)| w.clone())
}

/// burn's wgpu device with lpmm-wgpu.
#[derive(Debug)]
pub(crate) struct WgpuLane {
    wgpu: Wgpu,
    device: CubeDevice,
}

impl WgpuLane {
    /// The lane of `device`: `None` when it is not a wgpu device, an error when it is one that
    /// was not shared with lpmm.
    pub fn for_device(device: &Device) -> Result<Option<Self>, BurnError> {
        let Some(cube) = cube_device(device) else {
            return Ok(None);
        };
        match backend(device) {
            Some(wgpu) => Ok(Some(WgpuLane { wgpu, device: cube })),
            None => Err(BurnError::device(
                device,
                "this wgpu device was not shared with lpmm: create it with lpmm_burn::wgpu::init, or call lpmm_burn::wgpu::share with its setup, before the first step",
            )),
        }
    }
}

/// A wgpu tensor's primitive, with its buffer taken out of cubecl while lpmm uses it.
pub(crate) struct WgpuPrim {
    fusion: FusionPrim,
    /// The resolved cubecl tensor (shares the buffer) and the guard that keeps its memory in
    /// place, while lent.
    lent: Option<(burn_cubecl::tensor::CubeTensor, Box<dyn Any + Send>)>,
    buffer: Option<(::wgpu::Buffer, u64)>,
}

impl std::fmt::Debug for WgpuPrim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuPrim")
            .field("fusion", &self.fusion)
            .field("lent", &self.buffer.is_some())
            .finish()
    }
}

fn to_err(e: impl std::fmt::Display) -> BurnError {
    BurnError::device("wgpu", e.to_string())
}

impl WgpuLane {
    /// The tensor's values through burn (host copy).
    fn data(&self, p: &WgpuPrim) -> Result<burn_core::tensor::TensorData, BurnError> {
        burn_backend::try_read_sync(Cube::float_into_data(p.fusion.clone()))
            .ok_or_else(|| to_err("the backend cannot read synchronously"))?
            .map_err(|e| to_err(format!("{e:?}")))
    }

    fn view<'a>(&self, p: &'a WgpuPrim) -> Result<WgpuView<'a>, BurnError> {
        let (buffer, offset) = p
            .buffer
            .as_ref()
            .ok_or_else(|| to_err("internal: tensor not prepared"))?;
        let dtype = self
            .dtype(p)
            .ok_or_else(|| to_err("lpmm reads f32 wgpu tensors"))?;
        Ok(WgpuView {
            buffer,
            offset: *offset,
            len: self.numel(p),
            dtype,
        })
    }
}

impl Lane for WgpuLane {
    type B = Wgpu;
    type Prim = WgpuPrim;

    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn backend(&self) -> &Wgpu {
        &self.wgpu
    }

    fn owns(&self, device: &Device) -> bool {
        cube_device(device).is_some_and(|d| d == self.device)
    }

    fn take<const D: usize>(&self, t: Tensor<D>) -> Result<WgpuPrim, BurnError> {
        let device = t.device();
        let fusion = t
            .try_into_primitive::<Cube>()
            .map_err(|e| BurnError::device(&device, format!("its tensor primitive: {e:?}")))?;
        Ok(WgpuPrim {
            fusion,
            lent: None,
            buffer: None,
        })
    }

    fn give<const D: usize>(&self, p: WgpuPrim) -> Tensor<D> {
        let WgpuPrim { fusion, lent, .. } = p;
        drop(lent);
        Tensor::from_primitive::<Cube>(fusion)
    }

    fn share<const D: usize>(&self, p: &Self::Prim) -> Option<Tensor<D>> {
        Some(Tensor::from_primitive::<Cube>(p.fusion.clone()))
    }

    fn dtype(&self, p: &WgpuPrim) -> Option<Dtype> {
        lpmm_dtype(p.fusion.dtype())
    }

    fn numel(&self, p: &WgpuPrim) -> usize {
        p.fusion.shape().num_elements()
    }

    fn prepare(&self, p: &mut WgpuPrim, write: bool) -> Result<bool, BurnError> {
        if p.buffer.is_some() {
            return Ok(false);
        }
        if self.dtype(p).is_none() {
            return Err(to_err(format!(
                "a wgpu tensor of {:?}: lpmm reads f32",
                p.fusion.dtype()
            )));
        }
        // Drains the fusion stream (burn's pending operations run) and hands out a tensor that
        // shares the buffer (read-only resolve: the fusion tensor stays the owner).
        let client = p.fusion.client.clone();
        let mut cube: burn_cubecl::tensor::CubeTensor =
            client.resolve_tensor_float::<CubeBackend>(p.fusion.clone());
        let mut copied = false;
        if write && (!p.fusion.can_mut() || !cube.is_contiguous()) {
            // Shared with another tensor (burn-train's `Learner` keeps the model it steps), or
            // not contiguous: step a private contiguous copy, as burn's in-place operations
            // would, made on the device (counted).
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
        // Flushes cubecl's stream to the queue and pins the memory while it is lent.
        let resource = cube
            .client
            .get_resource::<WgpuServer<AutoCompiler>>(cube.handle.clone())
            .map_err(|e| to_err(format!("the tensor's buffer: {e}")))?;
        let r = resource.resource();
        if r.offset % 4 != 0 {
            return Err(to_err("a wgpu tensor at an offset not a multiple of 4"));
        }
        p.buffer = Some((r.buffer.clone(), r.offset));
        p.lent = Some((cube, Box::new(resource)));
        Ok(copied)
    }

    fn input<'a>(
        &self,
        p: &'a WgpuPrim,
    ) -> Result<DeviceInput<'a, lpmm_wgpu::WgpuRuntime>, BurnError> {
        Ok(DeviceInput::Device(self.view(p)?))
    }

    fn output<'a>(
        &self,
        p: &'a mut WgpuPrim,
    ) -> Result<DeviceOutput<'a, lpmm_wgpu::WgpuRuntime>, BurnError> {
        Ok(DeviceOutput::Device(self.view(p)?))
    }

    fn to_host(&self, p: &WgpuPrim) -> Result<Vec<f32>, BurnError> {
        self.data(p)?
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| to_err(format!("{e:?}")))
    }

    fn to_host_bytes(&self, p: &WgpuPrim) -> Result<Vec<u8>, BurnError> {
        Ok(self
            .to_host(p)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect())
    }

    fn host_reads(&self) -> Option<(u64, u64)> {
        Some((self.wgpu.host_reads(), self.wgpu.host_read_bytes()))
    }
}

/// Device memory on a burn wgpu device, as each side reports it: cubecl's memory pools (burn's
/// tensors, every stream) and lpmm-wgpu's own buffers (lpmm's optimizer states). On a GPU this is
/// the device's memory; on lavapipe it is part of the process's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct DeviceMemory {
    /// Bytes cubecl's pools reserve on the device.
    pub burn_reserved: u64,
    /// Of those, bytes in use by live tensors.
    pub burn_in_use: u64,
    /// Bytes of lpmm-wgpu's segment buffers and its staging buffer (0 where the device is not
    /// shared with lpmm).
    pub lpmm_reserved: u64,
    /// Of the segments, bytes reserved for parameters' slots.
    pub lpmm_in_use: u64,
}

/// The memory of burn's wgpu `device` now (`None` for another device).
pub fn memory(device: &Device) -> Option<DeviceMemory> {
    use burn_cubecl::cubecl::MemoryScope;
    use cubecl_runtime::runtime::Runtime;
    let CubeDevice::Wgpu(w) = cube_device(device)? else {
        return None;
    };
    let client = <burn_cubecl::cubecl::wgpu::WgpuRuntime as Runtime>::client(&w);
    let usage = client.memory_report(MemoryScope::Device).usage();
    let lpmm = backend(device);
    Some(DeviceMemory {
        burn_reserved: usage.bytes_reserved,
        burn_in_use: usage.bytes_in_use,
        lpmm_reserved: lpmm.as_ref().map_or(0, |l| {
            4 * (l.segments() as u64 * l.segment_words() as u64 + l.options().io_floats as u64)
        }),
        lpmm_in_use: lpmm.map_or(0, |l| 4 * l.reserved_words()),
    })
}
