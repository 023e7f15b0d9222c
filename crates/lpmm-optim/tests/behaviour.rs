//! Behaviour of the optimizer core that needs no reference file: underflow, accumulation,
//! non-finite policies, clipping, gradient release, typed errors.

use lpmm_optim::Parts;
use lpmm_optim::SlotKind;
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
    let mut opt = Optimizer::new(OptimizerOptions::default().with_seed(5)).unwrap();
    let group = opt
        .add_group(ParamConfig::f32(sgd(1e-4)).with_param(param))
        .unwrap();
    let id = opt.add_param("p", &[N], &[1.0; N], group).unwrap();
    for _ in 0..1000 {
        opt.accumulate(id, &[-1.0; N]).unwrap();
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
    let mut out = vec![0f32; N];
    opt.read(id, SlotKind::Param, &mut out).unwrap();
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

/// 24-bit master weights keep the updates bf16 loses: +1e-4 at 1.0 is 3.28 steps of bf16+8's
/// 2^-15 (1/78 of bf16's step). To nearest each update moves the weight by exactly 3 steps (the
/// rounding's bias, 8.4% here); stochastically the mean follows f32.
#[test]
fn bf16_plus8_keeps_the_updates_bf16_loses() {
    let reference = underflow_run(Storage::F32);
    let total = f64::from(reference[0]) - 1.0;
    let near = underflow_run(Storage::Bf16Plus8(StoreRounding::Nearest));
    let three_steps = 1.0 + 1000.0 * 3.0 * 2f64.powi(-15);
    assert!(
        near.iter().all(|&x| f64::from(x) == three_steps),
        "{} vs {three_steps}",
        near[0]
    );
    let sr = underflow_run(Storage::Bf16Plus8(StoreRounding::Stochastic));
    let mean = sr.iter().map(|&x| f64::from(x)).sum::<f64>() / sr.len() as f64;
    let err = (mean - f64::from(reference[0])).abs();
    assert!(err < 0.002 * total, "bf16+8 SR mean off by {err}");
    // Each element within a few 24-bit steps of f32 (a random walk of 1000 roundings).
    let worst = sr
        .iter()
        .map(|&x| (f64::from(x) - f64::from(reference[0])).abs())
        .fold(0.0, f64::max);
    assert!(
        worst < 64.0 * 2f64.powi(-15),
        "bf16+8 SR element off by {worst}"
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
        opt.step(lpmm_optim::Accumulated).unwrap();
        let mut out = vec![0f32; 8];
        opt.read(id, SlotKind::Param, &mut out).unwrap();
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
    assert_eq!(opt.step(lpmm_optim::Accumulated).unwrap().updated, 1);
    // Nothing accumulated since: the next step updates nothing.
    assert_eq!(opt.step(lpmm_optim::Accumulated).unwrap().updated, 0);
    let mut out = [0f32; 4];
    opt.read(id, SlotKind::Param, &mut out).unwrap();
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
    let report = opt.step(lpmm_optim::Accumulated).unwrap();
    assert!(report.skipped);
    assert_eq!(report.non_finite, vec![a]);
    assert_eq!(report.updated, 0);
    let mut out = [0f32; 4];
    opt.read(b, SlotKind::Param, &mut out).unwrap();
    assert_eq!(out, [1.0; 4], "a skipped step changes no parameter");
    // The gradients were consumed: a clean step afterwards works from clean states.
    opt.accumulate(a, &[0.1; 4]).unwrap();
    let report = opt.step(lpmm_optim::Accumulated).unwrap();
    assert!(!report.skipped);
    let mut m = [0f32; 4];
    opt.read(a, SlotKind::State1, &mut m).unwrap();
    assert!(m.iter().all(|v| v.is_finite()));
}

#[test]
fn skip_elements_policy_leaves_only_the_bad_elements_unchanged() {
    let mut opt =
        Optimizer::new(OptimizerOptions::default().with_non_finite(NonFinitePolicy::SkipElements))
            .unwrap();
    let group = opt
        .add_group(ParamConfig::f32(Hyper::sgd(0.5, 0.9)))
        .unwrap();
    let id = opt.add_param("p", &[3], &[1.0; 3], group).unwrap();
    opt.accumulate(id, &[1.0, f32::INFINITY, 1.0]).unwrap();
    let report = opt.step(lpmm_optim::Accumulated).unwrap();
    assert!(!report.skipped);
    assert_eq!(report.non_finite, vec![id]);
    let (mut p, mut m) = ([0f32; 3], [0f32; 3]);
    opt.read(id, SlotKind::Param, &mut p).unwrap();
    opt.read(id, SlotKind::State1, &mut m).unwrap();
    assert_eq!(p, [0.5, 1.0, 0.5]);
    assert_eq!(m, [1.0, 0.0, 1.0]);
}

#[test]
fn global_norm_clipping_scales_every_gradient() {
    let mut opt =
        Optimizer::new(OptimizerOptions::default().with_max_grad_norm(Some(1.0))).unwrap();
    let group = opt.add_group(ParamConfig::f32(sgd(1.0))).unwrap();
    let a = opt.add_param("a", &[1], &[0.0], group).unwrap();
    let b = opt.add_param("b", &[1], &[0.0], group).unwrap();
    opt.accumulate(a, &[3.0]).unwrap();
    opt.accumulate(b, &[4.0]).unwrap();
    let report = opt.step(lpmm_optim::Accumulated).unwrap();
    assert_eq!(report.grad_norm, Some(5.0));
    let (mut pa, mut pb) = ([0f32], [0f32]);
    opt.read(a, SlotKind::Param, &mut pa).unwrap();
    opt.read(b, SlotKind::Param, &mut pb).unwrap();
    assert!(
        (pa[0] + 0.6).abs() < 1e-6 && (pb[0] + 0.8).abs() < 1e-6,
        "{pa:?} {pb:?}"
    );
}

#[test]
fn gradient_release_equals_accumulate_then_step() {
    let config = ParamConfig::f32(Hyper::adamw(1e-3))
        .with_param(Storage::Bf16(StoreRounding::Stochastic))
        .with_state1(Storage::DYNAMIC8_SIGNED)
        .with_state2(Storage::DYNAMIC8_UNSIGNED)
        .with_min_quantized_size(0);
    let init: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
    let grads: Vec<Vec<f32>> = (0..3)
        .map(|t| {
            (0..5000)
                .map(|i| ((i * (t + 3)) as f32 * 0.11).cos() * 0.01)
                .collect()
        })
        .collect();
    let options = OptimizerOptions::default().with_seed(9);
    let mut one = Optimizer::new(options).unwrap();
    let mut two = Optimizer::new(options).unwrap();
    let g1 = one.add_group(config).unwrap();
    let g2 = two.add_group(config).unwrap();
    let p1 = one.add_param("w", &[50, 100], &init, g1).unwrap();
    let p2 = two.add_param("w", &[50, 100], &init, g2).unwrap();
    for g in &grads {
        one.accumulate(p1, g).unwrap();
        one.step(lpmm_optim::Accumulated).unwrap();
        two.step(lpmm_optim::Step::param(p2, g)).unwrap();
    }
    let (mut a, mut b) = (vec![0f32; 5000], vec![0f32; 5000]);
    one.read(p1, SlotKind::Param, &mut a).unwrap();
    two.read(p2, SlotKind::Param, &mut b).unwrap();
    assert_eq!(a, b);
}

/// Skipping elements, a released step does not read its gradient before it (the step finds
/// the non-finite elements as it goes): the same bits and report as accumulating the gradient
/// and stepping, on the specialized kernels (f32 AdamW, 8-bit AdamW with bf16 parameters) and
/// the generic path (a Kahan parameter), with an Inf and a NaN in one of the steps.
#[test]
fn released_steps_skipping_elements_equal_accumulate_then_step() {
    let configs = [
        lpmm_optim::presets::adamw_f32(1e-3).build(),
        // An f32 accumulator, so that accumulating does not round the gradient.
        lpmm_optim::presets::adamw_8bit_bf16(1e-3)
            .build()
            .with_grad(Storage::F32),
        ParamConfig::f32(Hyper::adamw(1e-3)).with_param(Storage::Bf16Kahan),
    ];
    let n = 5000;
    let init: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let options = OptimizerOptions::default()
        .with_seed(5)
        .with_non_finite(NonFinitePolicy::SkipElements);
    for config in configs {
        let mut one = Optimizer::new(options).unwrap();
        let mut two = Optimizer::new(options).unwrap();
        let g1 = one.add_group(config).unwrap();
        let g2 = two.add_group(config).unwrap();
        let p1 = one.add_param("w", &[n], &init, g1).unwrap();
        let p2 = two.add_param("w", &[n], &init, g2).unwrap();
        for t in 0..4 {
            let mut g: Vec<f32> = (0..n)
                .map(|i| ((i * (t + 3)) as f32 * 0.11).cos() * 0.01)
                .collect();
            if t == 2 {
                g[7] = f32::INFINITY;
                g[4000] = f32::NAN;
            }
            one.accumulate(p1, &g).unwrap();
            let r1 = one.step(lpmm_optim::Accumulated).unwrap();
            let r2 = two.step(lpmm_optim::Step::param(p2, &g)).unwrap();
            assert_eq!(r1.non_finite, r2.non_finite, "{config:?} step {t}");
            assert_eq!(r2.non_finite, if t == 2 { vec![p2] } else { vec![] });
            assert!(!r1.skipped && !r2.skipped);
        }
        for slot in [SlotKind::Param, SlotKind::State1, SlotKind::State2] {
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            one.read(p1, slot, &mut a).unwrap();
            two.read(p2, slot, &mut b).unwrap();
            let differs = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            assert_eq!(differs, None, "{config:?} {slot:?}");
        }
    }
}

/// A released gradient is added to an empty accumulator (`0.0 + g`), so a `-0.0` in it steps as
/// `+0.0` does, as it would after `accumulate`: a zero parameter keeps its sign either way.
#[test]
fn a_released_negative_zero_gradient_steps_like_an_accumulated_one() {
    let init = [-0.0f32, 0.0, -0.0, 0.0, 1.0, -1.0];
    let grad = [-0.0f32, -0.0, 0.0, 0.0, -0.0, -0.0];
    let options = OptimizerOptions::default().with_seed(3);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut results = Vec::new();
    for release in [false, true] {
        let mut opt = Optimizer::new(options).unwrap();
        let group = opt.add_group(ParamConfig::f32(sgd(1.0))).unwrap();
        let id = opt.add_param("z", &[6], &init, group).unwrap();
        if release {
            opt.step(lpmm_optim::Step::param(id, &grad)).unwrap();
        } else {
            opt.accumulate(id, &grad).unwrap();
            opt.step(lpmm_optim::Accumulated).unwrap();
        }
        let mut out = [0f32; 6];
        opt.read(id, SlotKind::Param, &mut out).unwrap();
        results.push(bits(&out));
    }
    assert_eq!(results[0], results[1]);
    assert_eq!(
        results[1],
        bits(&init),
        "a zero gradient moves nothing, zero signs included"
    );
}

#[test]
fn bad_input_gets_typed_errors() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let bad_hyper = [
        Hyper::Sgd(lpmm_optim::Sgd {
            lr: -1.0,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }),
        Hyper::Sgd(lpmm_optim::Sgd {
            lr: f64::NAN,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }),
        Hyper::Sgd(lpmm_optim::Sgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 0.0,
        }),
        Hyper::Adam(lpmm_optim::Adam {
            lr: 1e-3,
            betas: (1.0, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true,
        }),
        Hyper::Adam(lpmm_optim::Adam {
            lr: 1e-3,
            betas: (0.9, -0.1),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true,
        }),
        Hyper::Lion(lpmm_optim::Lion {
            lr: 1e-3,
            betas: (0.9, 1.5),
            weight_decay: 0.0,
        }),
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
    let kahan_grad = ParamConfig::f32(sgd(0.1)).with_grad(Storage::Bf16Kahan);
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
        opt.param("nope").map(|p| p.id),
        Err(OptimError::UnknownParam(_))
    ));
    assert!(Optimizer::new(OptimizerOptions::default().with_max_grad_norm(Some(0.0))).is_err());
}

