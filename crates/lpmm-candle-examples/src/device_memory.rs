//! The memory one training process holds: its host memory (`VmHWM`, `VmRSS`) on every device,
//! and on a CUDA device (feature `cuda`) the device memory, measured two ways:
//!
//! - **The driver's figure, sampled.** A thread reads the device's used memory (`cuMemGetInfo`:
//!   total minus free, everything every context on the device holds) every millisecond from
//!   [`MemoryWatch::start`] to [`MemoryWatch::finish`]. Its first reading is the baseline (this
//!   process's CUDA context and loaded modules, before the model exists); the peak is the highest
//!   reading. A peak shorter than a millisecond can be missed. On a GPU no other process uses,
//!   this is the process's device memory, what `nvidia-smi` shows for it.
//! - **The stream-ordered pool's high-water marks.** candle and lpmm-cuda allocate through cudarc,
//!   which takes device memory from the device's default memory pool (`cuMemAllocAsync`) where
//!   the device supports it: `CU_MEMPOOL_ATTR_USED_MEM_HIGH` is the most memory ever handed out
//!   at once (every tensor, every lpmm buffer), exact, and `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH` the
//!   most the pool ever held from the driver (freed blocks it kept for reuse included). Both are
//!   reset when the watch starts. What the pool does not see: the CUDA context, module images,
//!   cuBLAS's workspace (allocated with `cudaMalloc`) and the pool's own rounding.

use serde::{Deserialize, Serialize};

/// The device memory a [`MemoryWatch`] measured on a CUDA device, bytes.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// The device's total memory.
    pub total: u64,
    /// Used memory at the first reading (the context and modules, before the model).
    pub baseline: u64,
    /// The highest used memory the sampler read.
    pub peak: u64,
    /// Used memory at the last reading.
    pub last: u64,
    /// Readings taken.
    pub samples: u64,
    /// The pool's most memory handed out at once (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`); `None`
    /// without a stream-ordered pool.
    pub pool_used_high: Option<u64>,
    /// The pool's most memory held from the driver (`CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`).
    pub pool_reserved_high: Option<u64>,
}

/// The host memory of this process, bytes (Linux; 0 elsewhere).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct HostMemory {
    /// Peak resident memory (`VmHWM`).
    pub peak_rss: u64,
    /// Resident memory at the end (`VmRSS`).
    pub rss: u64,
}

impl HostMemory {
    /// Now.
    pub fn now() -> Self {
        HostMemory {
            peak_rss: crate::footprint::proc_status_bytes("VmHWM").unwrap_or(0),
            rss: crate::footprint::proc_status_bytes("VmRSS").unwrap_or(0),
        }
    }
}

/// Watches a device's memory from `start` to `finish` (a no-op on the CPU).
#[derive(Debug)]
pub struct MemoryWatch {
    #[cfg(feature = "cuda")]
    cuda: Option<cuda::Watch>,
}

impl MemoryWatch {
    /// Starts watching `device`: on a CUDA device, the sampler thread starts and the pool's
    /// high-water marks are reset.
    pub fn start(device: &candle_core::Device) -> candle_core::Result<Self> {
        match device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => Ok(MemoryWatch {
                cuda: Some(cuda::Watch::start(d)?),
            }),
            _ => {
                let _ = device;
                Ok(MemoryWatch {
                    #[cfg(feature = "cuda")]
                    cuda: None,
                })
            }
        }
    }

    /// Stops watching: the device's figures (`None` on the CPU).
    pub fn finish(self) -> candle_core::Result<Option<DeviceMemory>> {
        #[cfg(feature = "cuda")]
        if let Some(w) = self.cuda {
            return w.finish().map(Some);
        }
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::thread::JoinHandle;
    use std::time::Duration;

    use candle_core::cuda_backend::CudaDevice;
    use candle_core::cuda_backend::cudarc::driver::{CudaContext, result, sys};
    use candle_core::{Error, Result};

    use super::DeviceMemory;

    #[derive(Debug)]
    pub(super) struct Watch {
        ctx: Arc<CudaContext>,
        stop: Arc<AtomicBool>,
        sampler: JoinHandle<DeviceMemory>,
        pool: Option<sys::CUmemoryPool>,
    }

    fn used(ctx: &CudaContext) -> Option<(u64, u64)> {
        let (free, total) = ctx.mem_get_info().ok()?;
        Some(((total - free) as u64, total as u64))
    }

    /// The device's default memory pool, where it has one.
    fn default_pool(ctx: &CudaContext) -> Option<sys::CUmemoryPool> {
        if !ctx.has_async_alloc() {
            return None;
        }
        ctx.bind_to_thread().ok()?;
        // SAFETY: `cu_device` is the device handle of a live context (cudarc's `CudaContext`
        // keeps it); the call only writes the pool handle it returns.
        unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }.ok()
    }

    /// A pool attribute of type `cuuint64_t`.
    fn attribute(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Option<u64> {
        let mut value: u64 = 0;
        // SAFETY: `pool` is the device's default pool (it lives as long as the context), and the
        // high-water attributes are `cuuint64_t` values, written into `value`.
        unsafe {
            result::mem_pool::get_attribute(
                pool,
                attr,
                (&raw mut value).cast::<core::ffi::c_void>(),
            )
        }
        .ok()?;
        Some(value)
    }

    /// Resets a high-water attribute (the driver accepts only 0).
    fn reset(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Option<()> {
        let mut zero: u64 = 0;
        // SAFETY: as in `attribute`; setting a high-water mark to 0 resets it to the current
        // value.
        unsafe {
            result::mem_pool::set_attribute(pool, attr, (&raw mut zero).cast::<core::ffi::c_void>())
        }
        .ok()
    }

    const USED_HIGH: sys::CUmemPool_attribute =
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
    const RESERVED_HIGH: sys::CUmemPool_attribute =
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH;

    impl Watch {
        pub(super) fn start(device: &CudaDevice) -> Result<Self> {
            let stream = device.cuda_stream();
            let ctx = stream.context().clone();
            let pool = default_pool(&ctx);
            if let Some(p) = pool {
                reset(p, USED_HIGH);
                reset(p, RESERVED_HIGH);
            }
            let (baseline, total) =
                used(&ctx).ok_or_else(|| Error::Msg("cuMemGetInfo failed".into()))?;
            let stop = Arc::new(AtomicBool::new(false));
            let sampler = {
                let (ctx, stop) = (ctx.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut m = DeviceMemory {
                        total,
                        baseline,
                        peak: baseline,
                        last: baseline,
                        samples: 1,
                        ..DeviceMemory::default()
                    };
                    while !stop.load(Ordering::Relaxed) {
                        if let Some((u, _)) = used(&ctx) {
                            m.peak = m.peak.max(u);
                            m.last = u;
                            m.samples += 1;
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    m
                })
            };
            Ok(Watch {
                ctx,
                stop,
                sampler,
                pool,
            })
        }

        pub(super) fn finish(self) -> Result<DeviceMemory> {
            // A last reading after all queued work.
            self.ctx.synchronize().map_err(Error::wrap)?;
            self.stop.store(true, Ordering::Relaxed);
            let mut m = self
                .sampler
                .join()
                .map_err(|_| Error::Msg("the memory sampler panicked".into()))?;
            if let Some((u, _)) = used(&self.ctx) {
                m.peak = m.peak.max(u);
                m.last = u;
            }
            if let Some(p) = self.pool {
                m.pool_used_high = attribute(p, USED_HIGH);
                m.pool_reserved_high = attribute(p, RESERVED_HIGH);
            }
            Ok(m)
        }
    }
}
