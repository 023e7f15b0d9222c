//! A conformance suite for backends (feature `testing`): the same training on the CPU reference
//! and on another [`Backend`], compared bit for bit after registration and after every step, for
//! every optimizer and storage, clipping, non-finite gradients, reads, checkpoints moved between
//! backends. lpmm-wgpu and lpmm-cuda run it from their tests; a new backend should too.

use crate::Checkpoint;
use crate::Mode;
use crate::{Cpu, Parts, PartsMut, checkpoint::Canonical};
use rand_core::{Rng as _, SeedableRng};
use rand_xoshiro::SplitMix64;

use crate::backend::{Backend, BackendError};
use crate::{
    Hyper, NonFinitePolicy, OptimError, Optimizer, OptimizerOptions, ParamConfig, ParamId, Sgd,
    SlotKind, Storage, StoreRounding, presets,
};

// docs/REGISTRIES.md, generated from the registries and this module's lists.
mod registries;
pub use registries::{REGISTRIES_COMMAND, REGISTRIES_PATH, registries_doc};

/// Test data from SplitMix64 (`rand_xoshiro`): the same numbers everywhere.
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64::seed_from_u64(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Values over several orders of magnitude (down to 1e-6 relative), with exact zeros.
    pub fn spread(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = self.uniform();
                let e = (self.next_u64() % 7) as i32 - 5;
                if self.next_u64().is_multiple_of(61) {
                    0.0
                } else {
                    u * scale * 10f32.powi(e)
                }
            })
            .collect()
    }
}

/// Every slot of every parameter of `a` and `b` must hold the same bits; panics naming the
/// first difference (parameter, slot, region, element, both values).
pub fn assert_same<A: Backend, B: Backend>(
    a: &Optimizer<A>,
    b: &Optimizer<B>,
    ids: &[ParamId],
    what: &str,
) {
    for &id in ids {
        for slot in SlotKind::ALL {
            let (x, y) = (
                Parts::of(a).export_slot(id, slot, None).unwrap(),
                Parts::of(b).export_slot(id, slot, None).unwrap(),
            );
            let name = a.param(id).unwrap().name;
            assert_eq!(
                x.regions.len(),
                y.regions.len(),
                "{what}: {name} {} layouts differ",
                slot.name()
            );
            for (u, v) in x.regions.iter().zip(&y.regions) {
                assert_eq!(
                    u.spec,
                    v.spec,
                    "{what}: {name} {} regions differ",
                    slot.name()
                );
                assert_eq!(u.bytes.len(), v.bytes.len(), "{what}: lengths differ");
                let size = u.spec.dtype.size();
                if let Some(k) = u.bytes.iter().zip(&v.bytes).position(|(p, q)| p != q) {
                    let e = k / size;
                    let word = |b: &[u8]| {
                        b[e * size..(e + 1) * size]
                            .iter()
                            .rev()
                            .fold(0u32, |w, &x| w << 8 | u32::from(x))
                    };
                    panic!(
                        "{what}: parameter {name} slot {} region {:?} element {e}: {:#x} vs {:#x}",
                        slot.name(),
                        u.spec.suffix,
                        word(&u.bytes),
                        word(&v.bytes)
                    );
                }
            }
        }
    }
}

/// Micro-batches accumulated before each step of [`compare`] (when the gradient is not released).
const MICRO_BATCHES: usize = 2;
/// Steps of each case of [`presets_are_bit_exact`].
const PRESET_STEPS: usize = 4;
/// Steps of each case of the storage covers ([`every_optimizer_with_every_storage_is_bit_exact`],
/// [`tensor_wide_second_moments_are_bit_exact`]).
const COVER_STEPS: usize = 3;

const BF: Storage = Storage::Bf16(StoreRounding::Nearest);
const BF_SR: Storage = Storage::Bf16(StoreRounding::Stochastic);