#[test]
fn the_learning_rate_can_change_every_step() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let group = opt.add_group(ParamConfig::f32(sgd(1.0))).unwrap();
    let id = opt.add_param("p", &[1], &[0.0], group).unwrap();
    for lr in [1.0, 0.5, 0.25] {
        opt.set_lr(lr).unwrap();
        opt.accumulate(id, &[1.0]).unwrap();
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
    let mut out = [0f32];
    opt.read(id, SlotKind::Param, &mut out).unwrap();
    assert_eq!(out, [-1.75]);
}

#[test]
fn small_tensors_keep_f32_states_decided_on_the_whole_tensor() {
    let config = ParamConfig::f32(Hyper::adamw(1e-3))
        .with_state1(Storage::DYNAMIC8_SIGNED)
        .with_state2(Storage::DYNAMIC8_UNSIGNED);
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(config).unwrap();
    let small = opt.add_param("small", &[4095], &[0.0; 4095], g).unwrap();
    // Not a multiple of the block: quantized all the same (torchao falls back to full precision).
    let big = opt.add_param("big", &[4097], &[0.0; 4097], g).unwrap();
    assert_eq!(
        opt.param(small).map(|p| p.config).unwrap().state1,
        Storage::F32
    );
    assert_eq!(
        opt.param(big).map(|p| p.config).unwrap().state1,
        Storage::DYNAMIC8_SIGNED
    );
}

