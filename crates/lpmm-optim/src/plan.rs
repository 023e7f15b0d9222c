//! Step plans: each parameter's configuration compiled once, when it is registered, into what
//! its step does — the tensor-wide phases before the fused pass (folds, sums, combine), the
//! swaps after it, and the kernel that runs the fused pass — and the one schedule every backend
//! executes them by ([`run_step`]).
//!
//! A plan is data: the CPU backend reads its kernel (a specialized single-pass kernel for the
//! hot configurations, the generic element-wise path for the others), and the step executor
//! ([`crate::exec`]) runs its phases through [`run_step`] on every backend's primitives, so the
//! order of the phases is written here once.

use crate::backend::{FoldInput, ParamLayout, SlotKind, StepFlags};
use crate::format::Format;
use crate::rule::RuleConsts;

/// A tensor-wide phase of a step: folds over the whole tensor, then a combine on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A state slot's tensor-wide statistics ([`Format::folds`]; a factorized state's row and
    /// column sums), combined by its format ([`Format::combine`]).
    Slot(SlotKind),
    /// The rule's tensor-wide sums of squares ([`RuleConsts::stats`]: two passes, the largest
    /// exponents then the sums), combined into its constants ([`RuleConsts::combine_stats`]).
    Stats,
}

impl Phase {
    /// The phases in the order a step runs them: a state 2's statistics (the rule's sums may
    /// read the second moment they give), the rule's sums, a state 3's statistics (CAME's
    /// instability reads the update the sums clip).
    pub const ORDER: [Phase; 3] = [
        Phase::Slot(SlotKind::State2),
        Phase::Stats,
        Phase::Slot(SlotKind::State3),
    ];

    fn index(self) -> usize {
        match self {
            Phase::Slot(SlotKind::State2) => 0,
            Phase::Stats => 1,
            _ => 2,
        }
    }
}

/// Fold passes of the rule's sums: the largest exponent of each sum, then the sums themselves
/// ([docs/FORMATS.md] §11).
///
/// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
pub const STATS_PASSES: usize = 2;

/// What a kernel is specialized for: the update rule and each slot's format.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanKey {
    /// The rule's id in the kernels ([`RuleConsts::kernel_id`]).
    pub rule: u32,
    /// Each slot's format (`None`: not allocated).
    pub formats: [Option<Format>; crate::backend::SLOTS],
}

/// One parameter's step, compiled from its layout and update rule ([`StepPlan::new`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPlan {
    key: PlanKey,
    /// The fold passes of each phase of [`Phase::ORDER`] (0: the phase does not run).
    passes: [usize; 3],
    /// Tensor-wide regions of states 2 and 3 that trade places after the fused pass.
    swaps: [Option<(usize, usize)>; 2],
    /// Whether a backend runs the fused pass with a kernel specialized for the key where it has
    /// one (`false`: the generic element-wise path everywhere).
    specialized: bool,
}

impl StepPlan {
    /// The plan of a parameter of `layout` stepped by `rule` (any step's constants: what the
    /// plan depends on — the rule, how many sums it takes — is fixed by the configuration).
    pub fn new(layout: &ParamLayout, rule: &RuleConsts) -> StepPlan {
        let key = PlanKey {
            rule: rule.kernel_id(),
            formats: layout.formats,
        };
        let slot_passes = |slot: SlotKind| layout.format(slot).map_or(0, |f| f.folds().len());
        let swap = |slot: SlotKind| layout.format(slot).and_then(|f| f.swap_after_step());
        StepPlan {
            key,
            passes: [
                slot_passes(SlotKind::State2),
                if rule.stats() > 0 { STATS_PASSES } else { 0 },
                slot_passes(SlotKind::State3),
            ],
            swaps: [swap(SlotKind::State2), swap(SlotKind::State3)],
            specialized: true,
        }
    }

    /// The same plan with the fused pass on the generic element-wise path everywhere (the
    /// reference the specialized kernels are tested against: the same bits, slower).
    pub fn generic(self) -> StepPlan {
        StepPlan {
            specialized: false,
            ..self
        }
    }

    /// What the plan's kernels are specialized for.
    pub fn key(&self) -> PlanKey {
        self.key
    }

    /// The fold passes `phase` takes in a step with `flags` (0: it does not run; no phase runs
    /// under [`StepFlags::TRANSFORM`], which only moves the parameter).
    pub fn passes(&self, phase: Phase, flags: StepFlags) -> usize {
        if flags.has(StepFlags::TRANSFORM) {
            0
        } else {
            self.passes[phase.index()]
        }
    }

    /// What fold pass `pass` of a slot phase folds, element by element.
    pub fn fold_input(&self, phase: Phase, pass: usize) -> Option<FoldInput> {
        match phase {
            Phase::Slot(slot) => {
                self.key.formats[slot as usize].and_then(|f| f.folds().get(pass).copied())
            }
            Phase::Stats => None,
        }
    }

