//! Where the backend's memory lives and how kernels run: a CUDA device through cudarc (every
//! operation enqueued on one stream, the user's or the backend's own), or, with the `emulate`
//! feature, host memory and the kernels compiled for the CPU (kernels/emulate.cpp).

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg,
};

use crate::{CudaError, Desc, THREADS};

/// The kernels, in the order of `KERNELS` in kernels/emulate.cpp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    Init = 0,
    Accumulate = 1,
    Decode = 2,
    Clear = 3,
    Step = 4,
}

const NAMES: [&str; 5] = [
    "lpmm_init",
    "lpmm_accumulate",
    "lpmm_decode",
    "lpmm_clear",
    "lpmm_step",
];

/// A CUDA device: its context, the stream every operation is enqueued on, and the loaded kernels.
pub(crate) struct Gpu {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) arch: &'static str,
    pub(crate) name: String,
    functions: Vec<CudaFunction>,
    _module: Arc<CudaModule>,
}

pub(crate) enum Device {
    Gpu(Gpu),
    #[cfg(feature = "emulate")]
    Host,
}

/// The buffers a launch reads and writes besides the tensors' own (which the descriptors address).
#[derive(Clone, Copy)]
pub(crate) struct LaunchBufs<'a> {
    pub(crate) descs: &'a Buf,
    pub(crate) io: &'a Buf,
    pub(crate) maps: &'a Buf,
    pub(crate) flags: &'a Buf,
}

/// Device memory, in 32-bit words.
pub(crate) enum Buf {
    Gpu(CudaSlice<u32>),
    /// Host memory the emulated kernels write through raw pointers (atomics give the interior
    /// mutability; the kernels run while no Rust code touches the words).
    #[cfg(feature = "emulate")]
    Host(Box<[std::sync::atomic::AtomicU32]>),
}

impl Buf {
    pub(crate) fn len(&self) -> usize {
        match self {
            Buf::Gpu(s) => s.len(),
            #[cfg(feature = "emulate")]
            Buf::Host(h) => h.len(),
        }
    }
}

fn driver(what: &str, e: DriverError) -> CudaError {
    CudaError::Driver(format!("{what}: {e}"))
}

impl Gpu {
    pub(crate) fn new(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        let ctx = stream.context().clone();
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("compute capability", e))?;
        let (arch, ptx) =
            crate::kernels::ptx_for(major, minor).ok_or(CudaError::Arch { major, minor })?;
        let name = ctx.name().unwrap_or_default();
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| driver("loading the PTX", e))?;
        let functions = NAMES
            .iter()
            .map(|n| module.load_function(n).map_err(|e| driver(n, e)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Gpu {
            stream,
            arch,
            name,
            functions,
            _module: module,
        })
    }
}

impl Device {
    /// `words` zeroed words.
    pub(crate) fn alloc(&self, words: usize) -> Result<Buf, CudaError> {
        let words = words.max(1);
        match self {
            Device::Gpu(g) => g
                .stream
                .alloc_zeros::<u32>(words)
                .map(Buf::Gpu)
                .map_err(|e| driver(&format!("allocating {} bytes", 4 * words), e)),
            #[cfg(feature = "emulate")]
            Device::Host => Ok(Buf::Host((0..words).map(|_| Default::default()).collect())),
        }
    }

    /// The address of word `at` of `buf`, as the kernels see it.
    pub(crate) fn ptr(&self, buf: &Buf, at: usize) -> u64 {
        let base = match (self, buf) {
            (Device::Gpu(g), Buf::Gpu(s)) => s.device_ptr(&g.stream).0,
            #[cfg(feature = "emulate")]
            (Device::Host, Buf::Host(h)) => h.as_ptr() as u64,
            #[cfg(feature = "emulate")]
            _ => unreachable!("a buffer of another device"),
        };
        base + 4 * at as u64
    }

