//! The fused optimizer step of every preset at 1M, 16M, 64M and 256M parameters, each beside its
//! bandwidth ceiling (an in-place read-modify-write over buffers of the step's sizes) measured in
//! the same run; the Rust peers (candle-nn's AdamW, burn's AdamW with feature `burn`) at the same
//! sizes; per-tensor overhead (10,000 tensors of 1,000 against one of 10M) and 1 vs 2 threads.
//! Six presets also run at every lower SIMD level, on the generic path and skipping non-finite
//! elements instead of the whole step (`LEVELS`).
//!
//! A step case `step/<preset>/<size>` is `Step::param` with an f32 gradient (gradient release: one
//! fused pass that adds the gradient to the accumulator's content, steps, and clears the
//! accumulator). Bytes per parameter are counted from the formats: every slot is read and written
//! once, plus the 4 bytes of the f32 gradient read. A case `step/<preset>_acc/<size>` (presets with
//! a gradient accumulator) times `step(Accumulated)` alone with the gradient already accumulated in the
//! preset's own accumulator format (the accumulation before each step is not timed): every slot
//! read and written once, 12.06 bytes per parameter for 8-bit AdamW with bf16 parameters and
//! accumulator. Adafactor and CAME step a matrix (rows of 1024, so their second moments factor);
//! the others a vector.

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use lpmm_benches::{
    CaseInfo, Kind, M, RmwCeiling, candle_peer::CandleAdamW, data, describe, label, quick, sizes,
};
use lpmm_formats::simd::{self, Level};
use lpmm_optim::{
    NonFinitePolicy, Optimizer, OptimizerOptions, ParamConfig, ParamId, Storage, presets,
};
use std::hint::black_box;
use std::time::{Duration, Instant};

fn presets() -> Vec<(&'static str, ParamConfig)> {
    vec![
        ("adamw_f32", presets::adamw_f32(1e-3).build()),
        ("adamw_8bit_bf16", presets::adamw_8bit_bf16(1e-3).build()),
        (
            "adamw_8bit_bf16_sr",
            presets::adamw_8bit_bf16_sr(1e-3).build(),
        ),
        ("adamw_4bit_split", presets::adamw_4bit_split(1e-3).build()),
        (
            "adamw_4bit_bf16_sr_released",
            presets::adamw_4bit_bf16_sr_released(1e-3).build(),
        ),
        ("sgdm_f32", presets::sgdm_f32(1e-2, 0.9).build()),
        ("lpmm_sgdm", presets::lpmm_sgdm(1e-2, 0.9).build()),
        ("adamw_8bit", presets::adamw_8bit(1e-3).build()),
        ("adamw_4bit", presets::adamw_4bit(1e-3).build()),
        ("lion_8bit", presets::lion_8bit(1e-4).build()),
        ("adafactor_lpmm", presets::adafactor_lpmm().build()),
        ("came_lpmm", presets::came_lpmm(2e-4).build()),
        ("ademamix_8bit", presets::ademamix_8bit(1e-3).build()),
        (
            "schedule_free_adamw_8bit",
            presets::schedule_free_adamw_8bit(2.5e-3).build(),
        ),
    ]
}

/// The tensor a case steps: a matrix with rows of 1024 for the factored rules (Adafactor, CAME),
/// so their second moments factor as they do on a model's weights; a vector otherwise.
fn shape(name: &str, n: usize) -> Vec<usize> {
    if name.starts_with("adafactor") || name.starts_with("came") {
        vec![n / 1024, 1024]
    } else {
        vec![n]
    }
}

/// An optimizer with `options` holding one parameter of preset `name` (`config`), `init.len()`
/// elements in the case's shape.
fn one_param(
    options: OptimizerOptions,
    config: ParamConfig,
    name: &str,
    init: &[f32],
) -> (Optimizer, ParamId) {
    let mut opt = Optimizer::new(options).expect("options");
    let g = opt.add_group(config).expect("preset");
    let id = opt
        .add_param("w", &shape(name, init.len()), init, g)
        .expect("parameter");
    (opt, id)
}

