//! The kernels compiled for the host (feature `emulate`): kernels/emulate.cpp runs each block's
//! 256 threads as fibers on the calling thread, round-robin between `__syncthreads`.

use crate::CudaError;
use crate::device::Kernel;

unsafe extern "C" {
    fn lpmm_emulate(
        kernel: u32,
        grid: u32,
        descs: *const u32,
        ndesc: u32,
        io: *mut f32,
        maps: *const u32,
        flags: *mut u32,
    ) -> i32;
    fn lpmm_emulate_layout(out: *mut u32);
}

/// Runs `kernel` over `grid` blocks; the arguments are host addresses from `Device::ptr`.
pub(crate) fn launch(
    kernel: Kernel,
    grid: u32,
    descs: u64,
    ndesc: u32,
    io: u64,
    maps: u64,
    flags: u64,
) -> Result<(), CudaError> {
    // SAFETY: the addresses are those of live host buffers of the emulated device (`Buf::Host`),
    // which the backend keeps alive and does not access from Rust during the call; the
    // descriptors were built by `Cuda::desc` and point only into those buffers, at regions sized
    // for their tensors' elements, and the kernels stay inside them (the same contract as the GPU
    // launch, exercised by every test of the emulated backend).
    let rc = unsafe {
        lpmm_emulate(
            kernel as u32,
            grid,
            descs as *const u32,
            ndesc,
            io as *mut f32,
            maps as *const u32,
            flags as *mut u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(CudaError::Driver(format!("emulated launch failed ({rc})")))
    }
}

/// `sizeof(Desc)`, `offsetof(Desc, slots)` and `sizeof(Slot)` as the C++ compiler lays them out.
pub(crate) fn layout() -> [u32; 3] {
    let mut out = [0u32; 3];
    // SAFETY: writes exactly three u32 into `out`.
    unsafe { lpmm_emulate_layout(out.as_mut_ptr()) };
    out
}