    /// Copies `data` to words `at..` of `buf` (enqueued; the host data may be dropped after).
    pub(crate) fn upload(&self, buf: &mut Buf, at: usize, data: &[u32]) -> Result<(), CudaError> {
        if data.is_empty() {
            return Ok(());
        }
        match (self, buf) {
            (Device::Gpu(g), Buf::Gpu(s)) => {
                let mut view = s.slice_mut(at..at + data.len());
                g.stream
                    .memcpy_htod(data, &mut view)
                    .map_err(|e| driver("copy to device", e))
            }
            #[cfg(feature = "emulate")]
            (Device::Host, Buf::Host(h)) => {
                for (w, &x) in h[at..at + data.len()].iter().zip(data) {
                    w.store(x, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(())
            }
            #[cfg(feature = "emulate")]
            _ => unreachable!("a buffer of another device"),
        }
    }

    /// Words `at..at + len` of `buf` (waits for the stream).
    pub(crate) fn download(&self, buf: &Buf, at: usize, len: usize) -> Result<Vec<u32>, CudaError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        match (self, buf) {
            (Device::Gpu(g), Buf::Gpu(s)) => g
                .stream
                .clone_dtoh(&s.slice(at..at + len))
                .map_err(|e| driver("copy from device", e)),
            #[cfg(feature = "emulate")]
            (Device::Host, Buf::Host(h)) => Ok(h[at..at + len]
                .iter()
                .map(|w| w.load(std::sync::atomic::Ordering::Relaxed))
                .collect()),
            #[cfg(feature = "emulate")]
            _ => unreachable!("a buffer of another device"),
        }
    }

    /// A copy of `buf` in new memory.
    pub(crate) fn duplicate(&self, buf: &Buf) -> Result<Buf, CudaError> {
        match (self, buf) {
            (Device::Gpu(g), Buf::Gpu(s)) => g
                .stream
                .clone_dtod(s)
                .map(Buf::Gpu)
                .map_err(|e| driver("device copy", e)),
            #[cfg(feature = "emulate")]
            (Device::Host, Buf::Host(h)) => Ok(Buf::Host(
                h.iter()
                    .map(|w| w.load(std::sync::atomic::Ordering::Relaxed).into())
                    .collect(),
            )),
            #[cfg(feature = "emulate")]
            _ => unreachable!("a buffer of another device"),
        }
    }

    /// Copies `src` into `dst` (the same length), device to device.
    pub(crate) fn copy(&self, src: &Buf, dst: &mut Buf) -> Result<(), CudaError> {
        match (self, src, dst) {
            (Device::Gpu(g), Buf::Gpu(s), Buf::Gpu(d)) => g
                .stream
                .memcpy_dtod(s, d)
                .map_err(|e| driver("device copy", e)),
            #[cfg(feature = "emulate")]
            (Device::Host, Buf::Host(s), Buf::Host(d)) => {
                for (x, y) in s.iter().zip(d.iter()) {
                    y.store(
                        x.load(std::sync::atomic::Ordering::Relaxed),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                }
                Ok(())
            }
            #[cfg(feature = "emulate")]
            _ => unreachable!("a buffer of another device"),
        }
    }

    /// Runs `kernel` over `grid` blocks with the `ndesc` descriptors at `bufs.descs` (already
    /// uploaded).
    pub(crate) fn launch(
        &self,
        kernel: Kernel,
        grid: u32,
        ndesc: u32,
        bufs: LaunchBufs<'_>,
    ) -> Result<(), CudaError> {
        if grid == 0 {
            return Ok(());
        }
        let LaunchBufs {
            descs,
            io,
            maps,
            flags,
        } = bufs;
        let d = self.ptr(descs, 0);
        let i = self.ptr(io, 0);
        let m = self.ptr(maps, 0);
        let f = self.ptr(flags, 0);
        match self {
            Device::Gpu(g) => {
                let cfg = LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let func = &g.functions[kernel as usize];
                let mut args = g.stream.launch_builder(func);
                args.arg(&d).arg(&ndesc).arg(&i).arg(&m).arg(&f);
                // SAFETY: the arguments match the kernel's signature in kernels/lpmm.cu
                // (`const Desc*, uint32_t, float*, const uint32_t*, uint32_t*`, pointers passed
                // as 64-bit addresses); the descriptors at `d` were built by `Cuda::desc`, whose
                // slot addresses point into live allocations of this device that the caller keeps
                // alive until the stream has run the launch (parameters own their buffers, and
                // the scratch buffers are only replaced after a synchronisation); every block
                // touches only words inside its tensor's regions and `io` range.
                unsafe { args.launch(cfg) }
                    .map(|_| ())
                    .map_err(|e| driver(NAMES[kernel as usize], e))
            }
            #[cfg(feature = "emulate")]
            Device::Host => crate::emulate::launch(kernel, grid, d, ndesc, i, m, f),
        }
    }

    /// Waits until every enqueued operation has run.
    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        match self {
            Device::Gpu(g) => g.stream.synchronize().map_err(|e| driver("synchronize", e)),
            #[cfg(feature = "emulate")]
            Device::Host => Ok(()),
        }
    }
}

/// Whether the CUDA driver library can be loaded (cudarc panics on first use otherwise).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library under its usual names; no driver call.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The first device's context and a new stream on it.
pub(crate) fn open(ordinal: usize) -> Result<Arc<CudaStream>, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let count = CudaContext::device_count().map_err(|e| driver("device count", e))?;
    if ordinal >= count.max(0) as usize {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| driver("creating the context", e))?;
    ctx.new_stream().map_err(|e| driver("creating a stream", e))
}

/// The size of `Desc` must match the kernels' (checked against the emulator's `sizeof`).
const _: () = assert!(std::mem::size_of::<Desc>() == 232);
