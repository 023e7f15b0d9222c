//! The step: one entry point, [`Optimizer::step`], over a gradient source ([`Step`]: the
//! accumulators, the caller's gradient buffers, one parameter's gradient released now, or a
//! sharded model's summary) with lent parameters' buffers ([`Lent`]); and
//! [`Optimizer::accumulate`], which fills the accumulators.

use crate::backend::{Backend, HostValues, HostValuesMut, ParamId, SlotKind, StepFlags};
use crate::cpu::Cpu;
use crate::error::OptimError;
use crate::exact::ExactSum;
use crate::exec::{Batches, Lents};
use crate::lent::{Lender, Lent};

use crate::coverage::MissingGradients;

use super::{
    GradientSummary, NonFinitePolicy, Optimizer, ParamState, StepReport, check_counter,
    missing_gradients,
};

/// One parameter's gradient: values on the host (copied into the backend's memory where that is
/// elsewhere) or a buffer already in the backend's memory (a framework's gradient tensor: no
/// copy). `&[f32]`, `&Vec<f32>` and `&[f32; N]` convert into it.
pub enum Grad<'a, B: Backend> {
    /// Host values, f32 or bf16.
    Host(HostValues<'a>),
    /// A buffer in the backend's memory.
    Input(B::Input<'a>),
}

impl<B: Backend> Clone for Grad<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Grad<'_, B> {}

impl<B: Backend> std::fmt::Debug for Grad<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Grad::Host(h) => f.debug_tuple("Host").field(h).finish(),
            Grad::Input(_) => f.write_str("Input(..)"),
        }
    }
}

/// Host f32 values: `&[f32]`, `&Vec<f32>`, `&[f32; N]`.
impl<'a, B: Backend, T: AsRef<[f32]> + ?Sized> From<&'a T> for Grad<'a, B> {
    fn from(values: &'a T) -> Self {
        Grad::Host(HostValues::F32(values.as_ref()))
    }
}

impl<'a, B: Backend> From<HostValues<'a>> for Grad<'a, B> {
    fn from(values: HostValues<'a>) -> Self {
        Grad::Host(values)
    }
}

