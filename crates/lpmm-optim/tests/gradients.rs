//! A step taken straight from the caller's gradient buffers (`Optimizer::step` with `Step::given`): the
//! same bits as accumulating the same gradients into exact (f32) accumulators and stepping, the
//! global policies over all gradients, every gradient released once its parameter has stepped.

use lpmm_optim::Parts;
use lpmm_optim::backend::HostValues;
use lpmm_optim::testing::Rng;
use lpmm_optim::{
    Gradients, NonFinitePolicy, Optimizer, OptimizerOptions, ParamConfig, ParamId, SlotKind,
    Storage, presets,
};

/// Gradients from host vectors that record which were consumed.
struct Grads {
    grads: Vec<Vec<f32>>,
    consumed: Vec<ParamId>,
}

impl Gradients<lpmm_optim::Cpu> for Grads {
    fn gradient(
        &mut self,
        id: ParamId,
        f: &mut lpmm_optim::WithGradient<'_, lpmm_optim::Cpu>,
    ) -> Result<(), lpmm_optim::OptimError> {
        match self.grads.get(id.index()) {
            Some(g) if !g.is_empty() => f(Some(HostValues::F32(g))),
            _ => f(None),
        }
    }

    fn consumed(&mut self, id: ParamId) {
        self.consumed.push(id);
        // The caller drops it.
        self.grads[id.index()] = Vec::new();
    }
}

const SIZES: [usize; 4] = [3 << 20, 5000, 300, 64];

fn optimizer(config: ParamConfig, options: OptimizerOptions, rng: &mut Rng) -> Optimizer {
    let mut opt = Optimizer::new(options).unwrap();
    opt.add_group(config).unwrap();
    for (k, &n) in SIZES.iter().enumerate() {
        opt.add_param(&format!("p{k}"), &[n], &rng.spread(n, 0.5), 0)
            .unwrap();
    }
    opt
}

fn id(opt: &Optimizer, k: usize) -> ParamId {
    opt.param(&format!("p{k}")).map(|p| p.id).unwrap()
}

fn same(a: &Optimizer, b: &Optimizer, what: &str) {
    for k in 0..SIZES.len() {
        let id = a.param(&format!("p{k}")).map(|p| p.id).unwrap();
        for slot in SlotKind::ALL {
            assert_eq!(
                Parts::of(a).export_slot(id, slot, None).unwrap(),
                Parts::of(b).export_slot(id, slot, None).unwrap(),
                "{what}: p{k} {}",
                slot.name()
            );
        }
    }
}

#[test]
fn stepping_from_the_callers_gradients_equals_accumulating_them() {
    let clipped = OptimizerOptions::default()
        .with_seed(3)
        .with_max_grad_norm(Some(0.5))
        .with_non_finite(NonFinitePolicy::SkipStep);
    for (name, config) in [
        ("adamw f32", presets::adamw_f32(1e-3).build()),
        ("sgdm f32", presets::sgdm_f32(0.05, 0.9).build()),
        (
            "8-bit adamw, bf16-sr params, f32 gradients",
            presets::adamw_8bit_bf16_sr(1e-3)
                .with_grad(Storage::F32)
                .build(),
        ),
    ] {
        let mut rng = Rng::new(9);
        let mut acc = optimizer(config, clipped, &mut rng);
        let mut rng = Rng::new(9);
        let mut direct = optimizer(config, clipped, &mut rng);
        for step in 0..3 {
            let grads: Vec<Vec<f32>> = SIZES.iter().map(|&n| rng.spread(n, 2.0)).collect();
            for (k, g) in grads.iter().enumerate() {
                acc.accumulate(id(&acc, k), g).unwrap();
            }
            let r1 = acc.step(lpmm_optim::Accumulated).unwrap();
            let mut g = Grads {
                grads,
                consumed: Vec::new(),
            };
            let r2 = direct.step(lpmm_optim::Step::given(&mut g)).unwrap();
            assert_eq!(r1, r2, "{name} step {step}");
            assert!(r1.grad_norm.unwrap() > 0.5, "the case must clip");
            assert_eq!(g.consumed.len(), SIZES.len());
            assert!(g.grads.iter().all(Vec::is_empty), "every gradient released");
            same(&acc, &direct, &format!("{name} step {step}"));
        }
        assert_eq!(acc.status().steps, direct.status().steps);
        // Stepped only from given gradients, no accumulator was ever allocated; the accumulating
        // optimizer holds one (f32: 4 bytes an element) from its first accumulation.
        let numel: usize = SIZES.iter().sum();
        assert_eq!(direct.memory_report().slot_totals()[1], 0, "{name}");
        assert_eq!(acc.memory_report().slot_totals()[1], 4 * numel, "{name}");
    }
}