    /// The tensor-wide regions of a state that trade places after a step with `flags` (slot,
    /// and the indices of the two regions among the slot's tensor-wide ones).
    pub fn swaps(&self, flags: StepFlags) -> impl Iterator<Item = (SlotKind, usize, usize)> + '_ {
        let on = !flags.has(StepFlags::TRANSFORM);
        [SlotKind::State2, SlotKind::State3]
            .into_iter()
            .zip(self.swaps)
            .filter_map(move |(slot, s)| s.filter(|_| on).map(|(a, b)| (slot, a, b)))
    }

    /// Whether a backend may run the fused pass with a kernel specialized for [`StepPlan::key`]
    /// (`false` after [`StepPlan::generic`]).
    pub fn specialized(&self) -> bool {
        self.specialized
    }
}

/// What runs the plans of one step's parameters: one parameter (the CPU backend runs each
/// parameter's step on its own) or all of them (a device backend batches a phase's fold pass of
/// every parameter into one launch). [`run_step`] calls it in the plans' order.
pub trait PlanRunner {
    /// What a failed operation returns.
    type Error;
    /// The most fold passes `phase` takes among the runner's parameters this step (0: skip it).
    fn passes(&self, phase: Phase) -> usize;
    /// Zeroes what `phase` folds into, for each parameter it runs for.
    fn begin(&mut self, phase: Phase) -> Result<(), Self::Error>;
    /// Fold pass `pass` of `phase`, for each parameter whose plan takes more than `pass` passes.
    fn fold(&mut self, phase: Phase, pass: usize) -> Result<(), Self::Error>;
    /// The host combine of `phase` for each parameter it ran for.
    fn combine(&mut self, phase: Phase) -> Result<(), Self::Error>;
    /// The fused pass of every parameter.
    fn fused(&mut self) -> Result<(), Self::Error>;
    /// The swaps after the fused pass ([`StepPlan::swaps`]) of every parameter.
    fn swap(&mut self) -> Result<(), Self::Error>;
}

/// The schedule of a step: each tensor-wide phase of [`Phase::ORDER`] that some plan takes —
/// zero its targets, its fold passes, its combine — then the fused pass, then the swaps.
pub fn run_step<R: PlanRunner>(runner: &mut R) -> Result<(), R::Error> {
    for phase in Phase::ORDER {
        let passes = runner.passes(phase);
        if passes == 0 {
            continue;
        }
        runner.begin(phase)?;
        for pass in 0..passes {
            runner.fold(phase, pass)?;
        }
        runner.combine(phase)?;
    }
    runner.fused()?;
    runner.swap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;
    use crate::rule::RuleState;

    fn plan_of(config: crate::ParamConfig, shape: &[usize]) -> StepPlan {
        let resolved = config.resolve(shape.iter().product(), shape);
        let layout = ParamLayout {
            shape: shape.to_vec(),
            numel: shape.iter().product(),
            formats: resolved.formats(),
            stream: 0,
            offset: 0,
            lent: false,
        };
        StepPlan::new(&layout, &resolved.hyper.consts(1, &RuleState::default()))
    }

    #[test]
    fn phases_follow_the_formats_and_the_rule() {
        let adam = plan_of(presets::adamw_8bit(1e-3).build(), &[4096]);
        for phase in Phase::ORDER {
            assert_eq!(adam.passes(phase, StepFlags(StepFlags::UPDATE_PARAM)), 0);
        }
        let came = plan_of(presets::came_f32(1e-3).build(), &[64, 64]);
        let flags = StepFlags(StepFlags::UPDATE_PARAM);
        assert!(came.passes(Phase::Slot(SlotKind::State2), flags) > 0);
        assert_eq!(came.passes(Phase::Stats, flags), STATS_PASSES);
        assert!(came.passes(Phase::Slot(SlotKind::State3), flags) > 0);
        let transform = StepFlags(StepFlags::TRANSFORM);
        assert!(Phase::ORDER.iter().all(|&p| came.passes(p, transform) == 0));
    }

    /// A runner that records the calls.
    struct Record(Vec<String>, [usize; 3]);

    impl PlanRunner for Record {
        type Error = ();
        fn passes(&self, phase: Phase) -> usize {
            self.1[phase.index()]
        }
        fn begin(&mut self, phase: Phase) -> Result<(), ()> {
            self.0.push(format!("begin {phase:?}"));
            Ok(())
        }
        fn fold(&mut self, phase: Phase, pass: usize) -> Result<(), ()> {
            self.0.push(format!("fold {phase:?} {pass}"));
            Ok(())
        }
        fn combine(&mut self, phase: Phase) -> Result<(), ()> {
            self.0.push(format!("combine {phase:?}"));
            Ok(())
        }
        fn fused(&mut self) -> Result<(), ()> {
            self.0.push("fused".into());
            Ok(())
        }
        fn swap(&mut self) -> Result<(), ()> {
            self.0.push("swap".into());
            Ok(())
        }
    }

    #[test]
    fn the_schedule_runs_phases_in_order_then_the_fused_pass() {
        let mut r = Record(Vec::new(), [1, 2, 0]);
        run_step(&mut r).unwrap();
        assert_eq!(
            r.0,
            [
                "begin Slot(State2)",
                "fold Slot(State2) 0",
                "combine Slot(State2)",
                "begin Stats",
                "fold Stats 0",
                "fold Stats 1",
                "combine Stats",
                "fused",
                "swap"
            ]
        );
    }
}