/// What [`Gradients::gradient`] calls with a parameter's gradient (`None`: no gradient).
pub type WithGradient<'f, B> =
    dyn FnMut(Option<<B as Backend>::Input<'_>>) -> Result<(), OptimError> + 'f;

/// The gradients of a step taken straight from the caller's gradient buffers ([`Step::given`]):
/// a framework's gradient tensors, read where they are, each released as soon as its parameter
/// has stepped.
pub trait Gradients<B: Backend> {
    /// Calls `f` with parameter `id`'s gradient, or `None` if it has none this step.
    fn gradient(&mut self, id: ParamId, f: &mut WithGradient<'_, B>) -> Result<(), OptimError>;
    /// Parameter `id` has stepped (or the step was skipped): its gradient may be dropped.
    fn consumed(&mut self, _id: ParamId) {}
}

/// Host slices as gradients (for tests and host training loops): `grads[id.index()]`, empty for
/// none.
impl Gradients<Cpu> for Vec<Vec<f32>> {
    fn gradient(&mut self, id: ParamId, f: &mut WithGradient<'_, Cpu>) -> Result<(), OptimError> {
        match self.get(id.0) {
            Some(g) if !g.is_empty() => f(Some(HostValues::F32(g))),
            _ => f(None),
        }
    }
}

/// Host slices as lent buffers (for tests and host training loops): `buffers[id.index()]`.
impl Lender<Cpu> for Vec<Vec<f32>> {
    fn lend(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(HostValues<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError> {
        let b = self
            .get(id.0)
            .ok_or(OptimError::UnknownParam(format!("#{}", id.0)))?;
        f(HostValues::F32(b))
    }

    fn lend_mut(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(HostValuesMut<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError> {
        let b = self
            .get_mut(id.0)
            .ok_or(OptimError::UnknownParam(format!("#{}", id.0)))?;
        f(HostValuesMut::F32(b))
    }
}

/// The gradients of every parameter from the accumulators ([`Optimizer::accumulate`]):
/// `opt.step(Accumulated)` is [`Step::accumulated`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accumulated;

/// A sharded model's summary ([`Step::summarized`]): the global decision's inputs and this
/// optimizer's non-finite parameters.
type Summary = (Option<(ExactSum, bool)>, Vec<ParamId>);

enum Source<'s, 'a: 's, B: Backend> {
    Accumulated,
    Given(&'s mut dyn Gradients<B>),
    Summarized {
        global: Option<(ExactSum, bool)>,
        local_non_finite: Vec<ParamId>,
    },
    Param {
        id: ParamId,
        grad: Grad<'a, B>,
        update_param: bool,
    },
}

/// What [`Optimizer::step`] takes: where the gradients come from, and where lent parameters'
/// buffers are ([`Step::lent`]).
///
/// | source | steps | global decision (clipping, SkipStep) |
/// |---|---|---|
/// | [`Step::accumulated`] (or `Accumulated`) | every parameter whose accumulator holds gradients | over all of them |
/// | [`Step::given`] (or `&mut grads`) | the caller's gradients, and every accumulated one | over all of them |
/// | [`Step::summarized`] | the accumulated ones, with a sharded model's global summary | the summary's |
/// | [`Step::param`] | one parameter now, with this gradient (gradient release) | none: no clipping |
/// | [`Step::states_only`] | one parameter's states, not the parameter (optimizer accumulation) | none |
pub struct Step<'s, 'a: 's, B: Backend> {
    source: Source<'s, 'a, B>,
    lent: Lent<'s, 'a, B>,
}

impl<B: Backend> std::fmt::Debug for Step<'_, '_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match &self.source {
            Source::Accumulated => "accumulated".to_string(),
            Source::Given(_) => "given".to_string(),
            Source::Summarized { .. } => "summarized".to_string(),
            Source::Param {
                id, update_param, ..
            } => format!(
                "{} {id:?}",
                if *update_param {
                    "param"
                } else {
                    "states_only"
                }
            ),
        };
        f.debug_struct("Step")
            .field("source", &source)
            .field("lent", &self.lent)
            .finish()
    }
}

impl<'s, 'a: 's, B: Backend> Step<'s, 'a, B> {
    fn of(source: Source<'s, 'a, B>) -> Self {
        Step {
            source,
            lent: Lent::None,
        }
    }

    /// Steps every parameter whose accumulator holds gradients, consuming them.
    pub fn accumulated() -> Self {
        Self::of(Source::Accumulated)
    }

    /// Gradients from the caller's buffers (a framework's gradient tensors after a backward pass:
    /// no accumulator is needed and no copy is made), together with every parameter whose
    /// accumulator holds gradients (e.g. accumulated during the backward pass by a layer over an
    /// lpmm parameter). The policies keep their meaning over all of them — the exact global norm
    /// for clipping, all or nothing under SkipStep — and each given gradient is released
    /// ([`Gradients::consumed`]) as soon as its parameter has stepped, so the caller can drop it
    /// parameter by parameter. A parameter cannot take both a given gradient and an accumulated
    /// one (an error naming it; nothing moves).
    pub fn given(grads: &'s mut dyn Gradients<B>) -> Self {
        Self::of(Source::Given(grads))
    }

    /// The second half of a step split across ranks (lpmm-dist), after
    /// [`super::PartsMut::gradient_summary`]: steps the accumulated gradients with the whole
    /// model's sum of squares (the norm for clipping) and whether any part of the model has a
    /// non-finite gradient (the SkipStep decision), as the unsharded model would.
    /// `local_non_finite` is this optimizer's part, reported back. `global` is `None` when neither clipping nor SkipStep
    /// needs the pre-pass.
    pub fn summarized(global: Option<(ExactSum, bool)>, local_non_finite: Vec<ParamId>) -> Self {
        Self::of(Source::Summarized {
            global,
            local_non_finite,
        })
    }

    /// Gradient release: steps one parameter now with `grad` (plus anything its accumulator
    /// holds), so a training loop can step each parameter from its backward hook and never hold
    /// all gradients. Global-norm clipping needs every gradient and is not applied here. The
    /// global step counter does not move.
    pub fn param(id: ParamId, grad: impl Into<Grad<'a, B>>) -> Self {
        Self::of(Source::Param {
            id,
            grad: grad.into(),
            update_param: true,
        })
    }

    /// Optimizer accumulation (optimi's, after Zhang et al.'s AdamAccumulation): folds a
    /// micro-batch gradient straight into the parameter's optimizer states — the rule's state
    /// update with this gradient, its step counter advancing — without weight decay and without
    /// moving the parameter. Finish the accumulation with [`Step::param`] on the last
    /// micro-batch. With gradient storage `None` no gradient memory is ever held.
    pub fn states_only(id: ParamId, grad: impl Into<Grad<'a, B>>) -> Self {
        Self::of(Source::Param {
            id,
            grad: grad.into(),
            update_param: false,
        })
    }

    /// The buffers of the lent parameters that take part (each stepped in place; a lent
    /// parameter that takes part without its buffer is an error naming it, before anything
    /// moves).
    pub fn lent(mut self, lent: Lent<'s, 'a, B>) -> Self {
        self.lent = lent;
        self
    }
}

impl<B: Backend> From<Accumulated> for Step<'_, '_, B> {
    fn from(_: Accumulated) -> Self {
        Step::accumulated()
    }
}

impl<'s, B: Backend, G: Gradients<B>> From<&'s mut G> for Step<'s, '_, B> {
    fn from(grads: &'s mut G) -> Self {
        Step::given(grads)
    }
}

impl<B: Backend> Optimizer<B> {
    /// Adds a micro-batch gradient into the parameter's gradient accumulator (in its storage
    /// format, stochastically rounded if configured so). The next step consumes and resets it.
    /// `grad` is host values (`&[f32]`, `&Vec<f32>`, [`HostValues`]) or a buffer in the backend's
    /// memory ([`Grad::Input`]: a framework's gradient tensor, no copy through the host), f32
    /// or bf16. A float accumulator (f32, bf16) keeps what it cannot represent as ±Inf or NaN —
    /// a non-finite micro-batch, or a sum beyond its range — for the step's non-finite policy,
    /// which reports the parameter. A quantized accumulator cannot hold such values: a
    /// non-finite micro-batch ([`OptimError::Quant`] naming the element of host f32 values,
    /// [`OptimError::NonFiniteGradient`] for other inputs), or one whose sum with what the
    /// accumulator holds would overflow ([`OptimError::AccumulatorOverflow`]), is refused and
    /// nothing changes.
    pub fn accumulate<'a>(
        &mut self,
        id: ParamId,
        grad: impl Into<Grad<'a, B>>,
    ) -> Result<(), OptimError> {
        let grad = grad.into();
        if let Grad::Host(HostValues::F32(values)) = grad {
            self.check_len(id, "gradient", values.len())?;
            if self.layouts[id.0]
                .format(SlotKind::Grad)
                .is_some_and(|f| !f.holds_non_finite())
                && let Some(index) = values.iter().position(|v| !v.is_finite())
            {
                return Err(lpmm_quant::QuantError::NonFinite {
                    index,
                    value: values[index],
                }
                .into());
            }
        }
        let grad = self.grad_input(id, grad)?;
        let state = &self.states[id.0];
        let Some(format) = self.layouts[id.0].format(SlotKind::Grad) else {
            return Err(OptimError::NoAccumulator(state.name.clone()));
        };
        check_counter(
            || format!("parameter {}'s accumulation counter", state.name),
            state.accumulations + 1,
        )?;
        if !format.holds_non_finite() {
            if !self.backend.finite(grad)? {
                return Err(OptimError::NonFiniteGradient {
                    param: state.name.clone(),
                });
            }
            if !self
                .backend
                .accumulate_fits(&self.params[id.0], &self.layouts[id.0], grad)?
            {
                return Err(OptimError::AccumulatorOverflow {
                    param: state.name.clone(),
                    storage: state.config.grad.describe(),
                    limit: format.limit(),
                });
            }
        }
        self.backend.accumulate(
            &mut self.params[id.0],
            &self.layouts[id.0],
            state.accumulations,
            grad,
            self.options.seed,
        )?;
        let state = &mut self.states[id.0];
        state.accumulations += 1;
        state.pending = true;
        Ok(())
    }

    /// Takes a step ([`Step`] says from which gradients, and where lent parameters' buffers
    /// are): `opt.step(Accumulated)` after [`Optimizer::accumulate`], `opt.step(&mut grads)`
    /// with the caller's gradients, `opt.step(Step::param(id, &grad))` to release one
    /// parameter's gradient now. In evaluation mode ([`super::Mode::Eval`],
    /// [`Optimizer::set_mode`]) it is refused.
    pub fn step<'s, 'a: 's>(
        &mut self,
        step: impl Into<Step<'s, 'a, B>>,
    ) -> Result<StepReport, OptimError> {
        let Step { source, mut lent } = step.into();
        self.lents().check(&self.backend, &lent)?;
        match source {
            Source::Param {
                id,
                grad,
                update_param,
            } => self.release_step(id, grad, update_param, &mut lent),
            Source::Accumulated => self.step_all(None, None, &mut lent),
            Source::Given(grads) => self.step_all(Some(grads), None, &mut lent),
            Source::Summarized {
                global,
                local_non_finite,
            } => self.step_all(None, Some((global, local_non_finite)), &mut lent),
        }
    }

    /// `grad` as a buffer of the backend's (host values copied in where the backend's memory is
    /// elsewhere), of the parameter's length (checked before any copy).
    fn grad_input<'a>(&self, id: ParamId, grad: Grad<'a, B>) -> Result<B::Input<'a>, OptimError> {
        let input = match grad {
            Grad::Host(host) => {
                self.check_len(id, "gradient", host.info().1)?;
                self.backend.host_input(host)
            }
            Grad::Input(input) => input,
        };
        let (_, len) = self.backend.input_info(&input);
        self.check_len(id, "gradient", len)?;
        Ok(input)
    }

    /// In evaluation mode no parameter steps.
    fn check_training(&self) -> Result<(), OptimError> {
        if self.eval {
            return Err(OptimError::EvalMode);
        }
        Ok(())
    }

    /// Refuses a step that would take the global counter, or the step counter of a parameter
    /// with `takes_part`, past [`super::MAX_COUNTER`] (before anything changes).
    fn check_step_counters(&self, takes_part: impl Fn(usize) -> bool) -> Result<(), OptimError> {
        self.check_training()?;
        check_counter(|| "the step counter".into(), self.global_steps + 1)?;
        for (i, m) in self.states.iter().enumerate() {
            if takes_part(i) {
                check_counter(
                    || format!("parameter {}'s step counter", m.name),
                    m.steps + 1,
                )?;
            }
        }
        Ok(())
    }

    /// Runs the plans in `self.plans` (cleared after) through the step executor
    /// ([`crate::exec`]): every lent buffer they need obtained and checked first, then the
    /// batches. [`Scratch::done`](crate::exec::Scratch) marks the parameters that moved.
    pub(super) fn run_step(
        &mut self,
        released: Option<(usize, B::Input<'_>)>,
        lent: &mut Lent<'_, '_, B>,
    ) -> Result<(), OptimError> {
        let plans = &self.plans;
        self.lents()
            .obtain(&self.backend, lent, |i| plans[i].is_some())?;
        let result = Batches {
            lents: Lents {
                name: |i| self.states[i].name.clone(),
                layouts: &self.layouts,
            },
            backend: &self.backend,
            params: &mut self.params,
            layouts: &self.layouts,
            plans: &self.plans,
            seed: self.options.seed,
            scratch: &mut self.exec,
            matrices: &mut self.matrices,
        }
        .run(released, lent);
        self.plans.iter_mut().for_each(|p| *p = None);
        result
    }

    /// The lent-buffer checks over this optimizer's parameters.
    pub(super) fn lents(&self) -> Lents<'_, impl Fn(usize) -> String + '_> {
        Lents {
            name: |i| self.states[i].name.clone(),
            layouts: &self.layouts,
        }
    }

    /// The first half of a step split across ranks ([`super::PartsMut::gradient_summary`]).
    pub(crate) fn gradient_summary(&mut self) -> Result<GradientSummary, OptimError> {
        self.select_pending();
        self.backend.gradient_stats(
            &mut self.params,
            &self.layouts,
            &self.select,
            &mut self.stats,
        )?;
        let mut summary = GradientSummary::default();
        for (index, (&s, (sum, finite))) in self.select.iter().zip(&self.stats).enumerate() {
            if s {
                summary.sum.merge(sum);
                if !finite {
                    summary.non_finite.push(ParamId(index));
                }
            }
        }
        self.select.iter_mut().for_each(|s| *s = false);
        Ok(summary)
    }

    fn select_pending(&mut self) {
        for (s, m) in self.select.iter_mut().zip(&self.states) {
            *s = m.pending;
        }
    }

    /// A step of every parameter with a gradient: the given ones (`grads`) and the accumulated
    /// ones, the decision (norm, clip, skip) from their statistics or from a sharded model's
    /// `summary`.
    fn step_all(
        &mut self,
        mut grads: Option<&mut dyn Gradients<B>>,
        summary: Option<Summary>,
        lent: &mut Lent<'_, '_, B>,
    ) -> Result<StepReport, OptimError> {
        let n = self.states.len();
        let need_stats = self.options.max_grad_norm.is_some()
            || self.options.non_finite == NonFinitePolicy::SkipStep;
        let local_stats = need_stats && summary.is_none();
        let mut report = StepReport::default();
        let mut sum = ExactSum::new();
        // Which parameters are given a gradient: scratch kept between steps (a step allocates
        // nothing); taken here and put back at the end.
        let mut given = std::mem::take(&mut self.given);
        given.clear();
        given.resize(n, false);
        if let Some(grads) = grads.as_deref_mut() {
            for (i, given) in given.iter_mut().enumerate() {
                let id = ParamId(i);
                let (numel, pending, name) = (
                    self.layouts[i].numel,
                    self.states[i].pending,
                    &self.states[i].name,
                );
                let backend = &self.backend;
                grads.gradient(id, &mut |g| {
                    let Some(g) = g else { return Ok(()) };
                    let (_, len) = backend.input_info(&g);
                    if len != numel {
                        return Err(OptimError::Length {
                            param: name.clone(),
                            what: "gradient",
                            expected: numel,
                            actual: len,
                        });
                    }
                    if pending {
                        return Err(OptimError::Lent {
                            param: name.clone(),
                            reason: "it holds an accumulated gradient and was given another: pass all of its gradient one way".into(),
                        });
                    }
                    *given = true;
                    if local_stats {
                        let (s, finite) = backend.input_stats(g)?;
                        sum.merge(&s);
                        if !finite {
                            report.non_finite.push(id);
                        }
                    }
                    Ok(())
                })?;
            }
        }
        let takes_part = |this: &Self, i: usize| given[i] || this.states[i].pending;
        // Every parameter taking part must have a step left, and a lent one its buffer.
        self.check_step_counters(|i| takes_part(self, i))?;
        self.lents()
            .obtain(&self.backend, lent, |i| takes_part(self, i))?;
        // Coverage, before anything moves (no gradient has been consumed yet).
        let missing = missing_gradients(&self.states, |i| takes_part(self, i));
        self.check_coverage(&missing)?;
        self.forget_released();
        report.missing_gradients = missing;
        // The accumulated ones.
        self.select_pending();
        if local_stats && self.select.iter().any(|&s| s) {
            self.backend.gradient_stats(
                &mut self.params,
                &self.layouts,
                &self.select,
                &mut self.stats,
            )?;
            for (i, (&s, (part, finite))) in self.select.iter().zip(&self.stats).enumerate() {
                if s {
                    sum.merge(part);
                    if !finite {
                        report.non_finite.push(ParamId(i));
                    }
                }
            }
            report.non_finite.sort();
        }
        // The decision: from the statistics above, or from the summary.
        let decision = match summary {
            Some((global, local_non_finite)) => {
                report.non_finite = local_non_finite;
                global
            }
            None => local_stats.then(|| {
                let any = !report.non_finite.is_empty();
                (sum, any)
            }),
        };
        let mut clip = 1.0f32;
        if let Some((sum, any_non_finite)) = decision {
            let norm = sum.to_f64().sqrt();
            report.grad_norm = Some(norm);
            if let Some(max) = self.options.max_grad_norm
                && norm.is_finite()
                && norm > max
            {
                clip = (max / (norm + 1e-6)) as f32;
            }
            if any_non_finite && self.options.non_finite == NonFinitePolicy::SkipStep {
                report.skipped = true;
                if let Some(grads) = grads.as_deref_mut() {
                    for (i, &g) in given.iter().enumerate() {
                        if g {
                            grads.consumed(ParamId(i));
                        }
                    }
                }
                for (m, s) in self.states.iter_mut().zip(self.select.iter_mut()) {
                    m.pending = false;
                    *s = false;
                }
                self.backend
                    .clear_gradients(&mut self.params, &self.layouts, None)?;
                self.given = given;
                return Ok(report);
            }
        }
        let settings = self.settings;
        let plan =
            |state: &ParamState| state.plan(StepFlags(StepFlags::UPDATE_PARAM), clip, &settings);
        self.exec.begin();
        // Accumulated gradients: the held parameters in one batch, the lent ones in theirs.
        for i in 0..n {
            self.plans[i] = self.select[i].then(|| plan(&self.states[i]));
        }
        let mut result = self.run_step(None, lent);
        // Given gradients, released as they are consumed.
        if let (Ok(()), Some(grads)) = (&result, grads) {
            for i in (0..n).filter(|&i| given[i]) {
                let id = ParamId(i);
                result = grads.gradient(id, &mut |g| {
                    // The source is asked a second time: an answer that differs from the first
                    // (checked above) is refused, not read past its end.
                    let len = g.as_ref().map(|g| self.backend.input_info(g).1);
                    if len != Some(self.layouts[i].numel) {
                        return Err(OptimError::Length {
                            param: self.states[i].name.clone(),
                            what: "gradient (the source's second answer differs from its first)",
                            expected: self.layouts[i].numel,
                            actual: len.unwrap_or(0),
                        });
                    }
                    let Some(g) = g else { return Ok(()) };
                    self.plans.iter_mut().for_each(|p| *p = None);
                    self.plans[i] = Some(plan(&self.states[i]));
                    self.run_step(Some((i, g)), lent)
                });
                if result.is_err() {
                    break;
                }
                grads.consumed(id);
            }
        }
        // The parameters that moved are counted as stepped, also when the step failed midway
        // (a retry then steps only the others: one step in all).
        for i in 0..n {
            if !self.exec.done[i] {
                continue;
            }
            let id = ParamId(i);
            if self.exec.non_finite[i] && !report.non_finite.contains(&id) {
                report.non_finite.push(id);
            }
            let m = &mut self.states[i];
            m.stepped();
            m.pending = false;
            self.select[i] = false;
            report.updated += 1;
        }
        self.select.iter_mut().for_each(|s| *s = false);
        self.given = given;
        result?;
        self.global_steps += 1;
        Ok(report)
    }

    /// Applies the missing-gradient policy of the settings to what a step found.
    fn check_coverage(&mut self, missing: &MissingGradients) -> Result<(), OptimError> {
        if self.coverage.policy() != self.settings.missing_gradient {
            self.coverage.set_policy(self.settings.missing_gradient);
        }
        self.coverage.set_help(self.settings.missing_gradient_help);
        self.coverage.check(missing, self.global_steps + 1)
    }

    /// One parameter stepped now ([`Step::param`], [`Step::states_only`]).
    fn release_step(
        &mut self,
        id: ParamId,
        grad: Grad<'_, B>,
        update_param: bool,
        lent: &mut Lent<'_, '_, B>,
    ) -> Result<StepReport, OptimError> {
        let grad = self.grad_input(id, grad)?;
        self.lents().obtain(&self.backend, lent, |i| i == id.0)?;
        self.check_training()?;
        let name = &self.states[id.0].name;
        check_counter(
            || format!("parameter {name}'s step counter"),
            self.states[id.0].steps + 1,
        )?;
        let mut report = StepReport::default();
        for (i, s) in self.select.iter_mut().enumerate() {
            *s = i == id.0;
        }
        // The gradient is `grad` plus whatever the accumulator holds: both must be finite for the
        // step to run whole. Skipping elements, the step itself leaves each non-finite one
        // unchanged and reports it (below): the gradient is not read twice.
        let skip_step = self.options.non_finite == NonFinitePolicy::SkipStep;
        let mut finite = !skip_step || self.backend.finite(grad)?;
        if skip_step && self.states[id.0].pending {
            self.backend.gradient_stats(
                &mut self.params,
                &self.layouts,
                &self.select,
                &mut self.stats,
            )?;
            finite &= self.stats[id.0].1;
        }
        self.select[id.0] = false;
        if !finite {
            report.non_finite.push(id);
            if skip_step {
                // Skipped and consumed, as a whole step does.
                report.skipped = true;
                self.backend
                    .clear_gradients(&mut self.params, &self.layouts, Some(id.0))?;
                self.states[id.0].pending = false;
                self.states[id.0].released = true;
                return Ok(report);
            }
        }
        let state = &self.states[id.0];
        self.plans.iter_mut().for_each(|p| *p = None);
        self.plans[id.0] = Some(state.plan(
            StepFlags(0).with(StepFlags::UPDATE_PARAM, update_param),
            1.0,
            &self.settings,
        ));
        self.exec.begin();
        self.run_step(Some((id.0, grad)), lent)?;
        if self.exec.non_finite[id.0] && !report.non_finite.contains(&id) {
            report.non_finite.push(id);
        }
        let m = &mut self.states[id.0];
        m.stepped();
        m.pending = false;
        m.released = true;
        report.updated = 1;
        Ok(report)
    }
}