#[test]
fn a_non_finite_gradient_skips_the_whole_step_and_releases_every_gradient() {
    let mut rng = Rng::new(2);
    let mut opt = optimizer(
        presets::adamw_f32(1e-3).build(),
        OptimizerOptions::default(),
        &mut rng,
    );
    let before: Vec<_> = (0..SIZES.len())
        .map(|k| {
            Parts::of(&opt)
                .export_slot(id(&opt, k), SlotKind::Param, None)
                .unwrap()
        })
        .collect();
    let mut grads: Vec<Vec<f32>> = SIZES.iter().map(|&n| rng.spread(n, 1.0)).collect();
    grads[2][17] = f32::NAN;
    // Parameter 3 has no gradient this step.
    grads[3] = Vec::new();
    let mut g = Grads {
        grads,
        consumed: Vec::new(),
    };
    let report = opt.step(lpmm_optim::Step::given(&mut g)).unwrap();
    assert!(report.skipped);
    assert_eq!(report.non_finite, vec![id(&opt, 2)]);
    assert_eq!(g.consumed.len(), 3, "every given gradient released");
    for (k, b) in before.iter().enumerate() {
        assert_eq!(
            &Parts::of(&opt)
                .export_slot(id(&opt, k), SlotKind::Param, None)
                .unwrap(),
            b,
            "nothing moved"
        );
    }
}

#[test]
fn a_lent_parameter_steps_in_the_lenders_buffer() {
    let config = presets::adamw_f32(1e-3);
    let mut rng = Rng::new(4);
    let init = rng.spread(5000, 0.5);
    let mut held = Optimizer::new(OptimizerOptions::default()).unwrap();
    held.add_group(config).unwrap();
    let a = held.add_param("w", &[5000], &init, 0).unwrap();
    let mut lent = Optimizer::new(OptimizerOptions::default()).unwrap();
    lent.add_group(config).unwrap();
    let mut buffers = vec![init.clone()];
    let b = lent
        .add_lent_param("w", &[5000], HostValues::F32(&buffers[0]), 0, config)
        .unwrap();
    for _ in 0..2 {
        let grad = rng.spread(5000, 1.0);
        held.accumulate(a, &grad).unwrap();
        held.step(lpmm_optim::Accumulated).unwrap();
        let mut g = vec![grad];
        lent.step(lpmm_optim::Step::given(&mut g).lent(lpmm_optim::Lent::Lender(&mut buffers)))
            .unwrap();
    }
    let want = Parts::of(&held)
        .export_slot(a, SlotKind::Param, None)
        .unwrap();
    assert_eq!(want.regions[0].bytes, HostValues::F32(&buffers[0]).bytes());
    // Without a lender the lent parameter is a typed error.
    let mut g = vec![rng.spread(5000, 1.0)];
    assert!(matches!(
        lent.step(lpmm_optim::Step::given(&mut g)),
        Err(lpmm_optim::OptimError::Lent { .. })
    ));
    let _ = b;
}

#[test]
fn a_pending_accumulated_gradient_is_refused() {
    let mut rng = Rng::new(5);
    let mut opt = optimizer(
        presets::sgdm_f32(0.1, 0.9).build(),
        OptimizerOptions::default(),
        &mut rng,
    );
    opt.accumulate(id(&opt, 1), &rng.spread(5000, 1.0)).unwrap();
    let mut grads: Vec<Vec<f32>> = SIZES.iter().map(|&n| rng.spread(n, 1.0)).collect();
    let err = opt.step(lpmm_optim::Step::given(&mut grads)).unwrap_err();
    assert!(matches!(err, lpmm_optim::OptimError::Lent { .. }), "{err}");
    assert_eq!(opt.status().steps, 0);
}