/// The storage covers, from every format's file (its `Codec::COVER`, the formats in the
/// registry's order).
struct Covers {
    /// Parameter storages: the float formats first, then the codes.
    params: Vec<Storage>,
    /// Gradient storages, then `None` (released gradients).
    grads: Vec<Storage>,
    /// State 1 and state 2 pairs.
    states: Vec<(Storage, Storage)>,
    /// Tensor-wide second moments, by name.
    tensor_wide: Vec<(&'static str, Storage)>,
}

/// [`Covers`] from every format's cover.
fn covers() -> Covers {
    let all = || crate::format::COVERS.iter().map(|(_, cover)| cover);
    let (floats, codes): (Vec<Storage>, Vec<Storage>) = all()
        .flat_map(|c| c.params.iter().copied())
        .partition(|&s| !crate::format::Format::of(s).is_some_and(|f| f.quantized()));
    Covers {
        params: floats.into_iter().chain(codes).collect(),
        grads: all()
            .flat_map(|c| c.grads.iter().copied())
            .chain([Storage::None])
            .collect(),
        states: all().flat_map(|c| c.states.iter().copied()).collect(),
        tensor_wide: all().flat_map(|c| c.tensor_wide.iter().copied()).collect(),
    }
}

/// Shapes: one of 3 * 8192 + 1000 elements (several pieces, segments or io batches when a
/// backend's are small), one over a tile with a partial last block, one exactly a tile, small ones below the minimum quantized size, and a
/// crowd of tiny tensors.
pub fn shapes() -> Vec<Vec<usize>> {
    let mut s = vec![
        vec![3 * 8192 + 1000],
        vec![65, 129],
        vec![4096],
        vec![100],
        vec![7],
        vec![5, 6, 70],
        vec![3, 9000],
    ];
    s.extend((0..24).map(|k| vec![33 + k]));
    s
}

/// Shapes for a rule that steps matrices only (Muon): wide, tall (stepped transposed), square, a
/// single row and a single column, one over a tile with a partial last block.
pub fn matrix_shapes() -> Vec<Vec<usize>> {
    vec![
        vec![65, 129],
        vec![3, 9000],
        vec![200, 70],
        vec![64, 64],
        vec![1, 100],
        vec![130, 1],
        vec![5, 6],
    ]
}

/// The shapes [`compare`] registers for `hyper`: [`matrix_shapes`] for a rule that takes a
/// matrix phase, [`shapes`] for the others.
pub fn shapes_for(hyper: &Hyper) -> Vec<Vec<usize>> {
    if hyper.takes_matrix() {
        matrix_shapes()
    } else {
        shapes()
    }
}

/// The rules' own conformance cases ([`Hyper::conformance_cases`]).
pub fn hypers() -> Vec<(&'static str, Hyper)> {
    Hyper::conformance_cases()
}

/// State 3's storage beside state 1's in the storage covers: factorized where the rule demands
/// it (CAME's instability), else stored like state 1 (AdEMAMix's slow moment).
fn state3_for(hyper: &Hyper, state1: Storage) -> Storage {
    if hyper.needs_factorized(SlotKind::State3).is_some() {
        Storage::Factorized
    } else {
        state1
    }
}

/// A fresh directory named `<prefix><random>` in the system's temporary directory, removed with
/// everything in it when the returned guard drops: where tests write their checkpoints.
pub fn temp_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("a directory in the system's temporary directory")
}

/// Runs the same training on the CPU and on `gpu` (any backend) and compares every slot after registration
/// and after every step. A backend without the matrix phase (`Backend::matrices` unsupported:
/// lpmm-wgpu and lpmm-cuda) skips a rule that takes one, with a message.
pub fn compare<B: Backend>(
    gpu: &B,
    name: &str,
    config: ParamConfig,
    options: OptimizerOptions,
    steps: usize,
) {
    let mut cpu = Optimizer::new(options).unwrap();
    let mut dev = Optimizer::with_backend(gpu.clone(), options).unwrap();
    cpu.add_group(config).unwrap();
    dev.add_group(config).unwrap();
    let mut rng = Rng::new(0x5eed ^ name.len() as u64);
    let mut ids: Vec<(ParamId, usize)> = Vec::new();
    for (k, shape) in shapes_for(&config.hyper).iter().enumerate() {
        let n: usize = shape.iter().product();
        let init = rng.spread(n, 0.5);
        let a = cpu.add_param(&format!("p{k}"), shape, &init, 0).unwrap();
        let b = match dev.add_param(&format!("p{k}"), shape, &init, 0) {
            Err(OptimError::Backend(BackendError::Unsupported { backend, what }))
                if config.hyper.takes_matrix() =>
            {
                eprintln!("skipped on {backend} (it does not support {what}): {name}");
                return;
            }
            other => other.unwrap(),
        };
        assert_eq!(a, b);
        ids.push((a, n));
    }
    let only: Vec<ParamId> = ids.iter().map(|&(id, _)| id).collect();
    assert_same(&cpu, &dev, &only, &format!("{name}, after registration"));
    let released = config.grad == Storage::None;
    for step in 0..steps {
        if released {
            for &(id, n) in &ids {
                // Odd steps: optimizer accumulation (states only) before the released step.
                if step % 2 == 1 {
                    let g = rng.spread(n, 1.0);
                    let r1 = cpu.step(crate::Step::states_only(id, &g)).unwrap();
                    let r2 = dev.step(crate::Step::states_only(id, &g)).unwrap();
                    assert_eq!(r1, r2, "{name}: Step::states_only reports");
                }
                let g = rng.spread(n, 1.0);
                let r1 = cpu.step(crate::Step::param(id, &g)).unwrap();
                let r2 = dev.step(crate::Step::param(id, &g)).unwrap();
                assert_eq!(r1, r2, "{name}: step reports");
            }
        } else {
            for _micro in 0..MICRO_BATCHES {
                for &(id, n) in &ids {
                    let g = rng.spread(n, 1.0);
                    cpu.accumulate(id, &g).unwrap();
                    dev.accumulate(id, &g).unwrap();
                }
            }
            let r1 = cpu.step(crate::Accumulated).unwrap();
            let r2 = dev.step(crate::Accumulated).unwrap();
            assert_eq!(r1, r2, "{name}: step reports");
        }
        assert_same(&cpu, &dev, &only, &format!("{name}, step {}", step + 1));
    }
}

