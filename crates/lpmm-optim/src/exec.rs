//! The step executor: how a step's plans run on a backend, written once for every backend.
//!
//! [`crate::plan::run_step`] gives the order of a step's phases; this module owns everything
//! else a step does between the optimizer's decisions and the backend's primitives:
//!
//! - **the lent-buffer checks**: every lent buffer a step needs — from [`Lent::Buffers`] or a
//!   [`Lender`] — is obtained and checked (known parameter, lent, once, its dtype and size)
//!   before anything moves ([`Lents::check`], [`Lents::obtain`]);
//! - **the batching**: the parameters lpmm holds run in one batch, lent ones in one batch from
//!   [`Lent::Buffers`] or one at a time inside a [`Lender`]'s callback ([`Batches::run`]);
//! - **the host combines**: the folds' results read back from the backend
//!   ([`Backend::folded`]) and combined on the host — a format's tensor-wide statistics
//!   ([`crate::backend::Format::combine`]), the rule's sums of squares into its constants
//!   ([`RuleConsts::combine_stats`]) — once, here;
//! - **the matrix phase**: the workspace ([`Backend::Matrices`], held by the optimizer) lent to
//!   each parameter that takes the phase in turn, its shape's constants combined
//!   ([`RuleConsts::combine_matrix`]), and those parameters kept out of the others' fused pass.
//!
//! A backend implements the primitives ([`Backend::prepare`], [`Backend::begin_phase`],
//! [`Backend::fold`], [`Backend::folded`], [`Backend::fused`], [`Backend::swap_wide`]; for the
//! matrix phase [`Backend::matrix_in`], [`Backend::matrix_op`], [`Backend::matrix_out`]) and
//! nothing of the schedule.
//!
//! [`RuleConsts::combine_stats`]: crate::rule::RuleConsts::combine_stats
//! [`RuleConsts::combine_matrix`]: crate::rule::RuleConsts::combine_matrix

use crate::backend::{
    Backend, BackendError, Dtype, Folded, MAX_STATS, MatrixOp, MatrixShape, NewtonSchulz, ParamId,
    ParamLayout, ParamStep, Phase, PlanRunner, SlotKind, StepWork, run_step,
};
use crate::error::OptimError;
use crate::fixed;
use crate::lent::{Lender, Lent};

/// The per-parameter scratch of the executor, sized at registration so a step allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// The plans of one backend call (a subset of the step's plans).
    batch: Vec<Option<ParamStep>>,
    /// Which parameters' batches completed in this step.
    pub done: Vec<bool>,
    /// Non-finite values met, per parameter, over the step's batches.
    pub non_finite: Vec<bool>,
    /// One batch's non-finite flags and kept statistics.
    call: Vec<bool>,
    kept: Vec<bool>,
    /// Which parameters ran the phase being combined.
    ran: Vec<bool>,
    /// Which parameters took the matrix phase in the batch, and the plans of the others' fused
    /// pass.
    matrixed: Vec<bool>,
    rest: Vec<Option<ParamStep>>,
}

impl Scratch {
    /// Room for one more parameter.
    pub fn push(&mut self) {
        self.batch.push(None);
        self.done.push(false);
        self.non_finite.push(false);
        self.call.push(false);
        self.kept.push(false);
        self.ran.push(false);
        self.matrixed.push(false);
        self.rest.push(None);
    }

    /// A new step: nothing done, nothing met.
    pub fn begin(&mut self) {
        self.done.iter_mut().for_each(|d| *d = false);
        self.non_finite.iter_mut().for_each(|f| *f = false);
    }
}

/// Names and layouts of the parameters, for the lent-buffer checks and their messages.
pub(crate) struct Lents<'a, F: Fn(usize) -> String> {
    /// A parameter's name (called only to build an error).
    pub name: F,
    pub layouts: &'a [ParamLayout],
}

