//! Element-wise format conversions over 16M values.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use lpmm_formats::{Fp8, Overflow, Rounding, SplitF32, bf16, float, simd};
use std::hint::black_box;

#[path = "common.rs"]
mod common;
use common::{N, data, describe, memcpy_reference};

fn conversions(c: &mut Criterion) {
    let x = data(N);
    let mut group = c.benchmark_group("formats");
    common::configure(&mut group);
    memcpy_reference(&mut group, "formats");
    for (id, bytes) in [
        ("bf16_nearest", 6.0),
        ("bf16_stochastic", 6.0),
        ("e4m3_nearest", 5.0),
        ("e4m3_nearest_slice", 5.0),
        ("split_f32", 8.0),
    ] {
        describe("formats", id, bytes);
    }
    group.throughput(Throughput::Elements(N as u64));
    let mut out16 = vec![bf16::ZERO; N];
    group.bench_function("bf16_nearest", |b| {
        b.iter(|| simd::f32_to_bf16_nearest(black_box(&x), &mut out16))
    });
    group.bench_function("bf16_stochastic", |b| {
        b.iter(|| {
            for (i, (o, &v)) in out16.iter_mut().zip(black_box(&x)).enumerate() {
                *o = float::bf16_stochastic(v, (i as u32).wrapping_mul(0x9E37_79B9));
            }
        })
    });
    let mut out8 = vec![0u8; N];
    group.bench_function("e4m3_nearest", |b| {
        b.iter(|| {
            for (o, &v) in out8.iter_mut().zip(black_box(&x)) {
                *o = Fp8::E4M3Fn.encode(v, Rounding::NearestEven, Overflow::Saturate);
            }
        })
    });
    group.bench_function("e4m3_nearest_slice", |b| {
        b.iter(|| {
            Fp8::E4M3Fn
                .encode_nearest_slice(black_box(&x), Overflow::Saturate, &mut out8)
                .expect("equal lengths")
        })
    });
    let mut split = vec![SplitF32::default(); N];
    group.bench_function("split_f32", |b| {
        b.iter(|| {
            for (o, &v) in split.iter_mut().zip(black_box(&x)) {
                *o = SplitF32::from_f32(v);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, conversions);
criterion_main!(benches);