/// The presets every backend is compared on, by name: every rule's conformance presets, declared
/// in its file beside its presets (`presets!` in `rule/<name>.rs`), in the rules' registry order.
/// docs/REGISTRIES.md lists them (`cargo xtask codegen`).
pub fn preset_cases() -> Vec<(&'static str, ParamConfig)> {
    presets::conformance_cases()
}

/// [`preset_cases`], each for `PRESET_STEPS` steps of `MICRO_BATCHES` micro-batches
/// (docs/REGISTRIES.md gives the numbers).
pub fn presets_are_bit_exact<B: Backend>(gpu: &B) {
    for (name, config) in preset_cases() {
        compare(gpu, name, config, OptimizerOptions::default(), PRESET_STEPS);
    }
}

/// Every rule case ([`hypers`]) with every parameter storage of the formats' covers (each
/// format's file declares the storages the suite steps it with), cycling their gradient
/// storages (the released gradient included) and state pairs: a cycling cover, not the full
/// cross product. docs/REGISTRIES.md counts the configurations (`cargo xtask codegen`).
pub fn every_optimizer_with_every_storage_is_bit_exact<B: Backend>(gpu: &B) {
    let Covers {
        params,
        grads,
        states,
        ..
    } = covers();
    let mut k = 0;
    for (hname, hyper) in hypers() {
        for &param in &params {
            let grad = grads[k % grads.len()];
            let (state1, state2) = states[k % states.len()];
            k += 1;
            let config = ParamConfig::f32(hyper)
                .with_param(param)
                .with_grad(grad)
                .with_state1(state1)
                .with_state2(state2)
                .with_state3(state3_for(&hyper, state1))
                .with_min_quantized_size(4096);
            let name = format!(
                "{hname}: param {} grad {} states {}/{}",
                param.describe(),
                grad.describe(),
                state1.describe(),
                state2.describe()
            );
            compare(gpu, &name, config, OptimizerOptions::default(), COVER_STEPS);
        }
    }
}

/// Global-norm clipping with Inf and NaN gradients under both non-finite policies.
pub fn clipping_and_non_finite_gradients_are_bit_exact<B: Backend>(gpu: &B) {
    for policy in [NonFinitePolicy::SkipStep, NonFinitePolicy::SkipElements] {
        let options = OptimizerOptions::default()
            .with_seed(7)
            .with_max_grad_norm(Some(0.5))
            .with_non_finite(policy);
        let config = presets::adamw_8bit_bf16_sr(1e-3);
        let mut cpu = Optimizer::new(options).unwrap();
        let mut dev = Optimizer::with_backend(gpu.clone(), options).unwrap();
        cpu.add_group(config).unwrap();
        dev.add_group(config).unwrap();
        let mut rng = Rng::new(3);
        let n = 3 * 8192 + 5;
        let init = rng.spread(n, 0.5);
        let a = cpu.add_param("w", &[n], &init, 0).unwrap();
        dev.add_param("w", &[n], &init, 0).unwrap();
        for step in 0..4 {
            let mut g = rng.spread(n, 4.0);
            if step == 1 {
                g[10] = f32::INFINITY;
                g[9000] = f32::NAN;
            }
            cpu.accumulate(a, &g).unwrap();
            dev.accumulate(a, &g).unwrap();
            let r1 = cpu.step(crate::Accumulated).unwrap();
            let r2 = dev.step(crate::Accumulated).unwrap();
            assert_eq!(r1, r2, "{policy:?} step {step}");
            assert_same(&cpu, &dev, &[a], &format!("{policy:?} step {step}"));
        }
    }
}

