//! The kernels compiled for the host (feature `emulate`): kernels/emulate.cpp runs each block's
//! 256 threads as fibers on the calling thread, round-robin between `__syncthreads`.

use lpmm_backend::abi::{Desc, Entry};
use lpmm_optim::backend::BackendError;

unsafe extern "C" {
    fn lpmm_emulate(
        kernel: u32,
        grid: u32,
        descs: *const Desc,
        ndesc: u32,
        maps: *const u32,
        flags: *mut u32,
    ) -> i32;
    fn lpmm_emulate_plan(
        plan: u32,
        grid: u32,
        descs: *const Desc,
        ndesc: u32,
        maps: *const u32,
        flags: *mut u32,
    ) -> i32;
    fn lpmm_emulate_layout(out: *mut u32);
}

/// Runs `entry` over `grid` blocks; `maps` and `flags` are host addresses of the emulated
/// device's buffers.
pub(crate) fn launch(
    entry: Entry,
    grid: u32,
    descs: &[Desc],
    maps: u64,
    flags: u64,
) -> Result<(), BackendError> {
    // SAFETY: `descs` is live for the call; every address in it, and `maps` and `flags`, are
    // host addresses of live buffers of the emulated device (`Mem::Host`, held by lpmm-backend's
    // `Device` across the launch, which no Rust code touches meanwhile) or of host memory lent
    // to a `CudaView` for its lifetime, which outlives the call; regions are sized for their
    // items' elements and the kernels stay inside them (the contract of a GPU launch).
    let rc = unsafe {
        lpmm_emulate(
            entry as u32,
            grid,
            descs.as_ptr(),
            descs.len() as u32,
            maps as *const u32,
            flags as *mut u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(BackendError::Driver {
            backend: crate::device::NAME,
            what: format!("emulated launch of {} failed ({rc})", entry.name()),
            source: None,
        })
    }
}

/// Runs specialized step `plan` (an index into lpmm-backend's `plans`) over `grid` blocks, as
/// [`launch`] runs an entry.
pub(crate) fn launch_plan(
    plan: usize,
    grid: u32,
    descs: &[Desc],
    maps: u64,
    flags: u64,
) -> Result<(), BackendError> {
    // SAFETY: as in `launch`: the same descriptors and buffers, and a plan's kernel touches only
    // its items' regions (whole blocks, as the host cut them) and io.
    let rc = unsafe {
        lpmm_emulate_plan(
            plan as u32,
            grid,
            descs.as_ptr(),
            descs.len() as u32,
            maps as *const u32,
            flags as *mut u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(BackendError::Driver {
            backend: crate::device::NAME,
            what: format!("emulated launch of specialized step {plan} failed ({rc})"),
            source: None,
        })
    }
}

/// `sizeof(Desc)`, `offsetof(Desc, slots)` and `sizeof(SlotDesc)` as the C++ compiler lays them
/// out.
pub(crate) fn layout() -> [u32; 3] {
    let mut out = [0u32; 3];
    // SAFETY: writes exactly three u32 into `out`.
    unsafe { lpmm_emulate_layout(out.as_mut_ptr()) };
    out
}