#[test]
fn optimizer_accumulation_folds_micro_batches_into_the_states() {
    // SGD with momentum mu, no dampening: micro-batch g1 into the states (m = g1, first step),
    // then the step with g2: m = mu*g1 + g2 (one fma), p = p0 - lr*m.
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let config = ParamConfig::f32(Hyper::sgd(0.1, 0.9)).with_grad(Storage::None);
    let group = opt.add_group(config).unwrap();
    let id = opt.add_param("p", &[3], &[1.0, 2.0, 3.0], group).unwrap();
    let (g1, g2) = ([0.5f32, -0.25, 2.0], [1.0f32, 1.0, -1.0]);
    opt.step(lpmm_optim::Step::states_only(id, &g1)).unwrap();
    let mut p = [0f32; 3];
    opt.read(id, SlotKind::Param, &mut p).unwrap();
    assert_eq!(
        p,
        [1.0, 2.0, 3.0],
        "accumulation does not move the parameter"
    );
    opt.step(lpmm_optim::Step::param(id, &g2)).unwrap();
    opt.read(id, SlotKind::Param, &mut p).unwrap();
    for i in 0..3 {
        let m = g2[i].mul_add(1.0, g1[i] * 0.9);
        assert_eq!(p[i], m.mul_add(-0.1, [1.0f32, 2.0, 3.0][i]), "element {i}");
    }
    // No gradient accumulator: accumulate() is refused, and no gradient memory is held.
    assert!(matches!(
        opt.accumulate(id, &g1),
        Err(OptimError::NoAccumulator(_))
    ));
    assert_eq!(opt.memory_report().slot_totals()[1], 0);
}