/// Schedule-free AdamW's evaluation point: `set_mode(Mode::Eval, ..)` and back move the
/// parameters (f32 and bf16 with stochastic rounding) as the CPU does, bit for bit, and steps
/// resume from them.
pub fn evaluation_points_are_bit_exact<B: Backend>(gpu: &B) {
    for param in [Storage::F32, BF_SR] {
        let config = presets::schedule_free_adamw_8bit(2.5e-3)
            .warmup_steps(2)
            .with_param(param);
        let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
        let mut dev = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
        cpu.add_group(config).unwrap();
        dev.add_group(config).unwrap();
        let mut rng = Rng::new(5);
        let mut ids = Vec::new();
        for (k, shape) in [vec![9000], vec![33, 70]].iter().enumerate() {
            let n: usize = shape.iter().product();
            let init = rng.spread(n, 0.5);
            ids.push((cpu.add_param(&format!("p{k}"), shape, &init, 0).unwrap(), n));
            dev.add_param(&format!("p{k}"), shape, &init, 0).unwrap();
        }
        let only: Vec<ParamId> = ids.iter().map(|&(id, _)| id).collect();
        for round in 0..3 {
            for &(id, n) in &ids {
                let g = rng.spread(n, 1.0);
                cpu.accumulate(id, &g).unwrap();
                dev.accumulate(id, &g).unwrap();
            }
            assert_eq!(
                cpu.step(crate::Accumulated).unwrap(),
                dev.step(crate::Accumulated).unwrap()
            );
            cpu.set_mode(Mode::Eval, crate::Lent::None).unwrap();
            dev.set_mode(Mode::Eval, crate::Lent::None).unwrap();
            assert_same(&cpu, &dev, &only, &format!("{param:?} eval {round}"));
            cpu.set_mode(Mode::Train, crate::Lent::None).unwrap();
            dev.set_mode(Mode::Train, crate::Lent::None).unwrap();
            assert_same(&cpu, &dev, &only, &format!("{param:?} train {round}"));
        }
    }
}

/// `Optimizer::read` decodes as the CPU does.
pub fn reads_decode_as_the_cpu_does<B: Backend>(gpu: &B) {
    let config = presets::adamw_4bit_split(1e-3);
    let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
    let mut dev = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
    cpu.add_group(config).unwrap();
    dev.add_group(config).unwrap();
    let mut rng = Rng::new(11);
    let n = 20_000;
    let init = rng.spread(n, 1.0);
    let a = cpu.add_param("w", &[n], &init, 0).unwrap();
    dev.add_param("w", &[n], &init, 0).unwrap();
    let g = rng.spread(n, 1.0);
    cpu.step(crate::Step::param(a, &g)).unwrap();
    dev.step(crate::Step::param(a, &g)).unwrap();
    let (mut x, mut y) = (vec![0f32; n], vec![0f32; n]);
    cpu.read(a, SlotKind::Param, &mut x).unwrap();
    dev.read(a, SlotKind::Param, &mut y).unwrap();
    assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()));
    for state in [SlotKind::State1, SlotKind::State2, SlotKind::State3] {
        cpu.read(a, state, &mut x).unwrap();
        dev.read(a, state, &mut y).unwrap();
        assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
    assert_eq!(cpu.memory_report().numel(), dev.memory_report().numel());
}

