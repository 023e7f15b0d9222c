//! The wgpu backend against the CPU reference, bit for bit: every optimizer with every storage
//! of every slot, over several steps, with parameters that span pieces and segments, thousands
//! of elements in tensors of a few dozen, micro-batches, gradient release, clipping and
//! non-finite gradients. On lavapipe (IEEE f32 division and square root) every bit must agree.

mod common;

use common::{Rng, assert_same, backend, small};
use lpmm_optim::{
    Hyper, NonFinitePolicy, Optimizer, OptimizerOptions, ParamConfig, ParamId, Storage,
    StoreRounding, presets,
};
use lpmm_wgpu::Wgpu;

const BF: Storage = Storage::Bf16(StoreRounding::Nearest);
const BF_SR: Storage = Storage::Bf16(StoreRounding::Stochastic);
const DYN8_SR: Storage = Storage::Quantized {
    map: lpmm_optim::MapKind::DynamicUnsigned8,
    block: lpmm_quant::BlockSize::B256,
    rounding: StoreRounding::Stochastic,
};

/// Shapes: one that spans four pieces (three segments at `small()`), one over a tile with a
/// partial last block, one exactly a tile, small ones below the minimum quantized size, and a
/// crowd of tiny tensors.
fn shapes() -> Vec<Vec<usize>> {
    let mut s = vec![
        vec![3 * 8192 + 1000],
        vec![65, 129],
        vec![4096],
        vec![100],
        vec![7],
    ];
    s.extend((0..24).map(|k| vec![33 + k]));
    s
}

fn hypers() -> Vec<(&'static str, Hyper)> {
    vec![
        ("sgd", Hyper::sgd(0.05, 0.0)),
        (
            "sgd-nesterov-wd",
            Hyper::Sgd {
                lr: 0.05,
                momentum: 0.9,
                dampening: 0.0,
                nesterov: true,
                weight_decay: 1e-2,
            },
        ),
        (
            "sgd-dampening",
            Hyper::Sgd {
                lr: 0.05,
                momentum: 0.9,
                dampening: 0.3,
                nesterov: false,
                weight_decay: 0.0,
            },
        ),
        (
            "adam-l2",
            Hyper::Adam {
                lr: 1e-3,
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 1e-2,
                decoupled: false,
            },
        ),
        ("adamw", Hyper::adamw(1e-3)),
        (
            "adamw-beta1-0.3",
            Hyper::Adam {
                lr: 1e-3,
                betas: (0.3, 0.99),
                eps: 1e-6,
                weight_decay: 0.1,
                decoupled: true,
            },
        ),
        (
            "lion",
            Hyper::Lion {
                lr: 1e-4,
                betas: (0.9, 0.99),
                weight_decay: 0.1,
            },
        ),
    ]
}

/// Runs the same training on the CPU and on `gpu` and compares every slot after registration
/// and after every step.
fn compare(gpu: &Wgpu, name: &str, config: ParamConfig, options: OptimizerOptions, steps: usize) {
    let mut cpu = Optimizer::new(options).unwrap();
    let mut dev = Optimizer::with_backend(gpu.clone(), options).unwrap();
    cpu.add_group(config).unwrap();
    dev.add_group(config).unwrap();
    let mut rng = Rng(0x5eed ^ name.len() as u64);
    let mut ids: Vec<(ParamId, usize)> = Vec::new();
    for (k, shape) in shapes().iter().enumerate() {
        let n: usize = shape.iter().product();
        let init = rng.spread(n, 0.5);
        let a = cpu.add_param(&format!("p{k}"), shape, &init, 0).unwrap();
        let b = dev.add_param(&format!("p{k}"), shape, &init, 0).unwrap();
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
                    let r1 = cpu.accumulate_states(id, &g).unwrap();
                    let r2 = dev.accumulate_states(id, &g).unwrap();
                    assert_eq!(r1, r2, "{name}: accumulate_states reports");
                }
                let g = rng.spread(n, 1.0);
                let r1 = cpu.step_param(id, &g).unwrap();
                let r2 = dev.step_param(id, &g).unwrap();
                assert_eq!(r1, r2, "{name}: step reports");
            }
        } else {
            for _micro in 0..2 {
                for &(id, n) in &ids {
                    let g = rng.spread(n, 1.0);
                    cpu.accumulate(id, &g).unwrap();
                    dev.accumulate(id, &g).unwrap();
                }
            }
            let r1 = cpu.step().unwrap();
            let r2 = dev.step().unwrap();
            assert_eq!(r1, r2, "{name}: step reports");
        }
        assert_same(&cpu, &dev, &only, &format!("{name}, step {}", step + 1));
    }
}

