//! The runtime under lpmm-backend's `Device`: a CUDA device through cudarc (memory, copies and
//! launches enqueued on one stream, the caller's or the backend's own), or, with the `emulate`
//! feature, host memory and the kernels compiled for the CPU (kernels/emulate.cpp). Addresses
//! are pointers either way: device pointers, or host addresses on the emulated device.

#[cfg(feature = "emulate")]
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg, result, sys,
};
use lpmm_backend::abi::{Binding, Entry, THREADS};
use lpmm_backend::{Io, Launch, Limits, Runtime, Specialized};
use lpmm_optim::backend::BackendError;
use lpmm_optim::backend::Dtype;

use crate::{CudaError, CudaView};

pub(crate) const NAME: &str = "cuda";

/// A CUDA device: the stream every operation is enqueued on, and the loaded kernels.
pub(crate) struct Gpu {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) arch: &'static str,
    pub(crate) name: String,
    /// In `Entry` order.
    functions: Vec<CudaFunction>,
    /// The specialized steps (lpmm-backend's `plans`), in plan order, each with the most blocks
    /// its launches use (every SM's share of resident blocks: a block walks several tiles).
    plans: Vec<(CudaFunction, u32)>,
    _module: Arc<CudaModule>,
    /// The descriptors of the latest launch (replaced, larger, only after a synchronisation).
    descs: Mutex<Option<CudaBuffer>>,
}

pub(crate) enum Dev {
    Gpu(Gpu),
    #[cfg(feature = "emulate")]
    Host,
}

/// The CUDA runtime under lpmm-backend's [`lpmm_backend::Device`] (see [`crate::Cuda`]).
pub struct CudaRuntime {
    pub(crate) dev: Dev,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.dev {
            Dev::Gpu(g) => write!(f, "CudaRuntime({}, {})", g.name, g.arch),
            #[cfg(feature = "emulate")]
            Dev::Host => f.write_str("CudaRuntime(host emulation)"),
        }
    }
}

/// Device memory of the runtime: `words` 32-bit words at `ptr`.
pub struct CudaBuffer {
    words: usize,
    ptr: u64,
    // Read only by the emulated device; owns the memory at `ptr` either way.
    #[cfg_attr(not(feature = "emulate"), allow(dead_code))]
    mem: Mem,
}

