//! The fused optimizer step: 8-bit AdamW with bf16 parameters and gradient accumulator at 16M
//! parameters, on 1 and 2 threads, beside a memcpy measured in the same run.
//!
//! Each iteration is `step_param` (gradient release) with an f32 gradient: it reads the gradient,
//! the (empty) bf16 accumulator, the bf16 parameter and both 8-bit states, and writes parameter,
//! states and the cleared accumulator.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use lpmm_optim::{Optimizer, OptimizerOptions, presets};
use std::hint::black_box;

#[path = "common.rs"]
mod common;
use common::{N, data, memcpy_reference};

fn step(c: &mut Criterion) {
    let init: Vec<f32> = data(N).iter().map(|v| v * 0.1).collect();
    let grad: Vec<f32> = data(N).iter().map(|v| v * 1e-3).collect();
    let mut group = c.benchmark_group("optim");
    group.sample_size(10);
    memcpy_reference(&mut group);
    group.throughput(Throughput::Elements(N as u64));
    for threads in [1usize, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        let mut opt = Optimizer::new(OptimizerOptions::default()).expect("options");
        let g = opt
            .add_group(presets::adamw_8bit_bf16(1e-3))
            .expect("preset");
        let id = opt.add_param("w", &[N], &init, g).expect("parameter");
        group.bench_function(format!("adamw8bit_bf16_16M_threads{threads}"), |b| {
            pool.install(|| b.iter(|| opt.step_param(id, black_box(&grad)).expect("step")))
        });
    }
    // Per-tensor overhead: 10,000 tensors of 1,000 parameters against one tensor of 10M, both
    // 8-bit AdamW with bf16 parameters, all gradients accumulated then one `step`.
    let small_init = vec![0.01f32; 1000];
    let small_grad = vec![1e-3f32; 1000];
    let mut many = Optimizer::new(OptimizerOptions::default()).expect("options");
    let g = many
        .add_group(presets::adamw_8bit_bf16(1e-3))
        .expect("preset");
    let ids: Vec<_> = (0..10_000)
        .map(|i| {
            many.add_param(&format!("t{i}"), &[1000], &small_init, g)
                .expect("parameter")
        })
        .collect();
    let mut one = Optimizer::new(OptimizerOptions::default()).expect("options");
    let g1 = one
        .add_group(presets::adamw_8bit_bf16(1e-3))
        .expect("preset");
    let big = one
        .add_param("w", &[10_000_000], &vec![0.01f32; 10_000_000], g1)
        .expect("parameter");
    let big_grad = vec![1e-3f32; 10_000_000];
    group.throughput(Throughput::Elements(10_000_000));
    group.bench_function("adamw8bit_bf16_10000x1000_accumulate_step", |b| {
        b.iter(|| {
            for &id in &ids {
                many.accumulate(id, black_box(&small_grad))
                    .expect("accumulate");
            }
            many.step().expect("step")
        })
    });
    group.bench_function("adamw8bit_bf16_1x10M_accumulate_step", |b| {
        b.iter(|| {
            one.accumulate(big, black_box(&big_grad))
                .expect("accumulate");
            one.step().expect("step")
        })
    });
    group.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
