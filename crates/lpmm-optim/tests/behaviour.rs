//! Behaviour of the optimizer core that needs no reference file: underflow, accumulation,
//! non-finite policies, clipping, gradient release, typed errors.

use lpmm_optim::{
    Hyper, NonFinitePolicy, OptimError, Optimizer, OptimizerOptions, ParamConfig, Storage,
    StoreRounding,
};

const N: usize = 4096;

fn sgd(lr: f64) -> Hyper {
    Hyper::sgd(lr, 0.0)
}

/// 1000 steps that each add +1e-4 to parameters of 1.0: the bf16 ulp at 1.0 is 2^-7 = 7.8e-3, so
/// each update is 1/78 of an ulp, far below the half ulp round-to-nearest needs.
fn underflow_run(param: Storage) -> Vec<f32> {
    let mut opt = Optimizer::new(OptimizerOptions {
        seed: 5,
        ..Default::default()
    })
    .unwrap();
    let group = opt
        .add_group(ParamConfig {
            param,
            ..ParamConfig::f32(sgd(1e-4))
        })
        .unwrap();
    let id = opt.add_param("p", &[N], &[1.0; N], group).unwrap();
    for _ in 0..1000 {
        opt.accumulate(id, &[-1.0; N]).unwrap();
        opt.step().unwrap();
    }
    let mut out = vec![0f32; N];
    opt.read_param(id, &mut out).unwrap();
    out
}

#[test]
fn underflow_stalls_round_to_nearest_but_not_sr_kahan_or_split_f32() {
    let reference = underflow_run(Storage::F32);
    let total = f64::from(reference[0]) - 1.0; // the f32 run moved by ~0.1
    assert!((total - 0.1).abs() < 1e-4, "f32 moved {total}");
    let mean = |v: &[f32]| v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;

    let nearest = underflow_run(Storage::Bf16(StoreRounding::Nearest));
    assert!(
        nearest.iter().all(|&x| x == 1.0),
        "bf16 round-to-nearest must stall at 1.0"
    );

    // Stochastic rounding: each element ends within a few ulps, the mean within 2% of the update.
    let sr = underflow_run(Storage::Bf16(StoreRounding::Stochastic));
    let sr_err = (mean(&sr) - f64::from(reference[0])).abs();
    assert!(sr_err < 0.02 * total, "bf16+SR mean off by {sr_err}");

    // Kahan: every element within 5% of the update (the bf16 compensation rounds too).
    let kahan = underflow_run(Storage::Bf16Kahan);
    let kahan_err = kahan
        .iter()
        .map(|&x| (f64::from(x) - f64::from(reference[0])).abs())
        .fold(0.0, f64::max);
    assert!(kahan_err < 0.05 * total, "bf16+Kahan off by {kahan_err}");

    // Split f32 is f32: bit for bit.
    let split = underflow_run(Storage::SplitF32);
    assert_eq!(
        split.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        reference.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn accumulated_micro_batches_equal_their_sum() {
    let run = |micro: &[Vec<f32>]| {
        let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
        let group = opt.add_group(ParamConfig::f32(Hyper::adamw(1e-2))).unwrap();
        let id = opt.add_param("p", &[8], &[0.5; 8], group).unwrap();
        for g in micro {
            opt.accumulate(id, g).unwrap();
        }
        opt.step().unwrap();
        let mut out = vec![0f32; 8];
        opt.read_param(id, &mut out).unwrap();
        out
    };
    // Powers of two: the f32 sums are exact, so one gradient equals its parts bit for bit.
    let a: Vec<f32> = (0..8).map(|i| i as f32 * 0.25).collect();
    let b: Vec<f32> = (0..8).map(|i| -(i as f32) * 0.125).collect();
    let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(run(&[a, b]), run(&[sum]));
}

#[test]
fn a_step_consumes_the_accumulator() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let group = opt.add_group(ParamConfig::f32(sgd(1.0))).unwrap();
    let id = opt.add_param("p", &[4], &[0.0; 4], group).unwrap();
    opt.accumulate(id, &[1.0; 4]).unwrap();
    assert_eq!(opt.step().unwrap().updated, 1);
    // Nothing accumulated since: the next step updates nothing.
    assert_eq!(opt.step().unwrap().updated, 0);
    let mut out = [0f32; 4];
    opt.read_param(id, &mut out).unwrap();
    assert_eq!(out, [-1.0; 4]);
}

#[test]
fn non_finite_gradients_skip_the_step_by_default_and_never_poison_states() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let group = opt.add_group(ParamConfig::f32(Hyper::adamw(1e-2))).unwrap();
    let a = opt.add_param("a", &[4], &[1.0; 4], group).unwrap();
    let b = opt.add_param("b", &[4], &[1.0; 4], group).unwrap();
    opt.accumulate(a, &[0.1, f32::NAN, 0.1, 0.1]).unwrap();
    opt.accumulate(b, &[0.1; 4]).unwrap();
    let report = opt.step().unwrap();
    assert!(report.skipped);
    assert_eq!(report.non_finite, vec![a]);
    assert_eq!(report.updated, 0);
    let mut out = [0f32; 4];
    opt.read_param(b, &mut out).unwrap();
    assert_eq!(out, [1.0; 4], "a skipped step changes no parameter");
    // The gradients were consumed: a clean step afterwards works from clean states.
    opt.accumulate(a, &[0.1; 4]).unwrap();
    let report = opt.step().unwrap();
    assert!(!report.skipped);
    let mut m = [0f32; 4];
    opt.read_state(a, 1, &mut m).unwrap();
    assert!(m.iter().all(|v| v.is_finite()));
}

