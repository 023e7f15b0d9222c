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
    group.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
