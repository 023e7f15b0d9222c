//! Shared bench inputs and the memory-bandwidth reference.

use criterion::{BenchmarkGroup, Throughput, measurement::WallTime};
use std::hint::black_box;

/// Elements per bench input: 16M f32 = 64 MiB, large enough that copies leave the L2 caches.
/// (This machine's shared L3 may still hold part of it; issue 5's benches go to 256M.)
pub const N: usize = 1 << 24;

/// Deterministic normal-ish data (sum of uniforms), no dependency on a RNG crate.
pub fn data(n: usize) -> Vec<f32> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            let mut s = 0.0f32;
            for _ in 0..4 {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                s += (state >> 40) as f32 / (1u64 << 24) as f32;
            }
            s - 2.0
        })
        .collect()
}

/// The reference every figure is read against: copying `N` f32 with all threads (rayon, as the
/// quantizers run), measured in the same run. Throughput counts the bytes copied (each read once
/// and written once).
pub fn memcpy_reference(group: &mut BenchmarkGroup<'_, WallTime>) {
    use rayon::prelude::*;
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
