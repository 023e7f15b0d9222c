//! Many tensors per dispatch, subnormal values, large tensors cut at the storage-binding limit,
//! the software arithmetic that stands in for an inexact driver's.

mod common;

use common::{backend, small};
use lpmm_optim::testing::{self, Rng, assert_same};
use lpmm_optim::{Optimizer, OptimizerOptions, ParamId, presets};
use lpmm_wgpu::WgpuOptions;

#[test]
fn many_small_tensors_share_one_dispatch() {
    let Some(gpu) = backend(WgpuOptions::default()) else {
        return;
    };
    let mut opt = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
    opt.add_group(presets::adamw_8bit_bf16(1e-3)).unwrap();
    let mut rng = Rng::new(8);
    let ids: Vec<ParamId> = (0..1000)
        .map(|k| {
            opt.add_param(&format!("b{k}"), &[64], &rng.spread(64, 0.1), 0)
                .unwrap()
        })
        .collect();
    for &id in &ids {
        opt.accumulate(id, &rng.spread(64, 1.0)).unwrap();
    }
    let before = gpu.dispatches();
    assert_eq!(opt.step(lpmm_optim::Accumulated).unwrap().updated, 1000);
    assert_eq!(gpu.segments(), 1);
    // The finiteness check (SkipStep) decodes every accumulator in one dispatch, the step in one.
    assert_eq!(
        gpu.dispatches() - before,
        2,
        "one segment: one decode and one step dispatch"
    );
}

#[test]
fn subnormal_values_are_bit_exact_where_the_probe_says_so() {
    let Some(gpu) = backend(small()) else { return };
    let behaviour = gpu.float_behaviour();
    eprintln!("{behaviour:?}");
    testing::subnormal_values(&gpu, behaviour.bit_exact());
}

#[test]
fn a_tensor_larger_than_a_segment_is_cut_into_pieces() {
    // 1.5 segments of parameter memory in one tensor, with the real piece size.
    let options = WgpuOptions::default().with_segment_bytes(8 << 20);
    let Some(gpu) = backend(options) else { return };
    let config = presets::adamw_8bit_bf16(1e-3);
    let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
    let mut dev = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
    cpu.add_group(config).unwrap();
    dev.add_group(config).unwrap();
    let n = 3 << 20;
    let mut rng = Rng::new(6);
    let init = rng.spread(n, 0.5);
    let a = cpu.add_param("big", &[n], &init, 0).unwrap();
    dev.add_param("big", &[n], &init, 0).unwrap();
    for _ in 0..2 {
        let g = rng.spread(n, 1.0);
        cpu.accumulate(a, &g).unwrap();
        dev.accumulate(a, &g).unwrap();
        cpu.step(lpmm_optim::Accumulated).unwrap();
        dev.step(lpmm_optim::Accumulated).unwrap();
    }
    assert!(gpu.segments() >= 2);
    assert_same(&cpu, &dev, &[a], "a tensor over several segments");
}

#[test]
fn backends_on_one_device_keep_their_own_memory_and_step_the_same_bits() {
    let Some(first) = backend(small()) else {
        return;
    };
    let second = first.on_same_device(small()).unwrap();
    let config = presets::lpmm_sgdm(1e-2, 0.9);
    let mut a = Optimizer::with_backend(first.clone(), OptimizerOptions::default()).unwrap();
    a.add_group(config).unwrap();
    let mut rng = Rng::new(12);
    let init = rng.spread(20_000, 0.5);
    let w = a.add_param("w", &[20_000], &init, 0).unwrap();
    let segments = first.segments();
    assert!(segments >= 1);
    // The second backend starts empty: no segment, no buffer of the first one's.
    assert_eq!(second.segments(), 0);
    assert_eq!(second.dispatches(), 0);
    let mut b = Optimizer::with_backend(second.clone(), OptimizerOptions::default()).unwrap();
    b.add_group(config).unwrap();
    assert_eq!(b.add_param("w", &[20_000], &init, 0).unwrap(), w);
    let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
    cpu.add_group(config).unwrap();
    cpu.add_param("w", &[20_000], &init, 0).unwrap();
    for _ in 0..3 {
        let g = rng.spread(20_000, 1.0);
        for opt in [&mut a, &mut b] {
            opt.accumulate(w, &g).unwrap();
            opt.step(lpmm_optim::Accumulated).unwrap();
        }
        cpu.accumulate(w, &g).unwrap();
        cpu.step(lpmm_optim::Accumulated).unwrap();
    }
    // Each steps its own tensors: the first's memory grew by no segment of the second's.
    assert_eq!(first.segments(), segments);
    assert!(second.segments() >= 1);
    assert_same(&cpu, &a, &[w], "the first backend on the device");
    assert_same(&cpu, &b, &[w], "the second backend on the device");
    assert_eq!(first.float_behaviour(), second.float_behaviour());
}

/// The kernels with the shader's software fma, division and square root (what they use where the
/// probe finds the driver's inexact, as NVIDIA's Vulkan driver is: docs/BACKENDS.md), forced on
/// this driver: every preset that divides or takes square roots steps the CPU's bits.
#[test]
fn software_arithmetic_steps_the_cpus_bits() {
    let Some(gpu) = common::own_backend(small().with_arithmetic(lpmm_wgpu::Arithmetic::Software))
    else {
        return;
    };
    let dividing = [
        "adamw 8-bit bf16",
        "lpmm sgdm",
        "adafactor lpmm",
        "came f32",
        "ademamix 8-bit",
        "schedule-free 8-bit",
    ];
    let cases: Vec<_> = testing::preset_cases()
        .into_iter()
        .filter(|(name, _)| dividing.contains(name))
        .collect();
    assert_eq!(cases.len(), dividing.len(), "every named preset is a case");
    for (name, config) in cases {
        testing::compare(&gpu, name, config, OptimizerOptions::default(), 2);
    }
}