/// Checkpoints saved on the CPU (with a pending micro-batch) load on `gpu`, and back, and both
/// resume bit-identically.
pub fn checkpoints_move_between_backends_and_resume_exactly<B: Backend>(gpu: &B) {
    let options = OptimizerOptions::default().with_seed(99);
    // Removed with its files when the check ends.
    let tmp = temp_dir("lpmm-conformance-");
    let temp = |name: &str| tmp.path().join(name);
    for (name, config) in [
        ("8bit", presets::adamw_8bit_bf16_sr(1e-3).build()),
        ("lpmm", presets::lpmm_sgdm(0.05, 0.9).build()),
        ("4bit", presets::adamw_4bit_split(1e-3).build()),
    ] {
        let mut rng = Rng::new(5);
        let mut cpu = Optimizer::new(options).unwrap();
        cpu.add_group(config).unwrap();
        let sizes = [20_000usize, 5000, 300];
        let ids: Vec<ParamId> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                cpu.add_param(&format!("w{k}"), &[n], &rng.spread(n, 0.5), 0)
                    .unwrap()
            })
            .collect();
        let grads = |rng: &mut Rng| sizes.map(|n| rng.spread(n, 1.0));
        let g = grads(&mut rng);
        for (&id, g) in ids.iter().zip(&g) {
            cpu.accumulate(id, g).unwrap();
        }
        cpu.step(crate::Accumulated).unwrap();
        // A pending micro-batch travels too.
        let g = grads(&mut rng);
        cpu.accumulate(ids[0], &g[0]).unwrap();
        let path = temp(&format!("{name}-cpu-{}.safetensors", gpu.name()));
        cpu.save(&path, Checkpoint::new()).unwrap();
        let mut dev = Canonical::read(&path)
            .and_then(|c| c.into_optimizer(gpu.clone()))
            .unwrap();
        assert_same(
            &cpu,
            &dev,
            &ids,
            &format!("{name}: cpu checkpoint on {}", gpu.name()),
        );
        for round in 0..2 {
            let g = grads(&mut rng);
            for (&id, g) in ids.iter().zip(&g) {
                cpu.accumulate(id, g).unwrap();
                dev.accumulate(id, g).unwrap();
            }
            assert_eq!(
                cpu.step(crate::Accumulated).unwrap(),
                dev.step(crate::Accumulated).unwrap()
            );
            assert_same(&cpu, &dev, &ids, &format!("{name}: resumed step {round}"));
        }
        // And back: saved on wgpu, loaded on the CPU.
        let path = temp(&format!("{name}-{}.safetensors", gpu.name()));
        dev.save(&path, Checkpoint::new()).unwrap();
        let mut back = Canonical::read(&path)
            .and_then(|c| c.into_optimizer(Cpu))
            .unwrap();
        assert_same(
            &dev,
            &back,
            &ids,
            &format!("{name}: {} checkpoint on cpu", gpu.name()),
        );
        let g = grads(&mut rng);
        for (&id, g) in ids.iter().zip(&g) {
            back.accumulate(id, g).unwrap();
            dev.accumulate(id, g).unwrap();
        }
        back.step(crate::Accumulated).unwrap();
        dev.step(crate::Accumulated).unwrap();
        assert_same(&back, &dev, &ids, &format!("{name}: after the round trip"));
    }
}

