//! Step plans: each parameter's configuration compiled once, when it is registered, into what
//! its step does — the tensor-wide phases before the fused pass (folds, sums, combine), the
//! swaps after it, and the kernel that runs the fused pass — and the one schedule every backend
//! executes them by ([`run_step`]).
//!
//! A plan is data: the CPU backend reads its kernel (a specialized single-pass kernel for the
//! hot configurations, the generic element-wise path for the others), and the step executor
//! ([`crate::exec`]) runs its phases through [`run_step`] on every backend's primitives, so the
//! order of the phases is written here once.
//!
//! A rule with a matrix phase (Muon: [`NewtonSchulz`]) steps each of its parameters on its own
//! after the tensor-wide phases: the rule's matrix input gathered into a workspace, the
//! products of [`newton_schulz`] on it, then that parameter's fused pass reading the result;
//! the workspace holds one parameter's matrices at a time.

use crate::backend::{FoldInput, ParamLayout, SlotKind, StepFlags};
use crate::format::Format;
use crate::rule::{NewtonSchulz, RuleConsts};

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
    /// Whether the rule takes a matrix phase ([`RuleConsts::newton_schulz`]).
    matrix: bool,
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
        let matrix = rule.newton_schulz().is_some();
        StepPlan {
            key,
            passes: [
                slot_passes(SlotKind::State2),
                if rule.stats() > 0 { STATS_PASSES } else { 0 },
                slot_passes(SlotKind::State3),
            ],
            swaps: [swap(SlotKind::State2), swap(SlotKind::State3)],
            // The specialized kernels read no matrix phase's result.
            specialized: !matrix,
            matrix,
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
    /// (`false` after [`StepPlan::generic`], and for a rule with a matrix phase).
    pub fn specialized(&self) -> bool {
        self.specialized
    }

    /// Whether the rule takes a matrix phase at all (the parameter must be a matrix, and a
    /// backend must offer the phase's workspace: [`crate::backend::Backend::matrices`]).
    pub fn has_matrix(&self) -> bool {
        self.matrix
    }

    /// Whether a step with `flags` takes the matrix phase: the rule has one and the step moves
    /// the parameter (optimizer accumulation only updates the states; a transform takes none).
    pub fn matrix(&self, flags: StepFlags) -> bool {
        self.matrix && flags.has(StepFlags::UPDATE_PARAM) && !flags.has(StepFlags::TRANSFORM)
    }
}

/// The shape of a matrix phase: a parameter of `rows × cols` elements (row-major). The phase
/// computes on its *wide* view, `m × n` with `m = min(rows, cols) <= n`: the matrix itself, or
/// its transpose when it has more rows than columns (torch's `Muon` transposes the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixShape {
    /// The parameter's rows.
    pub rows: usize,
    /// The parameter's columns.
    pub cols: usize,
}

impl MatrixShape {
    /// The shape of a parameter of `shape`, if it is a matrix (two dimensions).
    pub fn of(shape: &[usize]) -> Option<MatrixShape> {
        match *shape {
            [rows, cols] => Some(MatrixShape { rows, cols }),
            _ => None,
        }
    }

    /// Whether the wide view is the transpose (more rows than columns).
    pub fn transposed(&self) -> bool {
        self.rows > self.cols
    }

    /// The wide view's rows, `min(rows, cols)`.
    pub fn m(&self) -> usize {
        self.rows.min(self.cols)
    }

    /// The wide view's columns, `max(rows, cols)`.
    pub fn n(&self) -> usize {
        self.rows.max(self.cols)
    }

    /// Elements of the parameter's matrix (and of [`Mat::Update`], [`Mat::Next`]).
    pub fn numel(&self) -> usize {
        self.rows * self.cols
    }

    /// Elements of the `m × m` matrices ([`Mat::Gram`], [`Mat::Poly`]).
    pub fn square(&self) -> usize {
        self.m() * self.m()
    }

    /// The dimensions (rows, columns) of `mat` as the phase's products see it.
    pub fn dims(&self, mat: Mat) -> (usize, usize) {
        match mat {
            Mat::Update | Mat::Next => (self.m(), self.n()),
            Mat::Gram | Mat::Poly => (self.m(), self.m()),
        }
    }
}

/// The matrices of a matrix phase's workspace, as the phase's products see them
/// ([`MatrixShape::dims`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mat {
    /// The iterate `X` (`m × n`): the rule's matrix input at first, the phase's result at the
    /// end.
    Update,
    /// The next iterate (`m × n`), which trades places with `Update` ([`MatrixOp::Swap`]).
    Next,
    /// `A = X Xᵀ` (`m × m`).
    Gram,
    /// `B = b A + c A A` (`m × m`).
    Poly,
}

/// One operation of a matrix phase on its workspace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MatrixOp {
    /// `out = alpha · lhs · rhs` (`rhs` transposed with `rhs_transposed`), plus `beta · add` for
    /// `add = Some((add, beta))`; `out` is neither `lhs` nor `rhs`.
    Product {
        /// Where the result goes.
        out: Mat,
        /// The left factor.
        lhs: Mat,
        /// The right factor.
        rhs: Mat,
        /// Whether the right factor is transposed.
        rhs_transposed: bool,
        /// The product's coefficient.
        alpha: f32,
        /// A matrix added with its coefficient.
        add: Option<(Mat, f32)>,
    },
    /// `Update` and `Next` trade places.
    Swap,
}