impl<F: Fn(usize) -> String> Lents<'_, F> {
    fn unlent(&self, i: usize) -> OptimError {
        OptimError::Lent {
            param: (self.name)(i),
            reason: "it takes part but its buffer was not lent".into(),
        }
    }

    /// A lent parameter's buffer holds one value of its storage's dtype per element.
    fn check_buffer(&self, i: usize, dtype: Dtype, len: usize) -> Result<(), OptimError> {
        let layout = &self.layouts[i];
        let want = layout.format(SlotKind::Param).and_then(|f| f.lendable());
        if want == Some(dtype) && len == layout.numel {
            return Ok(());
        }
        Err(OptimError::Lent {
            param: (self.name)(i),
            reason: format!(
                "its buffer holds {len} {} values, {} {} expected",
                dtype.name(),
                layout.numel,
                want.map_or("?", |d| d.name())
            ),
        })
    }

    /// Buffers are for known, lent parameters, each at most once, of the parameter's dtype and
    /// size.
    pub fn check<B: Backend>(&self, backend: &B, lent: &Lent<'_, '_, B>) -> Result<(), OptimError> {
        let Lent::Buffers(buffers) = lent else {
            return Ok(());
        };
        for (k, (id, buf)) in buffers.iter().enumerate() {
            let Some(layout) = self.layouts.get(id.0) else {
                return Err(OptimError::UnknownParam(format!("#{}", id.0)));
            };
            let reason = if !layout.lent {
                "a buffer was lent for a parameter lpmm holds"
            } else if buffers[..k].iter().any(|(i, _)| i == id) {
                "its buffer was lent twice"
            } else {
                let (dtype, len) = backend.output_info(buf);
                self.check_buffer(id.0, dtype, len)?;
                continue;
            };
            return Err(OptimError::Lent {
                param: (self.name)(id.0),
                reason: reason.into(),
            });
        }
        Ok(())
    }

    /// Every lent parameter that `takes_part` has its buffer, of its dtype and size: from
    /// [`Lent::Buffers`] (checked by [`Lents::check`]), or lent once by the [`Lender`] and
    /// checked here.
    pub fn obtain<B: Backend>(
        &self,
        backend: &B,
        lent: &mut Lent<'_, '_, B>,
        takes_part: impl Fn(usize) -> bool,
    ) -> Result<(), OptimError> {
        for i in 0..self.layouts.len() {
            if !(self.layouts[i].lent && takes_part(i)) {
                continue;
            }
            let id = ParamId(i);
            match lent {
                Lent::None => return Err(self.unlent(i)),
                Lent::Buffers(b) if !b.iter().any(|(k, _)| *k == id) => {
                    return Err(self.unlent(i));
                }
                Lent::Buffers(_) => {}
                Lent::Lender(lender) => {
                    let mut seen = None;
                    lender.lend(id, &mut |buf| {
                        seen = Some(backend.input_info(&buf));
                        Ok(())
                    })?;
                    let Some((dtype, len)) = seen else {
                        return Err(self.unlent(i));
                    };
                    self.check_buffer(i, dtype, len)?;
                }
            }
        }
        Ok(())
    }
}

/// One step's batches: the optimizer's parameters and the plans of those that step.
pub(crate) struct Batches<'a, B: Backend, F: Fn(usize) -> String> {
    pub lents: Lents<'a, F>,
    pub backend: &'a B,
    pub params: &'a mut [B::Param],
    pub layouts: &'a [ParamLayout],
    pub plans: &'a [Option<ParamStep>],
    pub seed: u64,
    pub scratch: &'a mut Scratch,
    /// The matrix phase's workspace (allocated at registration for the largest matrix).
    pub matrices: &'a mut Option<B::Matrices>,
}