/// The gradient setups [`tensor_wide_second_moments_are_bit_exact`] steps each case with: a
/// name, the parameter and gradient storages and the options.
fn tensor_wide_gradients() -> [(&'static str, Storage, Storage, OptimizerOptions); 2] {
    let clipped = OptimizerOptions::default()
        .with_seed(3)
        .with_max_grad_norm(Some(0.5))
        .with_non_finite(NonFinitePolicy::SkipStep);
    [
        ("bf16 sr, clipped", BF_SR, BF_SR, clipped),
        (
            "f32, released",
            Storage::F32,
            Storage::None,
            OptimizerOptions::default(),
        ),
    ]
}

/// The tensor-wide second moments of the formats' covers (rank-1 and factorized: tensor-wide
/// statistics, the two-phase step) with every rule case whose state 2 may be factorized (AdamW
/// and Adam-L2, whose moment gradient folds the penalty in; Adafactor, with the rule's sums of
/// squares: parameter and update RMS; CAME, with a factorized state 3 fed by the rule), clipped
/// and accumulated gradients, released gradients and optimizer accumulation, on matrices, a 3-D
/// tensor and vectors (which fall back), on several pieces.
pub fn tensor_wide_second_moments_are_bit_exact<B: Backend>(gpu: &B) {
    for (name, state2) in covers().tensor_wide {
        // Every rule case whose state 2 may be factorized (Adam's, Adafactor's, CAME's).
        let factorable = hypers()
            .into_iter()
            .filter(|(_, h)| h.factorable(SlotKind::State2));
        for (hname, hyper) in factorable {
            for (gname, param, grad, options) in tensor_wide_gradients() {
                let config = ParamConfig::f32(hyper)
                    .with_param(param)
                    .with_grad(grad)
                    .with_state1(Storage::FOUR_BIT_SIGNED)
                    .with_state2(state2)
                    .with_state3(state3_for(&hyper, Storage::FOUR_BIT_SIGNED))
                    .with_min_quantized_size(0);
                let label = format!("{name} {hname} {gname}");
                compare(gpu, &label, config, options, COVER_STEPS);
            }
        }
    }
}

/// Adam with second moments that are subnormal or underflow: the states must be subnormal on the
/// CPU, and with `exact` the backend must agree bit for bit.
pub fn subnormal_values<B: Backend>(gpu: &B, exact: bool) {
    let config = ParamConfig::f32(Hyper::adamw(1e-3));
    let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
    let mut dev = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
    cpu.add_group(config).unwrap();
    dev.add_group(config).unwrap();
    let n = 10_000;
    let mut rng = Rng::new(4);
    let init = rng.spread(n, 1e-37);
    let a = cpu.add_param("w", &[n], &init, 0).unwrap();
    dev.add_param("w", &[n], &init, 0).unwrap();
    for _ in 0..3 {
        // Squares of these are subnormal or underflow.
        let g = rng.spread(n, 1e-19);
        cpu.step(crate::Step::param(a, &g)).unwrap();
        dev.step(crate::Step::param(a, &g)).unwrap();
    }
    let mut v = vec![0f32; n];
    cpu.read(a, SlotKind::State2, &mut v).unwrap();
    let subnormal = v.iter().filter(|x| x.is_subnormal()).count();
    assert!(
        subnormal > 1000,
        "the case must produce subnormal states ({subnormal})"
    );
    if exact {
        assert_same(&cpu, &dev, &[a], "subnormal states");
    } else {
        eprintln!("this device is not bit-exact on subnormals; see docs/BACKENDS.md");
    }
}

/// One overflow scenario: a configuration, initial values, and per step the micro-batches to
/// accumulate (empty: released gradients through `Step::param`).
struct Overflow {
    name: &'static str,
    config: ParamConfig,
    shape: Vec<usize>,
    init: Vec<f32>,
    steps: Vec<Vec<Vec<f32>>>,
}

/// `n` values of `base`, with `at` (index, value) put in.
fn with(n: usize, base: &mut Rng, scale: f32, at: &[(usize, f32)]) -> Vec<f32> {
    let mut v = base.spread(n, scale);
    for &(i, x) in at {
        v[i] = x;
    }
    v
}

/// Finite inputs whose results overflow on the way into a low-precision slot — bf16 momenta and
/// second moments beyond bf16's range, bf16 and Kahan parameters moved past their limits,
/// factorized statistics that overflow, accumulated sums beyond a bf16 accumulator and an 8-bit
/// one — under both non-finite policies: the same elements left unchanged, the same reports, the
/// same refusals of micro-batches, bit for bit.
pub fn overflow_is_bit_exact<B: Backend>(gpu: &B) {
    let mut rng = Rng::new(21);
    let n = 5000;
    let sgdm = |lr| Hyper::Sgd(Sgd::new(lr).momentum(0.9));
    let scenarios = vec![
        Overflow {
            name: "sgd momentum in bf16, released",
            config: ParamConfig::f32(sgdm(1e-30))
                .with_param(BF_SR)
                .with_grad(Storage::None)
                .with_state1(BF),
            shape: vec![n],
            init: rng.spread(n, 1.0),
            steps: vec![Vec::new(); 3],
        },
        Overflow {
            name: "adamw with bf16 states and a Kahan parameter",
            config: ParamConfig::f32(Hyper::adamw(1e-3))
                .with_param(Storage::Bf16Kahan)
                .with_grad(Storage::F32)
                .with_state1(BF)
                .with_state2(BF_SR),
            shape: vec![n],
            init: with(n, &mut rng, 1.0, &[(7, 1.6e38), (4999, -1.69e38)]),
            steps: (0..3)
                .map(|_| {
                    vec![with(
                        n,
                        &mut rng,
                        1.0,
                        &[(3, 5.9e20), (4000, -6e20), (17, 1e19)],
                    )]
                })
                .collect(),
        },
        Overflow {
            name: "sgd pushing bf16 and split-f32 parameters past bf16's range",
            config: ParamConfig::f32(Hyper::sgd(1.0, 0.0))
                .with_param(BF)
                .with_grad(BF),
            shape: vec![n],
            init: with(n, &mut rng, 1.0, &[(0, 3.3e38), (1, 3.3e38), (2, -3.3e38)]),
            steps: (0..2)
                .map(|_| {
                    vec![
                        with(n, &mut rng, 1.0, &[(0, -6e36), (1, -1e37), (2, 2e37)]),
                        // A bf16 accumulator: this sum overflows it and is stored as Inf.
                        with(n, &mut rng, 1.0, &[(9, 3.3e38), (10, 1e38)]),
                        with(n, &mut rng, 1.0, &[(9, 3.3e38), (10, 1e38)]),
                    ]
                })
                .collect(),
        },
        Overflow {
            name: "split f32",
            config: ParamConfig::f32(Hyper::sgd(1.0, 0.0))
                .with_param(Storage::SplitF32)
                .with_grad(Storage::F32),
            shape: vec![n],
            init: with(n, &mut rng, 1.0, &[(0, 3.39e38), (5, -3e38)]),
            steps: vec![vec![with(n, &mut rng, 1.0, &[(0, -1e36), (5, 1e37)])]],
        },
        Overflow {
            name: "bf16+8 (stochastic) past its limit",
            config: ParamConfig::f32(Hyper::sgd(1.0, 0.0))
                .with_param(Storage::Bf16Plus8(StoreRounding::Stochastic))
                .with_grad(Storage::F32),
            shape: vec![n],
            init: with(
                n,
                &mut rng,
                1.0,
                &[(0, 3.39e38), (5, -3e38), (6, 3.3961e38)],
            ),
            steps: vec![vec![with(
                n,
                &mut rng,
                1.0,
                &[(0, -1e36), (5, 1e37), (6, -1e33)],
            )]],
        },
        Overflow {
            name: "factorized statistics",
            config: ParamConfig::f32(Hyper::adamw(1e-3))
                .with_param(Storage::F32)
                .with_grad(Storage::F32)
                .with_state1(Storage::F32)
                .with_state2(Storage::Factorized)
                .with_min_quantized_size(0),
            shape: vec![50, 100],
            init: rng.spread(n, 1.0),
            steps: (0..2)
                .map(|_| vec![with(n, &mut rng, 1.0, &[(120, 3e21), (121, 3e21)])])
                .collect(),
        },
        Overflow {
            name: "lpmm sgdm: 8-bit accumulator sums",
            config: presets::lpmm_sgdm(1e-3, 0.9).build(),
            shape: vec![n],
            init: rng.spread(n, 1.0),
            steps: (0..2)
                .map(|_| {
                    vec![
                        with(n, &mut rng, 1.0, &[(64, 3e38)]),
                        with(n, &mut rng, 1.0, &[(64, 3e38), (65, 0.25)]),
                        with(n, &mut rng, 1.0, &[(64, -1e38)]),
                    ]
                })
                .collect(),
        },
    ];
    for policy in [NonFinitePolicy::SkipElements, NonFinitePolicy::SkipStep] {
        for sc in &scenarios {
            let options = OptimizerOptions::default()
                .with_seed(17)
                .with_max_grad_norm(None)
                .with_non_finite(policy);
            let what = format!("{} ({policy:?})", sc.name);
            let mut cpu = Optimizer::new(options).unwrap();
            let mut dev = Optimizer::with_backend(gpu.clone(), options).unwrap();
            cpu.add_group(sc.config).unwrap();
            dev.add_group(sc.config).unwrap();
            let a = cpu.add_param("w", &sc.shape, &sc.init, 0).unwrap();
            dev.add_param("w", &sc.shape, &sc.init, 0).unwrap();
            let mut flagged = false;
            let mut refused = false;
            let mut released = Rng::new(99);
            for (k, micro) in sc.steps.iter().enumerate() {
                let (r1, r2) = if micro.is_empty() {
                    let g = with(
                        n,
                        &mut released,
                        1.0,
                        &[(1, 3.3e38), (2, -3.39e38), (3, 1e38)],
                    );
                    (
                        cpu.step(crate::Step::param(a, &g)).unwrap(),
                        dev.step(crate::Step::param(a, &g)).unwrap(),
                    )
                } else {
                    for g in micro {
                        let (x, y) = (cpu.accumulate(a, g), dev.accumulate(a, g));
                        assert_eq!(x.is_ok(), y.is_ok(), "{what}: accumulate {x:?} vs {y:?}");
                        refused |= x.is_err();
                    }
                    (
                        cpu.step(crate::Accumulated).unwrap(),
                        dev.step(crate::Accumulated).unwrap(),
                    )
                };
                assert_eq!(r1, r2, "{what}: step {k} reports");
                flagged |= !r1.non_finite.is_empty();
                assert_same(&cpu, &dev, &[a], &format!("{what}, step {k}"));
            }
            assert!(
                flagged || refused,
                "{what}: the scenario must overflow somewhere"
            );
        }
    }
}

/// Factorized statistics that a step would move to rebuild a value that is not finite (equal
/// rows and columns at `f32::MAX`, then gradients in one row): AdamW's, Adafactor's and CAME's
/// state 2 and CAME's state 3 keep their statistics and the step reports the parameter, the same
/// bits and reports as the CPU.
pub fn factorized_overflow_is_bit_exact<B: Backend>(gpu: &B) {
    let adam = ParamConfig::f32(Hyper::adamw(1e-3))
        .with_state2(Storage::Factorized)
        .with_min_quantized_size(0);
    let adafactor = presets::adafactor_f32().with_min_quantized_size(0).build();
    let came = presets::came_f32(2e-4).with_min_quantized_size(0).build();
    for (name, config, slot) in [
        ("adamw", adam, SlotKind::State2),
        ("adafactor", adafactor, SlotKind::State2),
        ("came", came, SlotKind::State2),
        ("came", came, SlotKind::State3),
    ] {
        let name = format!("{name} {}", slot.name());
        let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
        let mut dev = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
        cpu.add_group(config).unwrap();
        dev.add_group(config).unwrap();
        let a = cpu.add_param("w", &[12, 10], &[0.2; 120], 0).unwrap();
        let b = dev.add_param("w", &[12, 10], &[0.2; 120], 0).unwrap();
        let mut rng = Rng::new(46);
        for _ in 0..3 {
            let g = rng.spread(120, 0.1);
            assert_eq!(
                cpu.step(crate::Step::param(a, &g)).unwrap(),
                dev.step(crate::Step::param(b, &g)).unwrap()
            );
        }
        let mut near = Parts::of(&cpu).export_slot(a, slot, None).unwrap();
        for r in &mut near.regions {
            let value: f32 = if r.spec.suffix == ".row" {
                1.0
            } else {
                f32::MAX
            };
            for c in r.bytes.chunks_mut(4) {
                c.copy_from_slice(&value.to_le_bytes());
            }
        }
        PartsMut::of(&mut cpu)
            .import_slot(a, slot, &near, None)
            .unwrap();
        PartsMut::of(&mut dev)
            .import_slot(b, slot, &near, None)
            .unwrap();
        let mut g = rng.spread(120, 1e-3);
        g[..10].fill(100.0);
        let (r1, r2) = (
            cpu.step(crate::Step::param(a, &g)).unwrap(),
            dev.step(crate::Step::param(b, &g)).unwrap(),
        );
        assert_eq!(r1, r2, "{name}: reports");
        assert_eq!(r1.non_finite, [a], "{name}: the step reports the parameter");
        assert_eq!(
            Parts::of(&cpu).export_slot(a, slot, None).unwrap(),
            near,
            "{name}: statistics kept"
        );
        assert_same(&cpu, &dev, &[a], &name);
    }
}

/// Generates the conformance suite's tests for a backend: one `#[test]` per check, each run on
/// every backend `$devices` yields (an expression giving an iterator of backends: none, with a
/// message, where the hardware is missing). A check added here runs on every backend that uses
/// the macro.
#[macro_export]
macro_rules! conformance_tests {
    ($devices:expr) => {
        $crate::conformance_tests!(@each $devices;
            presets_are_bit_exact,
            every_optimizer_with_every_storage_is_bit_exact,
            clipping_and_non_finite_gradients_are_bit_exact,
            reads_decode_as_the_cpu_does,
            checkpoints_move_between_backends_and_resume_exactly,
            tensor_wide_second_moments_are_bit_exact,
            evaluation_points_are_bit_exact,
            overflow_is_bit_exact,
            factorized_overflow_is_bit_exact,
        );
    };
    (@each $devices:expr; $($check:ident,)*) => {
        $(
            #[test]
            fn $check() {
                for device in ::std::iter::IntoIterator::into_iter($devices) {
                    $crate::testing::$check(&device);
                }
            }
        )*
    };
}
