//! Gradient coverage: every step reports the parameters that expect a gradient and received
//! none, through each entry point; `MissingGradientPolicy::Error` refuses such a step with
//! nothing changed; the check never changes a stepped bit.

use lpmm_optim::backend::HostValues;
use lpmm_optim::testing::Rng;
use lpmm_optim::{Checkpoint, Cpu, Parts, PartsMut, checkpoint::Canonical};
use lpmm_optim::{
    Gradients, MissingGradientPolicy, OptimError, Optimizer, OptimizerOptions, ParamId, SlotKind,
    StepReport, presets,
};

const N: usize = 5000;
const NAMES: [&str; 4] = ["a", "b", "c", "frozen"];

/// Four parameters with 8-bit states and stochastically rounded bf16 values (so a step that
/// moved would show in the bits); `frozen` is excluded from the check.
fn optimizer(policy: MissingGradientPolicy) -> (Optimizer, Vec<ParamId>) {
    let mut opt = Optimizer::new(OptimizerOptions::default().with_seed(11)).unwrap();
    let mut preset = presets::adamw_8bit_bf16_sr(1e-2).build();
    preset.grad = lpmm_optim::Storage::F32;
    opt.add_group(preset).unwrap();
    let mut rng = Rng::new(3);
    let ids: Vec<ParamId> = NAMES
        .iter()
        .map(|n| opt.add_param(n, &[N], &rng.spread(N, 0.5), 0).unwrap())
        .collect();
    opt.set_expects_gradient(ids[3], false).unwrap();
    opt.settings_mut().missing_gradient = policy;
    (opt, ids)
}

fn grad(k: usize, step: usize) -> Vec<f32> {
    Rng::new(100 + (k * 31 + step) as u64).spread(N, 1e-2)
}

/// Host gradients that record which were consumed.
struct Grads {
    grads: Vec<Vec<f32>>,
    consumed: Vec<ParamId>,
}

impl Grads {
    /// Gradients for the parameters `with` (indices into `NAMES`).
    fn new(with: &[usize], step: usize) -> Self {
        Grads {
            grads: (0..NAMES.len())
                .map(|k| {
                    if with.contains(&k) {
                        grad(k, step)
                    } else {
                        Vec::new()
                    }
                })
                .collect(),
            consumed: Vec::new(),
        }
    }
}

impl Gradients<lpmm_optim::Cpu> for Grads {
    fn gradient(
        &mut self,
        id: ParamId,
        f: &mut lpmm_optim::WithGradient<'_, lpmm_optim::Cpu>,
    ) -> Result<(), OptimError> {
        match self.grads.get(id.index()) {
            Some(g) if !g.is_empty() => f(Some(HostValues::F32(g))),
            _ => f(None),
        }
    }

    fn consumed(&mut self, id: ParamId) {
        self.consumed.push(id);
    }
}

/// Every slot of every parameter, and the counters: what "nothing changed" compares.
fn everything(opt: &Optimizer, ids: &[ParamId]) -> Vec<String> {
    let mut out = vec![format!("steps {}", opt.status().steps)];
    for &id in ids {
        for slot in SlotKind::ALL {
            out.push(format!(
                "{:?}",
                Parts::of(opt).export_slot(id, slot, None).unwrap()
            ));
        }
        out.push(format!(
            "received {}",
            opt.param(id).map(|p| p.received_gradient).unwrap()
        ));
    }
    out
}

/// How a test drives one step: which parameters get a gradient, and how.
#[derive(Debug, Clone, Copy)]
enum Entry {
    /// `accumulate` then `step`.
    Step,
    /// `accumulate` then `step` with a lender (no parameter here is lent).
    Lender,
    /// `accumulate`, `gradient_summary` then `Step::summarized` (lpmm-dist's path).
    Summary,
    /// `Step::given` with the gradients given.
    Given,
    /// `Step::given`: the first accumulated, the others given.
    Mixed,
}

const ENTRIES: [Entry; 5] = [
    Entry::Step,
    Entry::Lender,
    Entry::Summary,
    Entry::Given,
    Entry::Mixed,
];

/// The gradients of step `t` for `with` (indices into `NAMES`) that `entry` takes from
/// accumulators, accumulated; returns those it is given at the step.
fn prepare(opt: &mut Optimizer, ids: &[ParamId], entry: Entry, with: &[usize], t: usize) -> Grads {
    let accumulated: &[usize] = match entry {
        Entry::Given => &[],
        Entry::Mixed => &with[..1.min(with.len())],
        _ => with,
    };
    for &k in accumulated {
        opt.accumulate(ids[k], &grad(k, t)).unwrap();
    }
    let given: Vec<usize> = with
        .iter()
        .filter(|k| !accumulated.contains(k))
        .copied()
        .collect();
    Grads::new(&given, t)
}

/// The step itself, through `entry`.
fn run(opt: &mut Optimizer, entry: Entry, grads: &mut Grads) -> Result<StepReport, OptimError> {
    match entry {
        Entry::Step => opt.step(lpmm_optim::Accumulated),
        Entry::Lender => {
            let mut buffers: Vec<Vec<f32>> = Vec::new();
            opt.step(lpmm_optim::Step::accumulated().lent(lpmm_optim::Lent::Lender(&mut buffers)))
        }
        Entry::Summary => {
            let s = PartsMut::of(opt).gradient_summary()?;
            let any = !s.non_finite.is_empty();
            opt.step(lpmm_optim::Step::summarized(
                Some((s.sum, any)),
                s.non_finite,
            ))
        }
        Entry::Given | Entry::Mixed => opt.step(lpmm_optim::Step::given(grads)),
    }
}