/// Criterion settings for a case whose iteration takes up to seconds: flat sampling, ten
/// samples, no promise of a measurement time.
fn configure(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    group.sample_size(10);
    group.sampling_mode(SamplingMode::Flat);
    let (warm_up, measurement) =
        lpmm_benches::times((Duration::from_millis(500), Duration::from_secs(3)));
    group.warm_up_time(warm_up);
    group.measurement_time(measurement);
}

fn step(c: &mut Criterion) {
    for n in sizes() {
        let mut group = c.benchmark_group("step");
        configure(&mut group);
        group.throughput(Throughput::Elements(n as u64));
        let init = data(n, 0.1);
        let grad = data(n, 1e-3);
        for (name, config) in presets() {
            let (mut opt, id) = one_param(OptimizerOptions::default(), config, name, &init);
            let slots = opt.memory_report().slot_totals();
            // The f32 gradient is read once; every slot is read and written once.
            let read_only = 4 * n;
            let bytes = (2 * slots.iter().sum::<usize>() + read_only) as f64 / n as f64;
            let ceiling_id = format!("step/ceiling_{name}/{}", label(n));
            let case_id = format!("step/{name}/{}", label(n));
            describe(&CaseInfo {
                id: &case_id,
                params: n,
                bytes_per_param: bytes,
                kind: Kind::Lpmm,
                ceiling: Some(&ceiling_id),
                preset: Some(name),
            });
            group.bench_function(BenchmarkId::new(name, label(n)), |b| {
                b.iter(|| {
                    opt.step(lpmm_optim::Step::param(id, black_box(&grad)))
                        .expect("step")
                })
            });
            if LEVELS.contains(&name) {
                // The same step at each lower SIMD level, and on the generic path at the best.
                let best = simd::detected();
                for level in Level::ALL.into_iter().filter(|&l| l < best) {
                    simd::force(Some(level));
                    twin(
                        &mut group,
                        &mut opt,
                        id,
                        &grad,
                        name,
                        level.name(),
                        n,
                        bytes,
                    );
                }
                simd::force(None);
                opt.settings_mut().specialized_kernels = false;
                twin(&mut group, &mut opt, id, &grad, name, "generic", n, bytes);
                opt.settings_mut().specialized_kernels = true;
            }
            if config.grad != Storage::None {
                // `step(Accumulated)` alone, the gradient accumulated beforehand (not timed); every slot,
                // the accumulator included, read and written once.
                // The accumulator is allocated by the first accumulation: count it after one.
                opt.accumulate(id, &grad).expect("accumulate");
                opt.step(lpmm_optim::Accumulated).expect("step");
                let slots = opt.memory_report().slot_totals();
                let acc = format!("{name}_acc");
                let case_id = format!("step/{acc}/{}", label(n));
                let ceiling_id = format!("step/ceiling_{acc}/{}", label(n));
                describe(&CaseInfo {
                    id: &case_id,
                    params: n,
                    bytes_per_param: 2.0 * slots.iter().sum::<usize>() as f64 / n as f64,
                    kind: Kind::Lpmm,
                    ceiling: Some(&ceiling_id),
                    preset: Some(name),
                });
                group.bench_function(BenchmarkId::new(&acc, label(n)), |b| {
                    b.iter_custom(|iters| {
                        let mut timed = Duration::ZERO;
                        for _ in 0..iters {
                            opt.accumulate(id, black_box(&grad)).expect("accumulate");
                            let start = Instant::now();
                            opt.step(lpmm_optim::Accumulated).expect("step");
                            timed += start.elapsed();
                        }
                        timed
                    })
                });
                ceiling(&mut group, &acc, n, name, &slots, &[]);
            }
            drop(opt);
            if LEVELS.contains(&name) {
                // The same step under `NonFinitePolicy::SkipElements`: the gradient is not read
                // before it (torch's and bitsandbytes' steps check nothing).
                let options =
                    OptimizerOptions::default().with_non_finite(NonFinitePolicy::SkipElements);
                let (mut opt, id) = one_param(options, config, name, &init);
                twin(
                    &mut group,
                    &mut opt,
                    id,
                    &grad,
                    name,
                    "skip_elements",
                    n,
                    bytes,
                );
            }
            ceiling(&mut group, name, n, name, &slots, &[read_only]);
        }
        peers(&mut group, n, &init, &grad);
        group.finish();
    }
}