#[test]
fn given_and_accumulated_gradients_step_together_under_one_norm() {
    let clipped = OptimizerOptions::default()
        .with_seed(8)
        .with_max_grad_norm(Some(0.5))
        .with_non_finite(NonFinitePolicy::SkipStep);
    let config = presets::adamw_f32(1e-3);
    let mut rng = Rng::new(6);
    let mut acc = optimizer(config.build(), clipped, &mut rng);
    let mut rng = Rng::new(6);
    let mut mixed = optimizer(config.build(), clipped, &mut rng);
    for step in 0..2 {
        let grads: Vec<Vec<f32>> = SIZES.iter().map(|&n| rng.spread(n, 2.0)).collect();
        for (k, g) in grads.iter().enumerate() {
            acc.accumulate(id(&acc, k), g).unwrap();
        }
        let r1 = acc.step(lpmm_optim::Accumulated).unwrap();
        // Parameters 0 and 2 accumulated, 1 and 3 given.
        let mut given = grads.clone();
        for k in [0, 2] {
            mixed.accumulate(id(&mixed, k), &grads[k]).unwrap();
            given[k] = Vec::new();
        }
        let r2 = mixed.step(lpmm_optim::Step::given(&mut given)).unwrap();
        assert_eq!(r1, r2, "step {step}");
        same(&acc, &mixed, &format!("step {step}"));
    }
}

/// Bad lent buffers (none, one for a parameter lpmm holds, the same parameter twice, the wrong
/// size or dtype) are typed errors before anything moves: every slot keeps its bits, the
/// gradients stay pending, and the step with the right buffer then equals one that never failed.
#[test]
fn bad_lent_buffers_are_refused_before_anything_moves() {
    use lpmm_optim::backend::HostValuesMut;
    use lpmm_optim::{Accumulated, Lent, OptimError, Step};
    let config = presets::adamw_8bit(1e-3);
    let n = 5000;
    let mut rng = Rng::new(6);
    let init = rng.spread(n, 0.5);
    let grads = [rng.spread(n, 1.0), rng.spread(n, 1.0)];
    // `tried` sees every bad step first; `clean` never does.
    let build = |buf: &[f32]| {
        let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
        opt.add_group(config).unwrap();
        let h = opt.add_param("held", &[n], &init, 0).unwrap();
        let l = opt
            .add_lent_param("lent", &[n], HostValues::F32(buf), 0, config)
            .unwrap();
        opt.accumulate(h, &grads[0]).unwrap();
        opt.accumulate(l, &grads[1]).unwrap();
        (opt, h, l)
    };
    let mut buf = init.clone();
    let mut clean_buf = init.clone();
    let (mut tried, h, l) = build(&buf);
    let (mut clean, ..) = build(&clean_buf);
    let slots = |opt: &Optimizer, buf: &[f32]| {
        let mut all = Vec::new();
        for slot in [SlotKind::Grad, SlotKind::State1, SlotKind::State2] {
            all.push(Parts::of(opt).export_slot(h, slot, None).unwrap());
            all.push(Parts::of(opt).export_slot(l, slot, None).unwrap());
        }
        all.push(
            Parts::of(opt)
                .export_slot(h, SlotKind::Param, None)
                .unwrap(),
        );
        all.push(
            Parts::of(opt)
                .export_slot(l, SlotKind::Param, Some(HostValues::F32(buf)))
                .unwrap(),
        );
        all
    };
    let before = slots(&tried, &buf);
    let mut other = init.clone();
    let mut short = vec![0f32; n - 1];
    let mut b16 = vec![lpmm_formats::bf16::from_f32(0.0); n];
    let (first, second) = buf.split_at_mut(n / 2);
    let refusals = [
        tried.step(Accumulated).unwrap_err(),
        tried
            .step(
                Step::accumulated().lent(Lent::Buffers(&mut [(h, HostValuesMut::F32(&mut other))])),
            )
            .unwrap_err(),
        tried
            .step(Step::accumulated().lent(Lent::Buffers(&mut [
                (l, HostValuesMut::F32(first)),
                (l, HostValuesMut::F32(second)),
            ])))
            .unwrap_err(),
        tried
            .step(
                Step::accumulated().lent(Lent::Buffers(&mut [(l, HostValuesMut::F32(&mut short))])),
            )
            .unwrap_err(),
        tried
            .step(
                Step::accumulated().lent(Lent::Buffers(&mut [(l, HostValuesMut::Bf16(&mut b16))])),
            )
            .unwrap_err(),
        tried.step(Step::param(l, &grads[0])).unwrap_err(),
    ];
    for e in &refusals {
        assert!(matches!(e, OptimError::Lent { .. }), "{e}");
    }
    assert_eq!(slots(&tried, &buf), before, "nothing moved");
    assert_eq!(tried.status().steps, 0);
    let r1 = tried
        .step(Step::accumulated().lent(Lent::Buffers(&mut [(l, HostValuesMut::F32(&mut buf))])))
        .unwrap();
    let r2 = clean
        .step(Step::accumulated().lent(Lent::Buffers(&mut [(
            l,
            HostValuesMut::F32(&mut clean_buf),
        )])))
        .unwrap();
    assert_eq!(r1.updated, 2);
    assert_eq!(r1, r2);
    assert_eq!(slots(&tried, &buf), slots(&clean, &clean_buf));
}