#[test]
fn skip_elements_policy_leaves_only_the_bad_elements_unchanged() {
    let mut opt = Optimizer::new(OptimizerOptions {
        non_finite: NonFinitePolicy::SkipElements,
        ..Default::default()
    })
    .unwrap();
    let group = opt
        .add_group(ParamConfig::f32(Hyper::sgd(0.5, 0.9)))
        .unwrap();
    let id = opt.add_param("p", &[3], &[1.0; 3], group).unwrap();
    opt.accumulate(id, &[1.0, f32::INFINITY, 1.0]).unwrap();
    let report = opt.step().unwrap();
    assert!(!report.skipped);
    assert_eq!(report.non_finite, vec![id]);
    let (mut p, mut m) = ([0f32; 3], [0f32; 3]);
    opt.read_param(id, &mut p).unwrap();
    opt.read_state(id, 1, &mut m).unwrap();
    assert_eq!(p, [0.5, 1.0, 0.5]);
    assert_eq!(m, [1.0, 0.0, 1.0]);
}

#[test]
fn global_norm_clipping_scales_every_gradient() {
    let mut opt = Optimizer::new(OptimizerOptions {
        max_grad_norm: Some(1.0),
        ..Default::default()
    })
    .unwrap();
    let group = opt.add_group(ParamConfig::f32(sgd(1.0))).unwrap();
    let a = opt.add_param("a", &[1], &[0.0], group).unwrap();
    let b = opt.add_param("b", &[1], &[0.0], group).unwrap();
    opt.accumulate(a, &[3.0]).unwrap();
    opt.accumulate(b, &[4.0]).unwrap();
    let report = opt.step().unwrap();
    assert_eq!(report.grad_norm, Some(5.0));
    let (mut pa, mut pb) = ([0f32], [0f32]);
    opt.read_param(a, &mut pa).unwrap();
    opt.read_param(b, &mut pb).unwrap();
    assert!(
        (pa[0] + 0.6).abs() < 1e-6 && (pb[0] + 0.8).abs() < 1e-6,
        "{pa:?} {pb:?}"
    );
}