/// The presets also stepped at every lower SIMD level (`step/<preset>@<level>/<size>`, the level
/// forced as `LPMM_SIMD` would), on the generic element-wise path at the best level
/// (`step/<preset>@generic/<size>`: what the specialized kernels replace) and with
/// `NonFinitePolicy::SkipElements` (`step/<preset>@skip_elements/<size>`: no read of the gradient
/// before the step), each read against the same peers.
const LEVELS: [&str; 6] = [
    "adamw_f32",
    "adamw_8bit",
    "adamw_8bit_bf16",
    "adamw_8bit_bf16_sr",
    "adamw_4bit",
    "lpmm_sgdm",
];

/// `step/<preset>@<variant>/<size>`: `Step::param` as the main case times it, under a forced SIMD
/// level or the generic path.
#[allow(clippy::too_many_arguments)]
fn twin(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    opt: &mut Optimizer,
    id: ParamId,
    grad: &[f32],
    preset: &str,
    variant: &str,
    n: usize,
    bytes: f64,
) {
    let case = format!("{preset}@{variant}");
    describe(&CaseInfo {
        id: &format!("step/{case}/{}", label(n)),
        params: n,
        bytes_per_param: bytes,
        kind: Kind::Lpmm,
        ceiling: Some(&format!("step/ceiling_{preset}/{}", label(n))),
        preset: Some(preset),
    });
    group.bench_function(BenchmarkId::new(case, label(n)), |b| {
        b.iter(|| {
            opt.step(lpmm_optim::Step::param(id, black_box(grad)))
                .expect("step")
        })
    });
}

/// The bandwidth ceiling `step/ceiling_<case>/<size>` of a case of `preset`: one in-place pass
/// over buffers of the `rmw` slot sizes and a read of the `read` ones.
fn ceiling(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    case: &str,
    n: usize,
    preset: &str,
    rmw: &[usize],
    read: &[usize],
) {
    let mut ceiling = RmwCeiling::new(rmw, read);
    describe(&CaseInfo {
        id: &format!("step/ceiling_{case}/{}", label(n)),
        params: n,
        bytes_per_param: ceiling.bytes() as f64 / n as f64,
        kind: Kind::Ceiling,
        ceiling: None,
        preset: Some(preset),
    });
    group.bench_function(BenchmarkId::new(format!("ceiling_{case}"), label(n)), |b| {
        b.iter(|| ceiling.run())
    });
}

/// candle-nn's and burn's AdamW (f32) at the same size: nominally 28 bytes per parameter
/// (parameter, gradient and two states read; parameter and states written).
fn peers(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    n: usize,
    init: &[f32],
    grad: &[f32],
) {
    describe_peer("candle_adamw_f32", n);
    let mut candle = CandleAdamW::new(init, grad, 1e-3).expect("candle AdamW");
    group.bench_function(BenchmarkId::new("candle_adamw_f32", label(n)), |b| {
        b.iter(|| candle.step().expect("candle step"))
    });
    drop(candle);
    #[cfg(feature = "burn")]
    {
        describe_peer("burn_adamw_f32", n);
        let mut burn = lpmm_benches::burn_peer::BurnAdamW::new(init, grad, 1e-3);
        group.bench_function(BenchmarkId::new("burn_adamw_f32", label(n)), |b| {
            b.iter(|| burn.step())
        });
    }
}