/// A [`Lender`] lends the buffers of a step one at a time: one that hands out a short buffer for
/// the *second* lent parameter must be refused before the first moves (a retry with good buffers
/// then gives one clean step's bits, not two steps of the first parameter).
#[test]
fn a_lender_with_a_short_second_buffer_moves_nothing() {
    use lpmm_optim::backend::HostValuesMut;
    use lpmm_optim::{Accumulated, Lender, Lent, OptimError, Step};

    /// Lends `buffers[id]`; for `short`, only its first `n - 1` values.
    struct Shorting<'a> {
        buffers: &'a mut [Vec<f32>],
        short: Option<usize>,
    }
    impl Lender<lpmm_optim::Cpu> for Shorting<'_> {
        fn lend(
            &mut self,
            id: ParamId,
            f: &mut dyn FnMut(HostValues<'_>) -> Result<(), OptimError>,
        ) -> Result<(), OptimError> {
            let b = &self.buffers[id.index()];
            let n = if self.short == Some(id.index()) {
                b.len() - 1
            } else {
                b.len()
            };
            f(HostValues::F32(&b[..n]))
        }
        fn lend_mut(
            &mut self,
            id: ParamId,
            f: &mut dyn FnMut(HostValuesMut<'_>) -> Result<(), OptimError>,
        ) -> Result<(), OptimError> {
            let b = &mut self.buffers[id.index()];
            let n = if self.short == Some(id.index()) {
                b.len() - 1
            } else {
                b.len()
            };
            f(HostValuesMut::F32(&mut b[..n]))
        }
    }

    let config = presets::adamw_8bit(1e-3);
    let n = 5000;
    let mut rng = Rng::new(7);
    let init = [rng.spread(n, 0.5), rng.spread(n, 0.5)];
    let grads = [rng.spread(n, 1.0), rng.spread(n, 1.0)];
    let build = |bufs: &[Vec<f32>]| {
        let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
        opt.add_group(config).unwrap();
        let ids: Vec<ParamId> = ["a", "b"]
            .iter()
            .zip(bufs)
            .map(|(name, b)| {
                opt.add_lent_param(name, &[n], HostValues::F32(b), 0, config)
                    .unwrap()
            })
            .collect();
        for (id, g) in ids.iter().zip(&grads) {
            opt.accumulate(*id, g).unwrap();
        }
        (opt, ids)
    };
    let mut tried_bufs = init.to_vec();
    let mut clean_bufs = init.to_vec();
    let (mut tried, ids) = build(&tried_bufs);
    let (mut clean, _) = build(&clean_bufs);
    let slots = |opt: &Optimizer, bufs: &[Vec<f32>]| {
        let mut all = Vec::new();
        for (&id, b) in ids.iter().zip(bufs) {
            for slot in SlotKind::ALL {
                let lent = (slot == SlotKind::Param).then(|| HostValues::F32(b));
                all.push(Parts::of(opt).export_slot(id, slot, lent).unwrap());
            }
        }
        all
    };
    let before = slots(&tried, &tried_bufs);
    let e = tried
        .step(Step::accumulated().lent(Lent::Lender(&mut Shorting {
            buffers: &mut tried_bufs,
            short: Some(ids[1].index()),
        })))
        .unwrap_err();
    assert!(matches!(e, OptimError::Lent { .. }), "{e}");
    assert_eq!(slots(&tried, &tried_bufs), before, "nothing moved");
    assert!(
        tried.param(ids[0]).unwrap().received_gradient,
        "still pending"
    );
    assert_eq!(tried.param(ids[0]).unwrap().steps, 0);
    // The retry and a clean optimizer's one step: the same bits.
    let mut good = Shorting {
        buffers: &mut tried_bufs,
        short: None,
    };
    tried
        .step(Step::accumulated().lent(Lent::Lender(&mut good)))
        .unwrap();
    let mut good = Shorting {
        buffers: &mut clean_bufs,
        short: None,
    };
    clean
        .step(Step::from(Accumulated).lent(Lent::Lender(&mut good)))
        .unwrap();
    assert_eq!(slots(&tried, &tried_bufs), slots(&clean, &clean_bufs));
    assert_eq!(tried_bufs, clean_bufs);
}