enum Mem {
    /// Owns the memory at `ptr` (kept for its drop).
    Gpu(#[allow(dead_code)] CudaSlice<u32>),
    /// Host memory the emulated kernels write through raw pointers (atomics give the interior
    /// mutability; the kernels run while no Rust code touches the words): the buffer's words
    /// start at the given word of the allocation, the first at a multiple of 16 bytes (as a
    /// device allocation's, which the specialized steps' vector accesses need).
    #[cfg(feature = "emulate")]
    Host(Box<[AtomicU32]>, usize),
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBuffer({} words at {:#x})", self.words, self.ptr)
    }
}

/// A driver error as the backend reports it: the errors after which the context is unusable
/// (CUDA's sticky errors) lose the device.
pub(crate) fn driver(what: &str, e: DriverError) -> BackendError {
    use sys::CUresult::*;
    match e.0 {
        CUDA_ERROR_DEINITIALIZED
        | CUDA_ERROR_ECC_UNCORRECTABLE
        | CUDA_ERROR_ILLEGAL_ADDRESS
        | CUDA_ERROR_CONTEXT_IS_DESTROYED
        | CUDA_ERROR_HARDWARE_STACK_ERROR
        | CUDA_ERROR_ILLEGAL_INSTRUCTION
        | CUDA_ERROR_MISALIGNED_ADDRESS
        | CUDA_ERROR_INVALID_ADDRESS_SPACE
        | CUDA_ERROR_INVALID_PC
        | CUDA_ERROR_LAUNCH_FAILED => BackendError::DeviceLost {
            backend: NAME,
            reason: format!("{what}: {e}"),
        },
        _ => BackendError::Driver {
            backend: NAME,
            what: format!("{what}: {e}"),
            source: Some(Arc::new(e)),
        },
    }
}

fn out_of_range(what: &str) -> BackendError {
    BackendError::Buffer {
        what: format!("{what} outside the buffer"),
    }
}

/// The names the CUDA driver library goes by (cudarc's dynamic loading tries these among others).
const DRIVER_NAMES: &[&str] = if cfg!(windows) {
    &["nvcuda.dll"]
} else {
    &["libcuda.so.1", "libcuda.so"]
};

/// Whether the CUDA driver library can be loaded (cudarc panics on first use otherwise).
///
/// Checked with libloading rather than cudarc's `is_culib_present`, which exists only where
/// cudarc loads the driver at run time: in a build that also has candle-core's `cuda` feature
/// (lpmm-candle's `cuda`), cudarc links the driver instead (its `dynamic-linking`, which wins over
/// the workspace's `fallback-dynamic-loading`), and this check still compiles and answers.
pub(crate) fn driver_present() -> bool {
    DRIVER_NAMES.iter().any(|name| {
        // SAFETY: opening the NVIDIA driver library runs only its own initialisers (as cudarc's
        // loading does); no symbol of it is used, and the handle is closed again at once.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

/// Device `ordinal`'s context and a new stream on it.
pub(crate) fn open(ordinal: usize) -> Result<Arc<CudaStream>, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let count = CudaContext::device_count().map_err(|e| driver("device count", e))?;
    if ordinal >= count.max(0) as usize {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| driver("creating the context", e))?;
    Ok(ctx
        .new_stream()
        .map_err(|e| driver("creating a stream", e))?)
}

impl Gpu {
    fn bind(&self) -> Result<(), BackendError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| driver("binding the context", e))
    }
}

impl CudaRuntime {
    /// The runtime on `stream`'s device, with the committed PTX for its architecture loaded.
    pub(crate) fn gpu(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        let ctx = stream.context().clone();
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("compute capability", e))?;
        let (arch, ptx) =
            crate::kernels::ptx_for(major, minor).ok_or(CudaError::Arch { major, minor })?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| driver("loading the PTX", e))?;
        let functions = Entry::ALL
            .iter()
            .map(|e| {
                module
                    .load_function(e.name())
                    .map_err(|x| driver(e.name(), x))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver("multiprocessor count", e))?;
        let plans = lpmm_backend::plans::plans()
            .iter()
            .map(|p| {
                let f = module
                    .load_function(&p.name)
                    .map_err(|x| driver(&p.name, x))?;
                let resident = f
                    .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)
                    .map_err(|x| driver(&p.name, x))?;
                Ok((f, resident.max(1) * sms.max(1) as u32))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let name = ctx.name().unwrap_or_default();
        Ok(Self {
            dev: Dev::Gpu(Gpu {
                stream,
                arch,
                name,
                functions,
                plans,
                _module: module,
                descs: Mutex::new(None),
            }),
        })
    }

    #[cfg(feature = "emulate")]
    pub(crate) fn host() -> Self {
        Self { dev: Dev::Host }
    }

    /// `words` zeroed words (at least one).
    pub(crate) fn alloc_words(&self, words: usize) -> Result<CudaBuffer, BackendError> {
        let words = words.max(1);
        let mem = match &self.dev {
            Dev::Gpu(g) => Mem::Gpu(g.stream.alloc_zeros::<u32>(words).map_err(|e| {
                if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    BackendError::OutOfMemory {
                        backend: NAME,
                        bytes: 4 * words as u64,
                    }
                } else {
                    driver("allocating", e)
                }
            })?),
            #[cfg(feature = "emulate")]
            Dev::Host => {
                let all: Box<[AtomicU32]> = (0..words + 3).map(|_| AtomicU32::new(0)).collect();
                let skip = (all.as_ptr() as usize).wrapping_neg() / 4 % 4;
                Mem::Host(all, skip)
            }
        };
        let ptr = match (&self.dev, &mem) {
            (Dev::Gpu(g), Mem::Gpu(s)) => s.device_ptr(&g.stream).0,
            #[cfg(feature = "emulate")]
            (_, Mem::Host(h, skip)) => h[*skip..].as_ptr() as u64,
            #[cfg(feature = "emulate")]
            _ => unreachable!("memory of this device"),
        };
        Ok(CudaBuffer { words, ptr, mem })
    }

    /// Copies all of `src` into `dst` (as long), device to device.
    pub(crate) fn copy(&self, src: &CudaBuffer, dst: &CudaBuffer) -> Result<(), BackendError> {
        if src.words > dst.words {
            return Err(out_of_range("a copy"));
        }
        match &self.dev {
            Dev::Gpu(g) => {
                g.bind()?;
                // SAFETY: both are live allocations of this context, `dst` at least as long as
                // `src`; the copy is ordered on the stream with everything that uses them.
                unsafe {
                    result::memcpy_dtod_async(dst.ptr, src.ptr, 4 * src.words, g.stream.cu_stream())
                }
                .map_err(|e| driver("device copy", e))
            }
            #[cfg(feature = "emulate")]
            Dev::Host => self.write(dst, 0, &self.read(src, 0, src.words)?),
        }
    }

    /// Waits until the stream has run everything enqueued so far.
    pub(crate) fn synchronize(&self) -> Result<(), BackendError> {
        match &self.dev {
            Dev::Gpu(g) => g.stream.synchronize().map_err(|e| driver("synchronize", e)),
            #[cfg(feature = "emulate")]
            Dev::Host => Ok(()),
        }
    }

    #[cfg(feature = "emulate")]
    fn host_words(buffer: &CudaBuffer) -> Result<&[AtomicU32], BackendError> {
        match &buffer.mem {
            #[cfg(feature = "emulate")]
            Mem::Host(h, skip) => Ok(&h[*skip..*skip + buffer.words]),
            Mem::Gpu(_) => Err(BackendError::Buffer {
                what: "a CUDA buffer of another device".into(),
            }),
        }
    }
}

impl Runtime for CudaRuntime {
    type Buffer = CudaBuffer;
    type View<'a> = CudaView<'a>;

