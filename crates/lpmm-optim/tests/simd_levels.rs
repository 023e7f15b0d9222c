//! The step gives the same bits whichever kernels run (portable, AVX2 + FMA, AVX-512): every
//! preset and rule, with stochastic rounding, a non-finite gradient and an overflowing one (the
//! restore path), over lengths that leave vector tails. On a CPU without AVX-512 the levels it
//! lacks fall back to the ones it has (the test then compares fewer paths, and says so).

use lpmm_formats::simd::{self, Level};
use lpmm_optim::SlotKind;
use lpmm_optim::{
    Hyper, NonFinitePolicy, Optimizer, OptimizerOptions, ParamConfig, Storage, presets,
};

fn configs() -> Vec<(&'static str, ParamConfig)> {
    vec![
        ("adamw_f32", presets::adamw_f32(1e-3).build()),
        ("adamw_8bit_bf16", presets::adamw_8bit_bf16(1e-3).build()),
        (
            "adamw_8bit_bf16_sr",
            presets::adamw_8bit_bf16_sr(1e-3).build(),
        ),
        ("adamw_4bit_split", presets::adamw_4bit_split(1e-3).build()),
        (
            "adamw_4bit_released",
            presets::adamw_4bit_bf16_sr_released(1e-3).build(),
        ),
        ("lpmm_sgdm", presets::lpmm_sgdm(1e-2, 0.9).build()),
        (
            "sgdm_f32_nesterov",
            ParamConfig::f32(Hyper::Sgd(lpmm_optim::Sgd {
                lr: 1e-2,
                momentum: 0.9,
                dampening: 0.0,
                nesterov: true,
                weight_decay: 1e-4,
            })),
        ),
        (
            "lion_bf16",
            presets::bf16_nearest(Hyper::lion(1e-4)).build(),
        ),
        (
            "adam_l2_kahan",
            ParamConfig::f32(Hyper::Adam(lpmm_optim::Adam {
                lr: 1e-3,
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 1e-2,
                decoupled: false,
            }))
            .with_param(Storage::Bf16Kahan),
        ),
    ]
}

/// Parameters and states after three steps, as bit patterns.
fn run(config: ParamConfig) -> Vec<u32> {
    let mut opt = Optimizer::new(
        OptimizerOptions::default()
            .with_seed(11)
            .with_non_finite(NonFinitePolicy::SkipElements),
    )
    .unwrap();
    let released = config.grad == Storage::None;
    let nan_ok = !matches!(config.grad, Storage::Quantized { .. });
    let g = opt.add_group(config).unwrap();
    let shapes: [&[usize]; 3] = [&[5000], &[64, 70], &[37]];
    let mut ids = Vec::new();
    for (k, shape) in shapes.iter().enumerate() {
        let n: usize = shape.iter().product();
        let init: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 + k) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        ids.push((opt.add_param(&format!("p{k}"), shape, &init, g).unwrap(), n));
    }
    for step in 0..3 {
        for &(id, n) in &ids {
            let mut grad: Vec<f32> = (0..n)
                .map(|i| (((i * 31 + step * 17) % 211) as f32 - 105.0) * 1e-3)
                .collect();
            // A quantized accumulator refuses NaN (a typed error); the others hold it for the step.
            grad[n / 2] = if step == 1 && nan_ok { f32::NAN } else { 3e19 };
            if released {
                opt.step(lpmm_optim::Step::param(id, &grad)).unwrap();
            } else {
                opt.accumulate(id, &grad).unwrap();
            }
        }
        if !released {
            opt.step(lpmm_optim::Accumulated).unwrap();
        }
    }
    let mut bits = Vec::new();
    for &(id, n) in &ids {
        let mut out = vec![0f32; n];
        opt.read(id, SlotKind::Param, &mut out).unwrap();
        bits.extend(out.iter().map(|x| x.to_bits()));
        // State 1 (the index 0 this loop once tried is not a state).
        for state in [SlotKind::State1] {
            if opt.read(id, state, &mut out).is_ok() {
                bits.extend(out.iter().map(|x| x.to_bits()));
            }
        }
    }
    bits
}

#[test]
fn every_kernel_level_gives_the_same_bits() {
    let levels = [Level::Portable, Level::Avx2, Level::Avx512];
    eprintln!("this CPU: {:?}", simd::detected());
    for (name, config) in configs() {
        let results: Vec<Vec<u32>> = levels
            .iter()
            .map(|&l| {
                simd::force(Some(l));
                run(config)
            })
            .collect();
        simd::force(None);
        for (l, r) in levels.iter().zip(&results).skip(1) {
            let diff = r.iter().zip(&results[0]).filter(|(a, b)| a != b).count();
            assert_eq!(
                diff, 0,
                "{name}: {l:?} differs from portable in {diff} values"
            );
        }
    }
}
