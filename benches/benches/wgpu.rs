//! The fused 8-bit AdamW step (bf16 parameters) on the wgpu backend beside the same step on the
//! CPU backend, in the same run: `Step::param` with an f32 gradient, which on wgpu includes
//! uploading the gradient and reading back the non-finite flags. On lavapipe the "device" is this
//! machine's CPU, so the ratio says what the shaders cost there, not what a GPU does.
//!
//! Without an adapter the bench prints why and measures nothing (with `LPMM_REQUIRE_WGPU=1` it
//! fails instead). Sizes: 1M and 4M parameters (1M in a smoke run): lavapipe runs this step at
//! about 250 ns/param, so a 16M case alone would take criterion's ten samples many minutes.

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use lpmm_benches::{CaseInfo, Kind, M, data, describe, label};
use lpmm_optim::{Cpu, Optimizer, OptimizerOptions, backend::Backend, presets};
use lpmm_wgpu::Wgpu;
use std::hint::black_box;
use std::time::Duration;

fn case<B: Backend>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    backend: B,
    name: &str,
    n: usize,
) {
    let init = data(n, 0.1);
    let grad = data(n, 1e-3);
    let mut opt = Optimizer::with_backend(backend, OptimizerOptions::default()).expect("options");
    let g = opt
        .add_group(presets::adamw_8bit_bf16(1e-3))
        .expect("preset");
    let id = opt.add_param("w", &[n], &init, g).expect("parameter");
    let slots = opt.memory_report().slot_totals();
    let bytes = (2 * slots.iter().sum::<usize>() + 4 * n) as f64 / n as f64;
    let case_id = format!("wgpu_step/{name}/{}", label(n));
    describe(&CaseInfo {
        id: &case_id,
        params: n,
        bytes_per_param: bytes,
        kind: Kind::Lpmm,
        ceiling: None,
        preset: Some("adamw_8bit_bf16"),
    });
    // One step before timing: lpmm-wgpu compiles each kernel on its first dispatch (seconds on
    // lavapipe), and `--quick` runs would otherwise time that compilation.
    opt.step(lpmm_optim::Step::param(id, &grad)).expect("step");
    group.bench_function(BenchmarkId::new(name, label(n)), |b| {
        b.iter(|| {
            opt.step(lpmm_optim::Step::param(id, black_box(&grad)))
                .expect("step")
        })
    });
}

fn step(c: &mut Criterion) {
    let gpu = match Wgpu::new(Default::default()) {
        Ok(gpu) => gpu,
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_WGPU=1 but {e}");
            }
            eprintln!("wgpu bench skipped: {e}");
            return;
        }
    };
    eprintln!(
        "wgpu adapter: {} ({:?}), {:?}",
        gpu.adapter_info().name,
        gpu.adapter_info().backend,
        gpu.float_behaviour()
    );
    let sizes = if lpmm_benches::quick() {
        vec![M]
    } else {
        vec![M, 4 * M]
    };
    for n in sizes {
        let mut group = c.benchmark_group("wgpu_step");
        group.sample_size(10);
        group.sampling_mode(SamplingMode::Flat);
        let (warm_up, measurement) =
            lpmm_benches::times((Duration::from_millis(500), Duration::from_secs(3)));
        group.warm_up_time(warm_up);
        group.measurement_time(measurement);
        group.throughput(Throughput::Elements(n as u64));
        case(&mut group, gpu.clone(), "wgpu_adamw_8bit_bf16", n);
        case(&mut group, Cpu, "cpu_adamw_8bit_bf16", n);
        group.finish();
    }
}

criterion_group!(benches, step);
criterion_main!(benches);