    fn name(&self) -> &'static str {
        NAME
    }

    fn limits(&self) -> Limits {
        Limits {
            arena_words: None,
            bindless: true,
        }
    }

    fn alloc(&self, words: usize) -> Result<CudaBuffer, BackendError> {
        self.alloc_words(words)
    }

    fn len(&self, buffer: &CudaBuffer) -> usize {
        buffer.words
    }

    fn write(&self, buffer: &CudaBuffer, at: usize, data: &[u32]) -> Result<(), BackendError> {
        if at + data.len() > buffer.words {
            return Err(out_of_range("a write"));
        }
        if data.is_empty() {
            return Ok(());
        }
        match &self.dev {
            Dev::Gpu(g) => {
                g.bind()?;
                // SAFETY: words `at ..` of a live allocation of this context (checked above);
                // the driver has copied the pageable `data` before the call returns, and the
                // copy is ordered on the stream after every launch that reads the words.
                unsafe {
                    result::memcpy_htod_async(
                        buffer.ptr + 4 * at as u64,
                        data,
                        g.stream.cu_stream(),
                    )
                }
                .map_err(|e| driver("copy to device", e))
            }
            #[cfg(feature = "emulate")]
            Dev::Host => {
                let words = Self::host_words(buffer)?;
                for (w, &x) in words[at..at + data.len()].iter().zip(data) {
                    w.store(x, Ordering::Relaxed);
                }
                Ok(())
            }
        }
    }

    fn read(&self, buffer: &CudaBuffer, at: usize, len: usize) -> Result<Vec<u32>, BackendError> {
        if at + len > buffer.words {
            return Err(out_of_range("a read"));
        }
        match &self.dev {
            Dev::Gpu(g) => {
                let mut out = vec![0u32; len];
                g.bind()?;
                // SAFETY: words `at .. at + len` of a live allocation of this context (checked
                // above) into `out`, as long; the copy follows every launch enqueued before it,
                // and `out` is not touched until the stream has synchronised.
                unsafe {
                    result::memcpy_dtoh_async(
                        &mut out,
                        buffer.ptr + 4 * at as u64,
                        g.stream.cu_stream(),
                    )
                }
                .map_err(|e| driver("copy from device", e))?;
                self.synchronize()?;
                Ok(out)
            }
            #[cfg(feature = "emulate")]
            Dev::Host => Ok(Self::host_words(buffer)?[at..at + len]
                .iter()
                .map(|w| w.load(Ordering::Relaxed))
                .collect()),
        }
    }

    fn address(&self, _binding: Binding, buffer: &CudaBuffer, word: usize) -> u64 {
        buffer.ptr + 4 * word as u64
    }

    fn view_info(&self, view: &CudaView<'_>) -> (Dtype, usize) {
        (view.dtype(), view.len())
    }