impl<B: Backend, F: Fn(usize) -> String> Batches<'_, B, F> {
    /// Runs every plan whose parameter has not stepped yet in this step: the parameters lpmm
    /// holds in one batch, then the lent ones — in one batch from [`Lent::Buffers`], one at a
    /// time inside a [`Lender`]'s callback. The caller has obtained and checked every lent
    /// buffer ([`Lents::obtain`]). Each parameter whose batch completed is marked in
    /// [`Scratch::done`] (so a failure midway leaves the bookkeeping of those that moved to the
    /// caller), and its non-finite values in [`Scratch::non_finite`].
    pub fn run(
        &mut self,
        released: Option<(usize, B::Input<'_>)>,
        lent: &mut Lent<'_, '_, B>,
    ) -> Result<(), OptimError> {
        let n = self.layouts.len();
        let waiting = |this: &Self, lent: bool| {
            (0..n).any(|i| {
                this.plans[i].is_some() && this.layouts[i].lent == lent && !this.scratch.done[i]
            })
        };
        if waiting(self, false) {
            let held = released.filter(|(i, _)| !self.layouts[*i].lent);
            self.batch(held, &mut [], |layouts, i| !layouts[i].lent)?;
        }
        if waiting(self, true) {
            let released = released.filter(|(i, _)| self.layouts[*i].lent);
            match lent {
                Lent::None => {}
                Lent::Buffers(buffers) => {
                    self.batch(released, buffers, |layouts, i| layouts[i].lent)?;
                }
                Lent::Lender(lender) => self.lender_batches(released, &mut **lender)?,
            }
        }
        Ok(())
    }

    /// The lent parameters one at a time, each inside the lender's callback.
    fn lender_batches(
        &mut self,
        released: Option<(usize, B::Input<'_>)>,
        lender: &mut dyn Lender<B>,
    ) -> Result<(), OptimError> {
        for i in 0..self.layouts.len() {
            if self.plans[i].is_none() || !self.layouts[i].lent || self.scratch.done[i] {
                continue;
            }
            let id = ParamId(i);
            let released = released.filter(|(r, _)| *r == i);
            lender.lend_mut(id, &mut |buf| {
                // Lent again: checked again (a lender may hand out another buffer than the one
                // `Lents::obtain` checked).
                let (dtype, len) = self.backend.output_info(&buf);
                self.lents.check_buffer(i, dtype, len)?;
                self.batch(released, &mut [(id, buf)], |_, k| k == i)
            })?;
        }
        Ok(())
    }

    /// One batch: the plans of the parameters `member` selects that have not stepped, run in
    /// the shared schedule, with `lent` their buffers.
    fn batch(
        &mut self,
        released: Option<(usize, B::Input<'_>)>,
        lent: &mut [(ParamId, B::Output<'_>)],
        member: impl Fn(&[ParamLayout], usize) -> bool,
    ) -> Result<(), OptimError> {
        let scratch = &mut *self.scratch;
        for (i, b) in scratch.batch.iter_mut().enumerate() {
            *b = self.plans[i].filter(|_| !scratch.done[i] && member(self.layouts, i));
        }
        Exec {
            backend: self.backend,
            params: &mut *self.params,
            layouts: self.layouts,
            plans: &mut scratch.batch,
            released,
            lent,
            seed: self.seed,
            non_finite: &mut scratch.call,
            kept: &mut scratch.kept,
            ran: &mut scratch.ran,
            matrices: self.matrices.as_mut(),
            matrixed: &mut scratch.matrixed,
            rest: &mut scratch.rest,
            current: None,
        }
        .run()?;
        for i in 0..self.layouts.len() {
            if scratch.batch[i].is_some() {
                scratch.non_finite[i] |= scratch.call[i];
                scratch.done[i] = true;
            }
        }
        Ok(())
    }
}

/// Runs one batch's plans on `backend` as the optimizer's executor does: `prepare`, the shared
/// schedule ([`run_step`]) over the backend's primitives with the host combines, the matrix
/// phase (a workspace allocated here for the batch's matrices), the swaps. `non_finite[i]` is
/// set for each parameter of the batch where a non-finite value was met or a tensor-wide
/// statistic kept its old value. For implementors' tests of a backend's primitives without an
/// optimizer; `work`'s lent buffers must be those the executor would hand over (one per lent
/// parameter of the batch, of its dtype and size).
pub fn run_batch<B: Backend>(
    backend: &B,
    work: StepWork<'_, '_, '_, B>,
    non_finite: &mut [bool],
) -> Result<(), BackendError> {
    let n = work.params.len();
    let (mut kept, mut ran) = (vec![false; n], vec![false; n]);
    let (mut matrixed, mut rest) = (vec![false; n], vec![None; n]);
    // The executor changes the plans' constants as it combines the rule's sums.
    let mut plans = work.plans.to_vec();
    let shapes = plans
        .iter()
        .zip(work.layouts)
        .filter(|(p, _)| p.is_some_and(|p| p.plan.has_matrix()))
        .filter_map(|(_, l)| MatrixShape::of(&l.shape));
    let (elements, square) = shapes.fold((0, 0), |(e, s), m| (e.max(m.numel()), s.max(m.square())));
    let mut matrices = if elements > 0 {
        Some(backend.matrices(elements, square)?)
    } else {
        None
    };
    Exec {
        backend,
        params: work.params,
        layouts: work.layouts,
        plans: &mut plans,
        released: work.released,
        lent: work.lent,
        seed: work.seed,
        non_finite,
        kept: &mut kept,
        ran: &mut ran,
        matrices: matrices.as_mut(),
        matrixed: &mut matrixed,
        rest: &mut rest,
        current: None,
    }
    .run()
}

/// One batch's plans on a backend: [`run_step`]'s schedule over the backend's primitives, with
/// the host combines.
struct Exec<'e, 'r, 'l, B: Backend> {
    backend: &'e B,
    params: &'e mut [B::Param],
    layouts: &'e [ParamLayout],
    /// The batch's plans (their rule constants change as the rule's sums are combined).
    plans: &'e mut [Option<ParamStep>],
    released: Option<(usize, B::Input<'r>)>,
    lent: &'e mut [(ParamId, B::Output<'l>)],
    seed: u64,
    non_finite: &'e mut [bool],
    /// A tensor-wide statistic that would not fit kept its old value, or the matrix phase's
    /// fused pass met a non-finite value: the parameter is reported.
    kept: &'e mut [bool],
    ran: &'e mut [bool],
    /// The matrix phase's workspace (`None`: no parameter of the optimizer takes the phase).
    matrices: Option<&'e mut B::Matrices>,
    /// Which parameters took the matrix phase, and the plans of the others' fused pass.
    matrixed: &'e mut [bool],
    rest: &'e mut [Option<ParamStep>],
    /// The parameter whose matrix phase is running.
    current: Option<usize>,
}

impl<'r, 'l, B: Backend> Exec<'_, 'r, 'l, B> {
    /// `prepare`, the schedule, then the kept statistics reported as non-finite.
    fn run(mut self) -> Result<(), BackendError> {
        self.backend.prepare(&mut self.work())?;
        self.non_finite.iter_mut().for_each(|f| *f = false);
        self.kept.iter_mut().for_each(|f| *f = false);
        self.matrixed.iter_mut().for_each(|f| *f = false);
        run_step(&mut self)?;
        for (f, k) in self.non_finite.iter_mut().zip(self.kept.iter()) {
            *f |= *k;
        }
        Ok(())
    }

    fn work(&mut self) -> StepWork<'_, 'r, 'l, B> {
        StepWork {
            params: self.params,
            layouts: self.layouts,
            plans: self.plans,
            released: self.released,
            lent: self.lent,
            seed: self.seed,
        }
    }
}