/// One step through `entry` with gradients for `with`.
fn step(
    opt: &mut Optimizer,
    ids: &[ParamId],
    entry: Entry,
    with: &[usize],
    t: usize,
) -> Result<StepReport, OptimError> {
    let mut grads = prepare(opt, ids, entry, with, t);
    run(opt, entry, &mut grads)
}

#[test]
fn every_entry_point_reports_the_parameters_without_a_gradient() {
    for entry in ENTRIES {
        let (mut opt, ids) = optimizer(MissingGradientPolicy::Ignore);
        // `c` has none; `frozen` has none and is excluded.
        let r = step(&mut opt, &ids, entry, &[0, 1], 0).unwrap();
        assert_eq!(r.updated, 2, "{entry:?}");
        let m = &r.missing_gradients;
        assert_eq!(
            (m.count, m.checked, &m.names[..]),
            (1, 3, &["c".to_string()][..]),
            "{entry:?}"
        );
        // Everything: nothing missing, and a gradient for the excluded one steps it.
        let r = step(&mut opt, &ids, entry, &[0, 1, 2, 3], 1).unwrap();
        assert_eq!(r.updated, 4, "{entry:?}");
        assert!(r.missing_gradients.is_empty(), "{entry:?}: {r:?}");
        assert_eq!(r.missing_gradients.checked, 3);
        // A released step is not a check, and covers its parameter in the next step (once).
        let released = opt
            .step(lpmm_optim::Step::param(ids[2], &grad(2, 2)))
            .unwrap();
        assert_eq!(released.missing_gradients.checked, 0);
        let r = step(&mut opt, &ids, entry, &[0, 1], 2).unwrap();
        assert!(r.missing_gradients.is_empty(), "{entry:?}: {r:?}");
        let r = step(&mut opt, &ids, entry, &[0, 1], 3).unwrap();
        assert_eq!(r.missing_gradients.names, ["c"], "{entry:?}");
        // No gradient at all: all three named.
        let r = step(&mut opt, &ids, entry, &[], 4).unwrap();
        assert_eq!(r.missing_gradients.names, ["a", "b", "c"], "{entry:?}");
    }
}

#[test]
fn the_error_policy_refuses_the_step_naming_them_and_changes_nothing() {
    for entry in ENTRIES {
        let (mut opt, ids) = optimizer(MissingGradientPolicy::Error);
        // A first full step, so that states and counters are not all zero.
        step(&mut opt, &ids, entry, &[0, 1, 2], 0).unwrap();
        // `c` has no gradient in the second.
        let mut grads = prepare(&mut opt, &ids, entry, &[0, 1], 1);
        let before = everything(&opt, &ids);
        let e = run(&mut opt, entry, &mut grads).unwrap_err();
        assert_eq!(
            everything(&opt, &ids),
            before,
            "{entry:?}: something changed"
        );
        assert!(
            grads.consumed.is_empty(),
            "{entry:?}: a gradient was consumed"
        );
        let OptimError::MissingGradient {
            step: t,
            count,
            checked,
            names,
            ..
        } = &e
        else {
            panic!("{entry:?}: {e}")
        };
        assert_eq!(
            (*t, *count, *checked, &names[..]),
            (2, 1, 3, &["c".to_string()][..])
        );
        let message = e.to_string();
        assert!(
            message.contains("1 of 3 parameters received no gradient: c")
                && message.contains("nothing changed")
                && message.contains("set_expects_gradient"),
            "{message}"
        );
        // With `c`'s gradient too, the step goes ahead with the bits of a step never refused.
        let mut more = prepare(&mut opt, &ids, entry, &[2], 1);
        grads.grads[2] = std::mem::take(&mut more.grads[2]);
        let r1 = run(&mut opt, entry, &mut grads).unwrap();
        let (mut reference, ids2) = optimizer(MissingGradientPolicy::Error);
        step(&mut reference, &ids2, entry, &[0, 1, 2], 0).unwrap();
        let r2 = step(&mut reference, &ids2, entry, &[0, 1, 2], 1).unwrap();
        assert_eq!(r1, r2, "{entry:?}");
        assert_eq!(
            everything(&opt, &ids),
            everything(&reference, &ids2),
            "{entry:?}"
        );
    }
}

#[test]
fn the_check_changes_no_stepped_bit() {
    // The same partial steps under each policy that lets them through give the same bits.
    let run = |policy| {
        let (mut opt, ids) = optimizer(policy);
        for t in 0..4 {
            let with: &[usize] = if t % 2 == 0 { &[0, 1] } else { &[0, 2, 3] };
            step(&mut opt, &ids, Entry::Step, with, t).unwrap();
        }
        everything(&opt, &ids)
    };
    assert_eq!(
        run(MissingGradientPolicy::Ignore),
        run(MissingGradientPolicy::Warn)
    );
}

#[test]
fn a_load_keeps_the_policy_and_the_exclusions() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-coverage-");
    let path = tmp.path().join("c.safetensors");
    let (mut opt, ids) = optimizer(MissingGradientPolicy::Error);
    step(&mut opt, &ids, Entry::Step, &[0, 1, 2], 0).unwrap();
    opt.save(&path, Checkpoint::new()).unwrap();
    opt.load(&path, Checkpoint::new()).unwrap();
    assert_eq!(
        opt.status().settings.missing_gradient,
        MissingGradientPolicy::Error
    );
    assert!(!opt.param(ids[3]).map(|p| p.expects_gradient).unwrap());
    assert!(step(&mut opt, &ids, Entry::Step, &[0, 1], 1).is_err());
    // A fresh optimizer from the file has the defaults.
    let loaded = Canonical::read(&path)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
    assert_eq!(
        loaded.status().settings.missing_gradient,
        MissingGradientPolicy::Warn
    );
    assert!(loaded.param(ids[3]).map(|p| p.expects_gradient).unwrap());
}