#[test]
fn presets_are_bit_exact() {
    let Some(gpu) = backend(small()) else { return };
    let cases = [
        ("sgdm f32", presets::sgdm_f32(0.05, 0.9)),
        ("lpmm sgdm", presets::lpmm_sgdm(0.05, 0.9)),
        ("adamw f32", presets::adamw_f32(1e-3)),
        ("adamw 8-bit bf16", presets::adamw_8bit_bf16(1e-3)),
        ("adamw 8-bit bf16 sr", presets::adamw_8bit_bf16_sr(1e-3)),
        ("adamw 4-bit split", presets::adamw_4bit_split(1e-3)),
        (
            "bf16 nearest lion",
            presets::bf16_nearest(Hyper::lion(1e-4)),
        ),
        (
            "adamw 4-bit released",
            presets::adamw_4bit_bf16_sr_released(1e-3),
        ),
    ];
    for (name, config) in cases {
        compare(&gpu, name, config, OptimizerOptions::default(), 4);
    }
    assert!(
        gpu.segments() > 1,
        "the parameters must span several segments"
    );
}

#[test]
fn every_optimizer_with_every_storage_is_bit_exact() {
    let Some(gpu) = backend(small()) else { return };
    let params = [
        Storage::F32,
        BF,
        BF_SR,
        Storage::Bf16Kahan,
        Storage::SplitF32,
        Storage::LINEAR8_GROUP64_SR,
    ];
    let grads = [
        Storage::F32,
        BF,
        BF_SR,
        Storage::LINEAR8_GROUP64_SR,
        Storage::None,
    ];
    let states = [
        (Storage::F32, Storage::F32),
        (BF, BF),
        (BF_SR, BF_SR),
        (Storage::DYNAMIC8_SIGNED, Storage::DYNAMIC8_UNSIGNED),
        (Storage::FOUR_BIT_SIGNED, Storage::FOUR_BIT_UNSIGNED),
        (Storage::LINEAR8_GROUP64_SR, DYN8_SR),
    ];
    let mut k = 0;
    for (hname, hyper) in hypers() {
        for &param in &params {
            let grad = grads[k % grads.len()];
            let (state1, state2) = states[k % states.len()];
            k += 1;
            let config = ParamConfig {
                hyper,
                param,
                grad,
                state1,
                state2,
                min_quantized_size: 4096,
            };
            let name = format!(
                "{hname}: param {} grad {} states {}/{}",
                param.describe(),
                grad.describe(),
                state1.describe(),
                state2.describe()
            );
            compare(&gpu, &name, config, OptimizerOptions::default(), 3);
        }
    }
}

#[test]
fn clipping_and_non_finite_gradients_are_bit_exact() {
    let Some(gpu) = backend(small()) else { return };
    for policy in [NonFinitePolicy::SkipStep, NonFinitePolicy::SkipElements] {
        let options = OptimizerOptions {
            seed: 7,
            max_grad_norm: Some(0.5),
            non_finite: policy,
        };
        let config = presets::adamw_8bit_bf16_sr(1e-3);
        let mut cpu = Optimizer::new(options).unwrap();
        let mut dev = Optimizer::with_backend(gpu.clone(), options).unwrap();
        cpu.add_group(config).unwrap();
        dev.add_group(config).unwrap();
        let mut rng = Rng(3);
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
            let r1 = cpu.step().unwrap();
            let r2 = dev.step().unwrap();
            assert_eq!(r1, r2, "{policy:?} step {step}");
            assert_same(&cpu, &dev, &[a], &format!("{policy:?} step {step}"));
        }
    }
}

#[test]
fn reads_decode_as_the_cpu_does() {
    let Some(gpu) = backend(small()) else { return };
    let config = presets::adamw_4bit_split(1e-3);
    let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
    let mut dev = Optimizer::with_backend(gpu, OptimizerOptions::default()).unwrap();
    cpu.add_group(config).unwrap();
    dev.add_group(config).unwrap();
    let mut rng = Rng(11);
    let n = 20_000;
    let init = rng.spread(n, 1.0);
    let a = cpu.add_param("w", &[n], &init, 0).unwrap();
    dev.add_param("w", &[n], &init, 0).unwrap();
    let g = rng.spread(n, 1.0);
    cpu.step_param(a, &g).unwrap();
    dev.step_param(a, &g).unwrap();
    let (mut x, mut y) = (vec![0f32; n], vec![0f32; n]);
    cpu.read_param(a, &mut x).unwrap();
    dev.read_param(a, &mut y).unwrap();
    assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()));
    for state in [1, 2] {
        cpu.read_state(a, state, &mut x).unwrap();
        dev.read_state(a, state, &mut y).unwrap();
        assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
    assert_eq!(cpu.memory_report().numel(), dev.memory_report().numel());
}