impl<B: Backend> PlanRunner for Exec<'_, '_, '_, B> {
    type Error = BackendError;

    fn passes(&self, phase: Phase) -> usize {
        self.plans
            .iter()
            .flatten()
            .map(|p| p.plan.passes(phase, p.flags))
            .max()
            .unwrap_or(0)
    }

    fn begin(&mut self, phase: Phase) -> Result<(), BackendError> {
        self.backend.begin_phase(&mut self.work(), phase)
    }

    fn fold(&mut self, phase: Phase, pass: usize) -> Result<(), BackendError> {
        self.backend.fold(&mut self.work(), phase, pass)
    }

    fn combine(&mut self, phase: Phase) -> Result<(), BackendError> {
        for (r, p) in self.ran.iter_mut().zip(self.plans.iter()) {
            *r = p.is_some_and(|p| p.plan.passes(phase, p.flags) > 0);
        }
        let (layouts, plans, kept) = (self.layouts, &mut *self.plans, &mut *self.kept);
        let mut combine = |i: usize, folded: Folded<'_>| {
            let (Some(plan), layout) = (plans[i].as_mut(), &layouts[i]) else {
                return;
            };
            match (phase, folded) {
                (Phase::Stats, Folded::Stats(words)) => {
                    let (exp, sum) = words.split_at(MAX_STATS);
                    // On the stack: the step allocates nothing.
                    let mut sums = [0f64; MAX_STATS];
                    let n = plan.rule.stats().min(MAX_STATS);
                    for (k, s) in sums[..n].iter_mut().enumerate() {
                        *s = fixed::total(exp, sum, k, layout.numel);
                    }
                    plan.rule.combine_stats(&sums[..n], layout.numel);
                }
                (Phase::Slot(slot), Folded::Wide(wide)) => {
                    if let Some(f) = layout.format(slot) {
                        kept[i] |= f.combine(wide, &layout.shape, &plan.rule, slot);
                    }
                }
                _ => {}
            }
        };
        self.backend
            .folded(self.params, self.layouts, self.ran, phase, &mut combine)
    }

    fn begin_matrix(&mut self) -> Result<Option<NewtonSchulz>, BackendError> {
        let next = (0..self.plans.len())
            .find(|&i| !self.matrixed[i] && self.plans[i].is_some_and(|p| p.plan.matrix(p.flags)));
        let Some(i) = next else {
            return Ok(None);
        };
        let name = self.backend.name();
        // Registration refused a rule with a matrix phase on anything but a matrix, and
        // allocated the workspace.
        let shape = MatrixShape::of(&self.layouts[i].shape).ok_or(BackendError::Unsupported {
            backend: name,
            what: "a matrix phase on a tensor that is not a matrix".into(),
        })?;
        let matrices = self
            .matrices
            .as_deref_mut()
            .ok_or_else(|| crate::backend::no_matrix_phase(name))?;
        let Some(plan) = self.plans[i].as_mut() else {
            return Ok(None);
        };
        plan.rule.combine_matrix(shape.rows, shape.cols);
        let ns = plan.rule.newton_schulz();
        self.matrixed[i] = true;
        self.current = Some(i);
        let mut work = StepWork {
            params: &mut *self.params,
            layouts: self.layouts,
            plans: &*self.plans,
            released: self.released,
            lent: &mut *self.lent,
            seed: self.seed,
        };
        self.backend.matrix_in(&mut work, i, shape, matrices)?;
        Ok(ns)
    }

    fn matrix_op(&mut self, op: MatrixOp) -> Result<(), BackendError> {
        let name = self.backend.name();
        let matrices = self
            .matrices
            .as_deref_mut()
            .ok_or_else(|| crate::backend::no_matrix_phase(name))?;
        self.backend.matrix_op(matrices, op)
    }

    fn end_matrix(&mut self) -> Result<(), BackendError> {
        let Some(i) = self.current.take() else {
            return Ok(());
        };
        let name = self.backend.name();
        let matrices = self
            .matrices
            .as_deref()
            .ok_or_else(|| crate::backend::no_matrix_phase(name))?;
        let mut work = StepWork {
            params: &mut *self.params,
            layouts: self.layouts,
            plans: &*self.plans,
            released: self.released,
            lent: &mut *self.lent,
            seed: self.seed,
        };
        // Kept apart: the others' fused pass sets every parameter's flag.
        self.kept[i] |= self.backend.matrix_out(&mut work, i, matrices)?;
        Ok(())
    }

    fn fused(&mut self) -> Result<(), BackendError> {
        let non_finite = &mut *self.non_finite;
        // The parameters that took the matrix phase have stepped.
        let plans: &[Option<ParamStep>] = if self.matrixed.iter().any(|&m| m) {
            for ((r, p), &m) in self
                .rest
                .iter_mut()
                .zip(self.plans.iter())
                .zip(&*self.matrixed)
            {
                *r = if m { None } else { *p };
            }
            if self.rest.iter().all(Option::is_none) {
                return Ok(());
            }
            &*self.rest
        } else {
            &*self.plans
        };
        let mut work = StepWork {
            params: &mut *self.params,
            layouts: self.layouts,
            plans,
            released: self.released,
            lent: &mut *self.lent,
            seed: self.seed,
        };
        self.backend.fused(&mut work, non_finite)
    }

    fn swap(&mut self) -> Result<(), BackendError> {
        for (i, p) in self.plans.iter().enumerate() {
            let Some(p) = p else { continue };
            for (slot, a, b) in p.plan.swaps(p.flags) {
                self.backend.swap_wide(&mut self.params[i], slot, a, b);
            }
        }
        Ok(())
    }
}
