//! Shared by the wgpu tests: the adapter (or a clear skip) and small layout options; the
//! comparisons themselves are lpmm-optim's conformance suite (`lpmm_optim::testing`).

#![allow(dead_code)]

use std::sync::OnceLock;

use lpmm_wgpu::{Wgpu, WgpuOptions};

/// A fresh backend (its own memory) with `options`, or `None` with a message when no adapter
/// exists. With `LPMM_REQUIRE_WGPU=1` (as `.ci/run` sets it) a missing adapter fails the test
/// instead. Every backend of a test binary is made on one device ([`Wgpu::on_same_device`]), so
/// the kernels compile once per binary, not once per test (lavapipe takes seconds per entry).
pub fn backend(options: WgpuOptions) -> Option<Wgpu> {
    static BASE: OnceLock<Result<Wgpu, String>> = OnceLock::new();
    let base = BASE.get_or_init(|| Wgpu::new(WgpuOptions::default()).map_err(|e| e.to_string()));
    let base = or_skip(base.as_ref().map_err(Clone::clone))?;
    Some(
        base.on_same_device(options)
            .expect("a backend on the device the first one made"),
    )
}

/// A backend on a device of its own (its kernels compiled for it: for options that change the
/// kernels, such as `software_arithmetic`), or `None` as [`backend`] gives it.
pub fn own_backend(options: WgpuOptions) -> Option<Wgpu> {
    or_skip(Wgpu::new(options).map_err(|e| e.to_string()))
}

/// The value, or `None` with a message that the test is skipped (a failure with
/// `LPMM_REQUIRE_WGPU=1`).
fn or_skip<T>(made: Result<T, String>) -> Option<T> {
    match made {
        Ok(v) => Some(v),
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_WGPU=1 but {e}");
            }
            eprintln!("skipping the wgpu test: {e}");
            None
        }
    }
}

/// Small segments, pieces and io buffer, so that parameters span pieces and segments and
/// dispatches are cut into batches (the results must not depend on any of it). A segment holds
/// the largest parameter's tensor-wide statistics (CAME's two factorized states of the suite's
/// [3, 9000] tensor: 72,026 words) and a piece of 8192 elements in five f32 slots (40,960), not
/// the suite's largest tensor (28,576 elements in five f32 slots).
pub fn small() -> WgpuOptions {
    WgpuOptions::default()
        .with_segment_bytes(320 << 10)
        .with_piece_elements(8192)
        .with_io_bytes(40 << 10)
}