/// The operations of `ns.steps` Newton–Schulz iterations on [`Mat::Update`] (torch's
/// `_zeropower_via_newtonschulz` after its normalisation): for each, `Gram = Update Updateᵀ`,
/// `Poly = b Gram + c Gram Gram`, `Next = a Update + Poly Update`, then `Update` and `Next`
/// trade places.
pub fn newton_schulz(ns: NewtonSchulz) -> impl Iterator<Item = MatrixOp> {
    let iteration = [
        MatrixOp::Product {
            out: Mat::Gram,
            lhs: Mat::Update,
            rhs: Mat::Update,
            rhs_transposed: true,
            alpha: 1.0,
            add: None,
        },
        MatrixOp::Product {
            out: Mat::Poly,
            lhs: Mat::Gram,
            rhs: Mat::Gram,
            rhs_transposed: false,
            alpha: ns.c,
            add: Some((Mat::Gram, ns.b)),
        },
        MatrixOp::Product {
            out: Mat::Next,
            lhs: Mat::Poly,
            rhs: Mat::Update,
            rhs_transposed: false,
            alpha: 1.0,
            add: Some((Mat::Update, ns.a)),
        },
        MatrixOp::Swap,
    ];
    (0..ns.steps).flat_map(move |_| iteration)
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
    /// The next parameter (in index order) whose step takes the matrix phase
    /// ([`StepPlan::matrix`]) and has not taken it: its matrix input gathered into the workspace,
    /// and the iterations to run on it; `None` when no parameter is left.
    fn begin_matrix(&mut self) -> Result<Option<NewtonSchulz>, Self::Error>;
    /// One operation on the workspace of the parameter [`PlanRunner::begin_matrix`] began.
    fn matrix_op(&mut self, op: MatrixOp) -> Result<(), Self::Error>;
    /// The fused pass of the parameter [`PlanRunner::begin_matrix`] began, reading the phase's
    /// result.
    fn end_matrix(&mut self) -> Result<(), Self::Error>;
    /// The fused pass of every parameter that took no matrix phase.
    fn fused(&mut self) -> Result<(), Self::Error>;
    /// The swaps after the fused pass ([`StepPlan::swaps`]) of every parameter.
    fn swap(&mut self) -> Result<(), Self::Error>;
}

/// The schedule of a step: each tensor-wide phase of [`Phase::ORDER`] that some plan takes —
/// zero its targets, its fold passes, its combine —, then the matrix phase of each parameter
/// that takes one, parameter by parameter — its input, the Newton–Schulz products
/// ([`newton_schulz`]), its fused pass —, then the fused pass of the others, then the swaps.
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
    while let Some(ns) = runner.begin_matrix()? {
        for op in newton_schulz(ns) {
            runner.matrix_op(op)?;
        }
        runner.end_matrix()?;
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

    /// A runner that records the calls (`.2`: the parameters left for the matrix phase).
    struct Record(Vec<String>, [usize; 3], usize);

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
        fn begin_matrix(&mut self) -> Result<Option<NewtonSchulz>, ()> {
            if self.2 == 0 {
                return Ok(None);
            }
            self.2 -= 1;
            self.0.push("begin matrix".into());
            Ok(Some(NewtonSchulz {
                a: 3.0,
                b: -4.0,
                c: 2.0,
                steps: 2,
            }))
        }
        fn matrix_op(&mut self, op: MatrixOp) -> Result<(), ()> {
            self.0.push(match op {
                MatrixOp::Product { out, .. } => format!("{out:?}"),
                MatrixOp::Swap => "swap X".into(),
            });
            Ok(())
        }
        fn end_matrix(&mut self) -> Result<(), ()> {
            self.0.push("end matrix".into());
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
        let mut r = Record(Vec::new(), [1, 2, 0], 0);
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

    #[test]
    fn the_matrix_phase_runs_parameter_by_parameter_before_the_others_fused_pass() {
        let mut r = Record(Vec::new(), [0, 2, 0], 2);
        run_step(&mut r).unwrap();
        let iteration = ["Gram", "Poly", "Next", "swap X"];
        let mut want = vec![
            "begin Stats",
            "fold Stats 0",
            "fold Stats 1",
            "combine Stats",
        ];
        for _ in 0..2 {
            want.push("begin matrix");
            want.extend(iteration);
            want.extend(iteration);
            want.push("end matrix");
        }
        want.extend(["fused", "swap"]);
        assert_eq!(r.0, want);
    }

    #[test]
    fn a_matrix_rule_plans_the_phase_only_when_the_parameter_moves() {
        let muon = plan_of(presets::muon_8bit(0.02).build(), &[64, 96]);
        assert!(muon.has_matrix() && !muon.specialized());
        assert!(muon.matrix(StepFlags(StepFlags::UPDATE_PARAM)));
        assert!(!muon.matrix(StepFlags(0)));
        assert!(!muon.matrix(StepFlags(StepFlags::UPDATE_PARAM | StepFlags::TRANSFORM)));
        let adam = plan_of(presets::adamw_8bit(1e-3).build(), &[64, 96]);
        assert!(!adam.has_matrix() && !adam.matrix(StepFlags(StepFlags::UPDATE_PARAM)));
    }

    #[test]
    fn the_wide_view_is_the_transpose_of_a_tall_matrix() {
        let tall = MatrixShape::of(&[96, 64]).unwrap();
        assert!(tall.transposed());
        assert_eq!((tall.m(), tall.n()), (64, 96));
        assert_eq!(tall.dims(Mat::Update), (64, 96));
        assert_eq!(tall.dims(Mat::Gram), (64, 64));
        let wide = MatrixShape::of(&[64, 96]).unwrap();
        assert!(!wide.transposed());
        assert_eq!(MatrixShape::of(&[4096]), None);
        assert_eq!(MatrixShape::of(&[2, 3, 4]), None);
    }
}
