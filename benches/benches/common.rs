//! Shared bench inputs and the memory-bandwidth reference.

use criterion::{BenchmarkGroup, Throughput, measurement::WallTime};
use std::hint::black_box;
use std::time::Duration;

/// Elements per bench input: 16M f32 = 64 MiB, large enough that copies leave the L2 caches.
/// (This machine's shared L3 may still hold part of it; issue 5's benches go to 256M.)
pub const N: usize = 1 << 24;

/// Deterministic normal-ish data.
pub fn data(n: usize) -> Vec<f32> {
    lpmm_benches::data(n, 1.0)
}

/// Records a case of `group` processing `N` elements and moving `bytes` per element, read
/// against the group's memcpy.
pub fn describe(group: &str, id: &str, bytes: f64) {
    let full = format!("{group}/{id}");
    let ceiling = format!("{group}/memcpy_64MiB");
    lpmm_benches::describe(&lpmm_benches::CaseInfo {
        id: &full,
        params: N,
        bytes_per_param: bytes,
        kind: if id.starts_with("memcpy") {
            lpmm_benches::Kind::Ceiling
        } else {
            lpmm_benches::Kind::Lpmm
        },
        ceiling: if id.starts_with("memcpy") {
            None
        } else {
            Some(&ceiling)
        },
        preset: None,
    });
}

/// Ten samples, criterion's 3 s warm-up and 5 s measurement; in a smoke run (`LPMM_BENCH_QUICK=1`,
/// CI's `cargo xtask bench --quick`, whose figures nothing reports) the short ones of
/// [`lpmm_benches::times`].
pub fn configure(group: &mut BenchmarkGroup<'_, WallTime>) {
    group.sample_size(10);
    let (warm_up, measurement) =
        lpmm_benches::times((Duration::from_secs(3), Duration::from_secs(5)));
    group.warm_up_time(warm_up);
    group.measurement_time(measurement);
}

/// The reference every figure is read against: copying `N` f32 with all threads (rayon, as the
/// quantizers run), measured in the same run. Throughput counts the bytes copied (each read once
/// and written once; the sidecar counts both, 8 bytes per element).
pub fn memcpy_reference(group: &mut BenchmarkGroup<'_, WallTime>, name: &str) {
    use rayon::prelude::*;
    // Each f32 is read once and written once: 8 bytes per element.
    describe(name, "memcpy_64MiB", 8.0);
    let src = data(N);
    let mut dst = vec![0f32; N];
    group.throughput(Throughput::Bytes((N * 4) as u64));
    group.bench_function("memcpy_64MiB", |b| {
        b.iter(|| {
            dst.par_chunks_mut(1 << 16)
                .zip(black_box(&src).par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s));
            black_box(&mut dst);
        })
    });
}