    fn shorten<'a, 'b: 'a>(view: CudaView<'b>) -> CudaView<'a> {
        view
    }

    fn lent_address(&self, view: &CudaView<'_>, word: usize) -> u64 {
        view.ptr() + 4 * word as u64
    }

    fn io_address(&self, io: &Io<'_, '_, Self>, element: usize) -> u64 {
        match io {
            Io::Staging(b) => b.ptr + 4 * element as u64,
            Io::View(v) => v.ptr() + (element * v.dtype().size()) as u64,
        }
    }

    fn read_view(&self, view: &CudaView<'_>) -> Result<Vec<u8>, BackendError> {
        let mut out = vec![0u8; view.len() * view.dtype().size()];
        match &self.dev {
            Dev::Gpu(g) => {
                g.bind()?;
                // SAFETY: the view addresses `out.len()` bytes of this context's memory, live for
                // its lifetime (its constructor's contract); `out` is untouched until the stream
                // has synchronised.
                unsafe { result::memcpy_dtoh_async(&mut out, view.ptr(), g.stream.cu_stream()) }
                    .map_err(|e| driver("copy from a caller's buffer", e))?;
                self.synchronize()?;
            }
            #[cfg(feature = "emulate")]
            // SAFETY: an emulated view is host memory borrowed mutably for its lifetime
            // (`CudaView::host`, or `from_raw`'s contract), `out.len()` bytes long, and no
            // kernel runs while this copies it.
            Dev::Host => unsafe {
                std::ptr::copy_nonoverlapping(view.ptr() as *const u8, out.as_mut_ptr(), out.len())
            },
        }
        Ok(out)
    }

    fn write_view(&self, view: &CudaView<'_>, bytes: &[u8]) -> Result<(), BackendError> {
        if bytes.len() != view.len() * view.dtype().size() {
            return Err(out_of_range("a write of a caller's buffer"));
        }
        match &self.dev {
            Dev::Gpu(g) => {
                g.bind()?;
                // SAFETY: the view addresses `bytes.len()` bytes of this context's memory, live
                // for its lifetime; the driver has copied the pageable `bytes` on return.
                unsafe { result::memcpy_htod_async(view.ptr(), bytes, g.stream.cu_stream()) }
                    .map_err(|e| driver("copy to a caller's buffer", e))
            }
            #[cfg(feature = "emulate")]
            Dev::Host => {
                // SAFETY: as in `read_view`: host memory lent mutably to the view, as long.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        view.ptr() as *mut u8,
                        bytes.len(),
                    )
                };
                Ok(())
            }
        }
    }

    fn launch(&self, entry: Entry, launch: &Launch<'_, '_, Self>) -> Result<(), BackendError> {
        if launch.tiles == 0 || launch.descs.is_empty() {
            return Ok(());
        }
        // The kernels address regions in words: a lent parameter's buffer must be aligned.
        let addresses = launch
            .descs
            .iter()
            .flat_map(|d| d.slots.iter())
            .flat_map(|s| s.region);
        if addresses.into_iter().any(|a| a % 4 != 0) {
            return Err(BackendError::Buffer {
                what: "a lent parameter's buffer must start at a multiple of 4 bytes".into(),
            });
        }
        let ndesc = launch.descs.len() as u32;
        let (maps, flags) = (launch.maps.ptr, launch.flags.ptr);
        match &self.dev {
            Dev::Gpu(g) => {
                let words: &[u32] = bytemuck::cast_slice(launch.descs);
                let mut scratch = g.descs.lock().unwrap_or_else(|e| e.into_inner());
                if scratch.as_ref().is_none_or(|b| b.words < words.len()) {
                    // The old buffer may still be read by a launch in flight.
                    self.synchronize()?;
                    *scratch = Some(self.alloc_words(words.len().next_power_of_two())?);
                }
                let descs = scratch.as_ref().expect("allocated above");
                self.write(descs, 0, words)?;
                // A specialized step's blocks each walk a share of the tiles.
                let (function, grid) = match launch.plan {
                    Some(k) if entry == Entry::Step => {
                        let (f, most) = g.plans.get(k).ok_or_else(|| BackendError::Driver {
                            backend: NAME,
                            what: format!("no specialized step {k} in the loaded PTX"),
                            source: None,
                        })?;
                        (f, launch.tiles.min(*most))
                    }
                    _ => (&g.functions[entry as usize], launch.tiles),
                };
                let cfg = LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut args = g.stream.launch_builder(function);
                args.arg(&descs.ptr).arg(&ndesc).arg(&maps).arg(&flags);
                // SAFETY: the arguments match the entry's signature in kernels/entries.cuh
                // (`const Desc*, uint32_t, const uint32_t*, uint32_t*`, pointers as 64-bit
                // addresses). The descriptors were written by lpmm-backend's `Device`, whose
                // regions lie inside live allocations it holds (or lent views, live for the
                // call), sized for their items' elements; `io` points at staging or a caller's
                // view with room for every item's elements; every block touches only its item's.
                unsafe { args.launch(cfg) }
                    .map(drop)
                    .map_err(|e| driver(entry.name(), e))
            }
            #[cfg(feature = "emulate")]
            Dev::Host => match launch.plan {
                Some(k) if entry == Entry::Step => {
                    crate::emulate::launch_plan(k, launch.tiles, launch.descs, maps, flags)
                }
                _ => crate::emulate::launch(entry, launch.tiles, launch.descs, maps, flags),
            },
        }
    }

    /// The specialized steps run items whose regions and io start at multiples of 16 bytes
    /// (their 16-byte accesses; the device pads regions to it) and are whole blocks.
    fn specialized(&self) -> Specialized {
        Specialized::Aligned { bytes: 16 }
    }
}