#[test]
fn optimizer_accumulation_skips_weight_decay_and_counts_steps() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let group = opt
        .add_group(ParamConfig::f32(Hyper::adamw(1e-2)).with_grad(Storage::None))
        .unwrap();
    let id = opt.add_param("p", &[2], &[1.0, -1.0], group).unwrap();
    opt.step(lpmm_optim::Step::states_only(id, &[0.5, 0.5]))
        .unwrap();
    let (mut p, mut m, mut v) = ([0f32; 2], [0f32; 2], [0f32; 2]);
    opt.read(id, SlotKind::Param, &mut p).unwrap();
    opt.read(id, SlotKind::State1, &mut m).unwrap();
    opt.read(id, SlotKind::State2, &mut v).unwrap();
    assert_eq!(p, [1.0, -1.0], "no decay, no step");
    let w1 = (1.0f64 - 0.9) as f32;
    let w2 = (1.0f64 - 0.999) as f32;
    assert_eq!(m, [(0.5f32 - 0.0).mul_add(w1, 0.0); 2]);
    assert_eq!(v, [(w2 * 0.5f32).mul_add(0.5, 0.0); 2]);
}

/// LPMM's micro-batching, measured: 64 per-sample gradients summed into an 8-bit group-64
/// stochastic-rounding accumulator, as 64 additions of one sample, 8 of eight samples (summed in
/// f32 first) or 1 of all 64. Each addition adds rounding variance of at most (step/2)^2, so the
/// error of the accumulated gradient falls with the number of additions, and it stays unbiased.
#[test]
fn larger_micro_batches_accumulate_with_less_error_and_no_bias() {
    let n = 4096;
    let samples: Vec<Vec<f32>> = (0..64u64)
        .map(|s| {
            (0..n as u64)
                .map(|i| ((i * 2654435761 + s * 40503) % 2001) as f32 / 1000.0 - 1.0)
                .map(|x| x * 1e-2)
                .collect()
        })
        .collect();
    let exact: Vec<f64> = (0..n)
        .map(|i| samples.iter().map(|s| f64::from(s[i])).sum())
        .collect();
    let rms_exact = (exact.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt();
    let run = |micro: usize| -> (f64, f64) {
        let config = ParamConfig::f32(Hyper::sgd(1.0, 0.0)).with_grad(Storage::LINEAR8_GROUP64_SR);
        let mut opt = Optimizer::new(OptimizerOptions::default().with_seed(micro as u64)).unwrap();
        let g = opt.add_group(config).unwrap();
        let id = opt.add_param("p", &[n], &vec![0.0; n], g).unwrap();
        for batch in samples.chunks(micro) {
            let sum: Vec<f32> = (0..n).map(|i| batch.iter().map(|s| s[i]).sum()).collect();
            opt.accumulate(id, &sum).unwrap();
        }
        opt.step(lpmm_optim::Accumulated).unwrap(); // p = 0 - 1 * accumulated gradient, exactly
        let mut p = vec![0f32; n];
        opt.read(id, SlotKind::Param, &mut p).unwrap();
        let err: Vec<f64> = p
            .iter()
            .zip(&exact)
            .map(|(&p, &e)| -f64::from(p) - e)
            .collect();
        let rms = (err.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt() / rms_exact;
        let mean = err.iter().sum::<f64>() / n as f64 / rms_exact;
        (rms, mean)
    };
    let (e1, m1) = run(1);
    let (e8, m8) = run(8);
    let (e64, m64) = run(64);
    println!(
        "relative RMS error: micro-batch 1: {e1:.3e}, 8: {e8:.3e}, 64: {e64:.3e}; mean error {m1:.1e} {m8:.1e} {m64:.1e}"
    );
    assert!(e1 > 1.5 * e8 && e8 > 1.5 * e64, "{e1} {e8} {e64}");
    // Unbiased: the mean error over 4096 elements is within 4 standard errors of 0.
    for (e, m) in [(e1, m1), (e8, m8), (e64, m64)] {
        assert!(m.abs() < 4.0 * e / (n as f64).sqrt(), "mean {m} vs rms {e}");
    }
}

#[test]
fn a_huge_finite_gradient_never_poisons_the_states() {
    for (state1, state2) in [
        (Storage::F32, Storage::F32),
        (Storage::DYNAMIC8_SIGNED, Storage::DYNAMIC8_UNSIGNED),
    ] {
        let mut opt = Optimizer::new(
            OptimizerOptions::default().with_non_finite(NonFinitePolicy::SkipElements),
        )
        .unwrap();
        let config = ParamConfig::f32(Hyper::adamw(1e-3))
            .with_state1(state1)
            .with_state2(state2)
            .with_min_quantized_size(0);
        let g = opt.add_group(config).unwrap();
        let n = 512;
        let id = opt.add_param("p", &[n], &vec![0.5; n], g).unwrap();
        let mut grad = vec![1e-3f32; n];
        grad[300] = 1e21; // finite, but its square overflows f32
        opt.accumulate(id, &grad).unwrap();
        let report = opt.step(lpmm_optim::Accumulated).unwrap();
        assert_eq!(report.non_finite, vec![id], "{state1:?}");
        let (mut p, mut m, mut v) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        opt.read(id, SlotKind::Param, &mut p).unwrap();
        opt.read(id, SlotKind::State1, &mut m).unwrap();
        opt.read(id, SlotKind::State2, &mut v).unwrap();
        assert!(
            m.iter().chain(&v).chain(&p).all(|x| x.is_finite()),
            "{state1:?}"
        );
        assert_eq!(p[300], 0.5, "the overflowing element is left unchanged");
        assert!(p[0] < 0.5 && p[511] < 0.5, "the other elements are updated");
        // The next, ordinary step works from finite states everywhere.
        opt.accumulate(id, &vec![1e-3f32; n]).unwrap();
        assert!(
            opt.step(lpmm_optim::Accumulated)
                .unwrap()
                .non_finite
                .is_empty()
        );
    }
}

#[test]
fn gradient_release_skips_when_the_accumulator_holds_a_non_finite_value() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt
        .add_group(ParamConfig::f32(Hyper::sgd(1.0, 0.0)))
        .unwrap();
    let id = opt.add_param("p", &[3], &[0.0; 3], g).unwrap();
    opt.accumulate(id, &[0.0, f32::NAN, 0.0]).unwrap();
    let report = opt.step(lpmm_optim::Step::param(id, &[1.0; 3])).unwrap();
    assert!(report.skipped);
    assert_eq!(report.non_finite, vec![id]);
    let mut p = [0f32; 3];
    opt.read(id, SlotKind::Param, &mut p).unwrap();
    assert_eq!(p, [0.0; 3]);
    // The bad gradient was consumed: the next release step is clean.
    assert!(
        !opt.step(lpmm_optim::Step::param(id, &[1.0; 3]))
            .unwrap()
            .skipped
    );
    opt.read(id, SlotKind::Param, &mut p).unwrap();
    assert_eq!(p, [-1.0; 3]);
}

#[test]
fn clipping_still_applies_to_finite_gradients_under_skip_elements() {
    let mut opt = Optimizer::new(
        OptimizerOptions::default()
            .with_max_grad_norm(Some(1.0))
            .with_non_finite(NonFinitePolicy::SkipElements),
    )
    .unwrap();
    let g = opt
        .add_group(ParamConfig::f32(Hyper::sgd(1.0, 0.0)))
        .unwrap();
    let id = opt.add_param("p", &[3], &[0.0; 3], g).unwrap();
    opt.accumulate(id, &[f32::INFINITY, 100.0, 100.0]).unwrap();
    let report = opt.step(lpmm_optim::Accumulated).unwrap();
    let norm = (2.0f64 * 100.0 * 100.0).sqrt();
    assert_eq!(
        report.grad_norm,
        Some(norm),
        "the norm of the finite elements"
    );
    let mut p = [0f32; 3];
    opt.read(id, SlotKind::Param, &mut p).unwrap();
    let clipped = -100.0 * (1.0 / (norm + 1e-6)) as f32;
    assert_eq!(p[0], 0.0);
    assert!(
        (p[1] - clipped).abs() < 1e-6 && (p[2] - clipped).abs() < 1e-6,
        "{p:?}"
    );
}

#[test]
fn a_per_parameter_learning_rate_survives_schedule_changes() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt
        .add_group(ParamConfig::f32(Hyper::sgd(0.1, 0.0)))
        .unwrap();
    let follows = opt.add_param("follows", &[1], &[0.0], g).unwrap();
    let doubled = opt
        .add_param_with(
            "doubled",
            &[1],
            &[0.0],
            g,
            ParamConfig::f32(Hyper::sgd(0.2, 0.0)),
        )
        .unwrap();
    let frozen = opt
        .add_param_with(
            "frozen",
            &[1],
            &[0.0],
            g,
            ParamConfig::f32(Hyper::sgd(0.0, 0.0)),
        )
        .unwrap();
    opt.set_lr(0.5).unwrap();
    for id in [follows, doubled, frozen] {
        opt.accumulate(id, &[1.0]).unwrap();
    }
    opt.step(lpmm_optim::Accumulated).unwrap();
    let read = |id| {
        let mut p = [0f32];
        opt.read(id, SlotKind::Param, &mut p).unwrap();
        p[0]
    };
    assert_eq!(read(follows), -0.5);
    assert_eq!(
        read(doubled),
        -1.0,
        "twice the group's rate, before and after the change"
    );
    assert_eq!(read(frozen), 0.0, "lr 0 stays 0: a scaled zero");
}

