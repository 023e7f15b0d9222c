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
    fn lpmm_emulate_force_cold(on: i32);
    fn lpmm_emulate_exact_quotient(a: f32, b: f32, rb: f32) -> f32;
    fn lpmm_emulate_exact_bf16(x: f32, r: u32, stochastic: i32) -> u32;
    fn lpmm_emulate_exact_bucket(y: f32, linear: i32) -> u32;
    fn lpmm_emulate_codes(
        maps: *const u32,
        map: u32,
        stochastic: i32,
        linear: i32,
        ys: *const f32,
        rs: *const u32,
        n: u32,
        out: *mut u32,
    );
}

/// Test hooks into the emulated kernels (not part of the crate's API): the specialized steps'
/// cold paths forced, and kernels/exact.cuh's shortcuts and the steps' code search as the
/// kernels compute them (the same C++), for crates/lpmm-cuda/tests/exact.rs and tests/plans.rs.
pub mod testing {
    /// Makes the specialized steps launched from the calling thread take every cold path they
    /// have (plan_lanes.cuh `PLAN_FORCE_COLD`), or (`false`) only those they must.
    pub fn force_cold_paths(on: bool) {
        // SAFETY: sets a thread-local flag of the emulation.
        unsafe { super::lpmm_emulate_force_cold(i32::from(on)) }
    }

    /// exact.cuh `exact_quotient(a, b, rb)`.
    pub fn quotient(a: f32, b: f32, rb: f32) -> f32 {
        // SAFETY: a pure function of its arguments.
        unsafe { super::lpmm_emulate_exact_quotient(a, b, rb) }
    }

    /// exact.cuh `exact_bf16_nearest(x)` (`stochastic` false) or `exact_bf16_stochastic(x, r)`:
    /// the bf16 in the top half of the result.
    pub fn bf16(x: f32, r: u32, stochastic: bool) -> u32 {
        // SAFETY: a pure function of its arguments.
        unsafe { super::lpmm_emulate_exact_bf16(x, r, i32::from(stochastic)) }
    }

    /// exact.cuh `exact_linear_bucket(y)` (`linear`) or `exact_bucket(y)`.
    pub fn bucket(y: f32, linear: bool) -> u32 {
        // SAFETY: a pure function of its arguments.
        unsafe { super::lpmm_emulate_exact_bucket(y, i32::from(linear)) }
    }

    /// The codes plan_lanes.cuh's `plan_nearest` (or, `stochastic`, `plan_stochastic` with the
    /// draws `rs`) gives `ys` with map `map` (an id of lpmm-backend's `abi::map_table`), its
    /// buckets `linear` or logarithmic (lpmm-backend's `plans::buckets`). Panics if `rs` is
    /// shorter than `ys` where stochastic.
    pub fn codes(map: u32, stochastic: bool, linear: bool, ys: &[f32], rs: &[u32]) -> Vec<u32> {
        assert!(!stochastic || rs.len() >= ys.len(), "a draw per value");
        let table = lpmm_backend::abi::map_table();
        let zeros = vec![0u32; ys.len()];
        let rs = if stochastic { rs } else { &zeros };
        let mut out = vec![0u32; ys.len()];
        assert!(
            (map as usize) < lpmm_optim::MapKind::ALL.len(),
            "no map {map}"
        );
        // SAFETY: `table` holds every map (abi.rs `map_table`) and `map` was checked against it
        // above; `ys`, `rs` and `out` hold `ys.len()` elements; the emulation's shared memory is
        // a thread-local array of the calling thread.
        unsafe {
            super::lpmm_emulate_codes(
                table.as_ptr(),
                map,
                i32::from(stochastic),
                i32::from(linear),
                ys.as_ptr(),
                rs.as_ptr(),
                ys.len() as u32,
                out.as_mut_ptr(),
            )
        };
        out
    }
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