#[test]
fn gradient_release_equals_accumulate_then_step() {
    let config = ParamConfig {
        param: Storage::Bf16(StoreRounding::Stochastic),
        state1: Storage::DYNAMIC8_SIGNED,
        state2: Storage::DYNAMIC8_UNSIGNED,
        min_quantized_size: 0,
        ..ParamConfig::f32(Hyper::adamw(1e-3))
    };
    let init: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
    let grads: Vec<Vec<f32>> = (0..3)
        .map(|t| {
            (0..5000)
                .map(|i| ((i * (t + 3)) as f32 * 0.11).cos() * 0.01)
                .collect()
        })
        .collect();
    let mut one = Optimizer::new(OptimizerOptions {
        seed: 9,
        ..Default::default()
    })
    .unwrap();
    let mut two = one.clone();
    let g1 = one.add_group(config).unwrap();
    let g2 = two.add_group(config).unwrap();
    let p1 = one.add_param("w", &[50, 100], &init, g1).unwrap();
    let p2 = two.add_param("w", &[50, 100], &init, g2).unwrap();
    for g in &grads {
        one.accumulate(p1, g).unwrap();
        one.step().unwrap();
        two.step_param(p2, g).unwrap();
    }
    let (mut a, mut b) = (vec![0f32; 5000], vec![0f32; 5000]);
    one.read_param(p1, &mut a).unwrap();
    two.read_param(p2, &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn bad_input_gets_typed_errors() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let bad_hyper = [
        Hyper::Sgd {
            lr: -1.0,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        },
        Hyper::Sgd {
            lr: f64::NAN,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        },
        Hyper::Sgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 0.0,
        },
        Hyper::Adam {
            lr: 1e-3,
            betas: (1.0, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true,
        },
        Hyper::Adam {
            lr: 1e-3,
            betas: (0.9, -0.1),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true,
        },
        Hyper::Lion {
            lr: 1e-3,
            betas: (0.9, 1.5),
            weight_decay: 0.0,
        },
    ];
    for h in bad_hyper {
        assert!(
            matches!(
                opt.add_group(ParamConfig::f32(h)),
                Err(OptimError::Hyperparameter { .. } | OptimError::Nesterov)
            ),
            "{h:?}"
        );
    }
    let kahan_grad = ParamConfig {
        grad: Storage::Bf16Kahan,
        ..ParamConfig::f32(sgd(0.1))
    };
    assert!(matches!(
        opt.add_group(kahan_grad),
        Err(OptimError::StorageNotAllowed { .. })
    ));
    let g = opt.add_group(ParamConfig::f32(sgd(0.1))).unwrap();
    assert!(matches!(
        opt.add_param("p", &[3], &[0.0; 2], g),
        Err(OptimError::Length { .. })
    ));
    assert!(matches!(
        opt.add_param("p", &[0, 3], &[], g),
        Err(OptimError::Shape { .. })
    ));
    assert!(matches!(
        opt.add_param("p", &[1], &[f32::NAN], g),
        Err(OptimError::NonFiniteParam { .. })
    ));
    assert!(matches!(
        opt.add_param("p", &[1], &[0.0], 7),
        Err(OptimError::UnknownGroup(7))
    ));
    let id = opt.add_param("p", &[2], &[0.0; 2], g).unwrap();
    assert!(matches!(
        opt.add_param("p", &[2], &[0.0; 2], g),
        Err(OptimError::DuplicateName(_))
    ));
    assert!(matches!(
        opt.accumulate(id, &[1.0; 3]),
        Err(OptimError::Length { .. })
    ));
    assert!(matches!(
        opt.set_lr(-0.5),
        Err(OptimError::Hyperparameter { .. })
    ));
    assert!(matches!(
        opt.set_lr(f64::NAN),
        Err(OptimError::Hyperparameter { .. })
    ));
    assert!(matches!(
        opt.param_id("nope"),
        Err(OptimError::UnknownParam(_))
    ));
    assert!(
        Optimizer::new(OptimizerOptions {
            max_grad_norm: Some(0.0),
            ..Default::default()
        })
        .is_err()
    );
}

#[test]
fn the_learning_rate_can_change_every_step() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let group = opt.add_group(ParamConfig::f32(sgd(1.0))).unwrap();
    let id = opt.add_param("p", &[1], &[0.0], group).unwrap();
    for lr in [1.0, 0.5, 0.25] {
        opt.set_lr(lr).unwrap();
        opt.accumulate(id, &[1.0]).unwrap();
        opt.step().unwrap();
    }
    let mut out = [0f32];
    opt.read_param(id, &mut out).unwrap();
    assert_eq!(out, [-1.75]);
}

#[test]
fn small_tensors_keep_f32_states_decided_on_the_whole_tensor() {
    let config = ParamConfig {
        state1: Storage::DYNAMIC8_SIGNED,
        state2: Storage::DYNAMIC8_UNSIGNED,
        ..ParamConfig::f32(Hyper::adamw(1e-3))
    };
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(config).unwrap();
    let small = opt.add_param("small", &[4095], &[0.0; 4095], g).unwrap();
    // Not a multiple of the block: quantized all the same (torchao falls back to full precision).
    let big = opt.add_param("big", &[4097], &[0.0; 4097], g).unwrap();
    assert_eq!(opt.config(small).unwrap().state1, Storage::F32);
    assert_eq!(opt.config(big).unwrap().state1, Storage::DYNAMIC8_SIGNED);
}