/// The sidecar of an f32 AdamW peer at `n` parameters.
fn describe_peer(name: &str, n: usize) {
    describe(&CaseInfo {
        id: &format!("step/{name}/{}", label(n)),
        params: n,
        bytes_per_param: 28.0,
        kind: Kind::Peer,
        ceiling: None,
        preset: Some("adamw_f32"),
    });
}

/// Per-tensor overhead and thread scaling of the 8-bit AdamW step.
fn scaling(c: &mut Criterion) {
    let mut group = c.benchmark_group("scaling");
    configure(&mut group);
    let n = if quick() { 4 * M } else { 64 * M };
    let init = data(n, 0.1);
    let grad = data(n, 1e-3);
    group.throughput(Throughput::Elements(n as u64));
    for threads in [1usize, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        let mut opt = Optimizer::new(OptimizerOptions::default()).expect("options");
        let g = opt
            .add_group(presets::adamw_8bit_bf16(1e-3))
            .expect("preset");
        let id = opt.add_param("w", &[n], &init, g).expect("parameter");
        let bytes = (2.0 * opt.memory_report().total() as f64 + 4.0 * n as f64) / n as f64;
        let case = format!("scaling/adamw_8bit_bf16_{}_threads/{threads}", label(n));
        describe(&CaseInfo {
            id: &case,
            params: n,
            bytes_per_param: bytes,
            kind: Kind::Lpmm,
            ceiling: Some(&format!("step/ceiling_adamw_8bit_bf16/{}", label(n))),
            preset: Some("adamw_8bit_bf16"),
        });
        group.bench_function(
            BenchmarkId::new(format!("adamw_8bit_bf16_{}_threads", label(n)), threads),
            |b| {
                pool.install(|| {
                    b.iter(|| {
                        opt.step(lpmm_optim::Step::param(id, black_box(&grad)))
                            .expect("step")
                    })
                })
            },
        );
    }
    // 10,000 tensors of 1,000 parameters against one tensor of 10M: each iteration accumulates
    // every gradient, then steps (bytes: the step's, plus the accumulation's f32 read and bf16
    // read-modify-write).
    let small_init = data(1000, 0.1);
    let small_grad = data(1000, 1e-3);
    let big_grad = data(10_000_000, 1e-3);
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
        .add_param("w", &[10_000_000], &data(10_000_000, 0.1), g1)
        .expect("parameter");
    group.throughput(Throughput::Elements(10_000_000));
    for name in ["10000x1000", "1x10M"] {
        let opt = if name == "1x10M" { &one } else { &many };
        let bytes = (2.0 * opt.memory_report().total() as f64) / 1e7 + 4.0 + 4.0;
        describe(&CaseInfo {
            id: &format!("scaling/adamw_8bit_bf16_tensors/{name}"),
            params: 10_000_000,
            bytes_per_param: bytes,
            kind: Kind::Lpmm,
            ceiling: None,
            preset: Some("adamw_8bit_bf16"),
        });
    }
    group.bench_function(
        BenchmarkId::new("adamw_8bit_bf16_tensors", "10000x1000"),
        |b| {
            b.iter(|| {
                for &id in &ids {
                    many.accumulate(id, black_box(&small_grad))
                        .expect("accumulate");
                }
                many.step(lpmm_optim::Accumulated).expect("step")
            })
        },
    );
    group.bench_function(BenchmarkId::new("adamw_8bit_bf16_tensors", "1x10M"), |b| {
        b.iter(|| {
            one.accumulate(big, black_box(&big_grad))
                .expect("accumulate");
            one.step(lpmm_optim::Accumulated).expect("step")
        })
    });
    group.finish();
}

criterion_group!(benches, step, scaling);
criterion_main!(benches);