#[test]
fn hyperparameters_must_survive_the_cast_to_f32() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let too_big = Hyper::Sgd(lpmm_optim::Sgd {
        lr: 1e39,
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
    });
    assert!(matches!(
        opt.add_group(ParamConfig::f32(too_big)),
        Err(OptimError::Hyperparameter { .. })
    ));
    let vanishing_eps = Hyper::Adam(lpmm_optim::Adam {
        lr: 1e-3,
        betas: (0.9, 0.999),
        eps: 1e-50,
        weight_decay: 0.0,
        decoupled: true,
    });
    assert!(matches!(
        opt.add_group(ParamConfig::f32(vanishing_eps)),
        Err(OptimError::Hyperparameter { .. })
    ));
    let g = opt
        .add_group(ParamConfig::f32(Hyper::sgd(0.1, 0.0)))
        .unwrap();
    opt.add_param("p", &[1], &[0.0], g).unwrap();
    assert!(matches!(
        opt.set_lr(1e39),
        Err(OptimError::Hyperparameter { .. })
    ));
}

#[test]
fn adam_with_beta1_zero_keeps_exactly_the_gradient() {
    // PyTorch's lerp for weights >= 0.5 is fma(w - 1, g - m, g): with beta1 = 0, m = g exactly.
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let hyper = Hyper::Adam(lpmm_optim::Adam {
        lr: 1e-3,
        betas: (0.0, 0.999),
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: true,
    });
    let g = opt.add_group(ParamConfig::f32(hyper)).unwrap();
    let id = opt.add_param("p", &[3], &[1.0; 3], g).unwrap();
    let grads = [[0.3f32, -1.7, 2.9e-5], [0.11, 0.7, -3.0]];
    for grad in &grads {
        opt.accumulate(id, grad).unwrap();
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
    let mut m = [0f32; 3];
    opt.read(id, SlotKind::State1, &mut m).unwrap();
    assert_eq!(m, grads[1]);
}

/// The 8-bit first moment (`Storage::DYNAMIC8_SIGNED`) is bitsandbytes' CPU quantization, the
/// anchor of tests/anchors.rs: nearest code, no sign fix (docs/FORMATS.md §6). A momentum too
/// small for the map's smallest code therefore stores as 0, where bitsandbytes' CUDA kernels
/// (which apply the sign fix) store the smallest code of its sign. Every backend stores the same
/// codes (the conformance suite).
#[test]
fn the_8bit_first_moment_is_bitsandbytes_cpu_quantization_without_the_sign_fix() {
    use lpmm_optim::{MapKind, SlotKind};
    use lpmm_quant::{BlockSize, Blockwise, QuantRounding};
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt
        .add_group(
            ParamConfig::f32(Hyper::sgd(1e-3, 0.9))
                .with_grad(Storage::None)
                .with_state1(Storage::DYNAMIC8_SIGNED)
                .with_min_quantized_size(0),
        )
        .unwrap();
    let n = 512;
    let id = opt.add_param("w", &[n], &vec![0.0; n], g).unwrap();
    // SGD's first step stores the gradient as the momentum.
    let mut grad: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    grad[5] = -1e-9;
    opt.step(lpmm_optim::Step::param(id, &grad)).unwrap();
    let stored = Parts::of(&opt)
        .export_slot(id, SlotKind::State1, None)
        .unwrap();
    let q = |fix: bool| {
        let b =
            Blockwise::new(MapKind::DynamicSigned8.shared(), BlockSize::B256).with_sign_fix(fix);
        let (mut codes, mut absmax) = (vec![0u8; n], vec![0f32; 2]);
        b.quantize(&grad, &mut codes, &mut absmax, QuantRounding::Nearest)
            .unwrap();
        codes
    };
    assert_eq!(stored.regions[0].bytes, q(false), "the CPU path's codes");
    let fixed = q(true);
    let moved: Vec<usize> = (0..n).filter(|&i| fixed[i] != q(false)[i]).collect();
    assert_eq!(
        moved,
        vec![5],
        "the sign fix would move only the tiny negative momentum"
    );
    let mut m = vec![0f32; n];
    opt.read(id, SlotKind::State1, &mut m).unwrap();
    assert_eq!(m[5].to_bits(), 0, "stored as +0, not as a negative code");
}
