//! The optimizer: parameters registered with their configuration, micro-batch gradient
//! accumulation, the step, gradient release, learning-rate control, clipping and the
//! non-finite-gradient policy. The numeric work is the backend's ([`crate::Backend`]); the CPU
//! backend defines the semantics.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::backend::{
    Backend, BackendError, F32_MAX_BITS, HostSlot, HostValues, HostValuesMut, Init, ParamId,
    ParamLayout, ParamStep, RuleState, SlotKind, StepFlags, StepPlan, StepWork, fits,
};
use crate::config::ParamConfig;
use crate::coverage::{
    CoverageCheck, MissingGradientHelp, MissingGradientPolicy, MissingGradients,
};
use crate::cpu::Cpu;
use crate::error::OptimError;
use crate::exact::ExactSum;
use crate::format::Storage;

/// The largest value of a step or accumulation counter: 2^53, the largest count the f64 bias
/// corrections hold exactly (and what checkpoints accept). A step or `accumulate` that would pass
/// it is refused ([`OptimError::Counter`]); no counter ever wraps.
pub const MAX_COUNTER: u64 = 1 << 53;

fn check_counter(what: impl FnOnce() -> String, value: u64) -> Result<(), OptimError> {
    if value > MAX_COUNTER {
        return Err(OptimError::Counter {
            what: what(),
            value,
        });
    }
    Ok(())
}

/// Initial values must fit the parameter's storage: finite, and within its largest magnitude
/// (a finite f32 above bf16's range would be stored as ±Inf).
fn check_init(name: &str, init: &[f32], storage: Storage) -> Result<(), OptimError> {
    let format = storage.format();
    let limit = format.map_or(F32_MAX_BITS, |f| f.limit_bits());
    let Some(index) = init.iter().position(|&v| !fits(v, limit)) else {
        return Ok(());
    };
    let value = init[index];
    Err(if value.is_finite() {
        OptimError::ParamOverflow {
            param: name.to_string(),
            index,
            value,
            storage: storage.describe(),
            limit: f32::from_bits(limit),
        }
    } else {
        OptimError::NonFiniteParam {
            param: name.to_string(),
            index,
            value,
        }
    })
}

/// What to do with a gradient that holds NaN or ±Inf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum NonFinitePolicy {
    /// Skip the whole step (no parameter or state changes), consume the gradients, and report
    /// it (like AMP's GradScaler). Costs one read of the gradients before the step.
    #[default]
    SkipStep,
    /// Leave every element whose gradient is not finite unchanged (parameter and states) and update
    /// the others (bitsandbytes skips such elements too, but zeroes their states).
    SkipElements,
}

/// Settings that apply to the whole optimizer: `OptimizerOptions::default()` (seed 0, no
/// clipping, skip a step with a non-finite gradient), changed with the `with_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct OptimizerOptions {
    /// Seed of every stochastic-rounding stream.
    pub seed: u64,
    /// Clip the global L2 norm of all gradients to this value before the step (`None`: off).
    pub max_grad_norm: Option<f64>,
    /// What to do with non-finite gradients.
    pub non_finite: NonFinitePolicy,
}

impl Default for OptimizerOptions {
    fn default() -> Self {
        OptimizerOptions {
            seed: 0,
            max_grad_norm: None,
            non_finite: NonFinitePolicy::SkipStep,
        }
    }
}

impl OptimizerOptions {
    /// With seed `seed` for every stochastic-rounding stream.
    pub fn with_seed(self, seed: u64) -> Self {
        OptimizerOptions { seed, ..self }
    }

    /// With the global gradient norm clipped to `max_grad_norm` (`None`: off).
    pub fn with_max_grad_norm(self, max_grad_norm: Option<f64>) -> Self {
        OptimizerOptions {
            max_grad_norm,
            ..self
        }
    }

    /// With policy `non_finite` for non-finite gradients.
    pub fn with_non_finite(self, non_finite: NonFinitePolicy) -> Self {
        OptimizerOptions { non_finite, ..self }
    }
}

/// What a step did.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct StepReport {
    /// Parameters that were updated.
    pub updated: usize,
    /// Whether the whole step was skipped for a non-finite gradient.
    pub skipped: bool,
    /// Parameters whose gradient held a non-finite value.
    pub non_finite: Vec<ParamId>,
    /// The global gradient norm, when it was computed (clipping or the skip policy).
    pub grad_norm: Option<f64>,
    /// The parameters that expect a gradient and received none in this step: a step from
    /// accumulators (`step`, `step_lent`, `begin_step`, `step_with_summary`) counts those not
    /// accumulated since the last step; `step_gradients` those the source has no gradient for
    /// and that hold none accumulated. A parameter stepped by a released step (`step_param`,
    /// `accumulate_states`) since the last step counts as covered; a released step itself is
    /// not a check (`checked` 0). Parameters excluded with
    /// [`Optimizer::set_expects_gradient`] are not counted.
    pub missing_gradients: MissingGradients,
}

/// This optimizer's part of a step's gradient pre-pass ([`Optimizer::gradient_summary`]).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct GradientSummary {
    /// Exact sum of squares of the finite gradient values.
    pub sum: ExactSum,
    /// Parameters whose gradients are not all finite.
    pub non_finite: Vec<ParamId>,
}

/// How a parameter's learning rate follows its group's when the group's changes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub enum LrRule {
    /// The group's learning rate.
    #[default]
    Group,
    /// The group's learning rate times this factor (a parameter registered with its own rate).
    Scaled(f64),
    /// Its own learning rate, unchanged (registered with its own rate while the group's was 0).
    Fixed,
}

/// A step begun with [`Optimizer::begin_step`]: its decision (skipped or not, the clip factor)
/// and what it has done so far. Finish it with [`Optimizer::finish_step`].
#[derive(Debug)]
#[must_use = "a begun step must be finished with Optimizer::finish_step"]
pub struct StepInProgress {
    report: StepReport,
    clip: f32,
}

impl StepInProgress {
    /// Whether the step was skipped (a non-finite gradient under `SkipStep`): nothing moves.
    pub fn skipped(&self) -> bool {
        self.report.skipped
    }

    /// The factor gradients are multiplied by (global-norm clipping; 1 if none).
    pub fn clip(&self) -> f32 {
        self.clip
    }
}

/// Lends the buffers of lent parameters ([`Optimizer::add_lent_param`]) to operations that need
/// them: a framework hands out its tensors' memory only inside a callback (candle's in-place
/// operations), so the optimizer asks for one buffer at a time.
pub trait Lender<B: Backend> {
    /// Calls `f` with parameter `id`'s buffer, read-only.
    fn lend(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(B::Input<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError>;
    /// Calls `f` with parameter `id`'s buffer, writable.
    fn lend_mut(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(B::Output<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError>;
}

/// What [`Gradients::gradient`] calls with a parameter's gradient (`None`: no gradient).
pub type WithGradient<'f, B> =
    dyn FnMut(Option<<B as Backend>::Input<'_>>) -> Result<(), OptimError> + 'f;

/// The gradients of a step taken straight from the caller's gradient buffers
/// ([`Optimizer::step_gradients`]): a framework's gradient tensors, read where they are, each
/// released as soon as its parameter has stepped.
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

/// The optimizer's bookkeeping of one parameter.
#[derive(Debug, Clone)]
pub(crate) struct ParamState {
    pub name: String,
    pub group: usize,
    /// The configuration asked for.
    pub requested: ParamConfig,
    /// The configuration in force (storages resolved by the minimum-size and shape rules).
    pub config: ParamConfig,
    /// Steps taken so far (the next is `steps + 1`).
    pub steps: u64,
    /// `accumulate` calls so far (the gradient slot's random-stream counter).
    pub accumulations: u64,
    /// Whether the accumulator holds gradients not yet consumed.
    pub pending: bool,
    pub lr_rule: LrRule,
    /// The rule's host state after `steps` steps.
    pub rule_state: RuleState,
    /// The step plan, compiled at registration.
    pub step_plan: StepPlan,
    /// Whether a step without a gradient for it counts as missing one
    /// ([`Optimizer::set_expects_gradient`]; not saved in checkpoints).
    pub expects_gradient: bool,
    /// A released step (`step_param`, `accumulate_states`) took a gradient for it since the last
    /// step: it counts as covered.
    pub released: bool,
}

impl ParamState {
    /// The plan of the parameter's next step.
    pub fn plan(&self, flags: StepFlags, clip: f32) -> ParamStep {
        let (hyper, t) = (&self.config.hyper, self.steps + 1);
        ParamStep {
            plan: self.step_plan,
            t,
            flags: flags.with(StepFlags::FIRST, self.steps == 0),
            rule: hyper.consts(t, &hyper.advance(t, self.rule_state)),
            clip,
        }
    }

    /// Counts a step taken: the step counter and the rule's host state move on together.
    pub fn stepped(&mut self) {
        self.steps += 1;
        self.rule_state = self.config.hyper.advance(self.steps, self.rule_state);
    }
}

/// The parameters that expect a gradient and are neither `covered` nor stepped by a released
/// step since the last step. Allocates only where one is missing.
fn missing_gradients(states: &[ParamState], covered: impl Fn(usize) -> bool) -> MissingGradients {
    let mut missing = MissingGradients::default();
    for (i, m) in states.iter().enumerate() {
        if m.expects_gradient {
            missing.checked += 1;
            if !covered(i) && !m.released {
                missing.push(&m.name);
            }
        }
    }
    missing
}

/// The random-stream counters of [`Optimizer::eval`] and [`Optimizer::train`] start here:
/// `2^62 + 2 steps + 1` for the move to evaluation, `2^62 + 2 steps` back.
pub const TRANSFORM_COUNTER: u64 = 1 << 62;

/// The optimizer over all registered parameters, on backend `B` (the CPU by default).
#[derive(Debug)]
pub struct Optimizer<B: Backend = Cpu> {
    pub(crate) backend: B,
    pub(crate) options: OptimizerOptions,
    pub(crate) groups: Vec<ParamConfig>,
    pub(crate) states: Vec<ParamState>,
    pub(crate) layouts: Vec<ParamLayout>,
    pub(crate) params: Vec<B::Param>,
    names: HashMap<String, usize>,
    /// Steps taken by `step()` (the global counter; per-parameter counters are in the states).
    pub(crate) global_steps: u64,
    /// Per-parameter scratch, allocated at registration so a step allocates nothing: the
    /// backend's statistics, the step's participants and plans, the non-finite flags.
    stats: Vec<(ExactSum, bool)>,
    select: Vec<bool>,
    /// The plans of a begun step's participants not yet stepped.
    pending_plans: Vec<Option<ParamStep>>,
    /// Whether plans use the specialized kernels ([`Optimizer::set_specialized_kernels`]).
    specialized: bool,
    plans: Vec<Option<ParamStep>>,
    flags: Vec<bool>,
    call_flags: Vec<bool>,
    /// The parameters hold their evaluation point ([`Optimizer::eval`]): no step until
    /// [`Optimizer::train`].
    pub(crate) eval: bool,
    /// The missing-gradient policy and the set it warned about last (not saved in checkpoints).
    coverage: CoverageCheck,
}

impl Optimizer<Cpu> {
    /// An optimizer with no parameters on the CPU backend.
    pub fn new(options: OptimizerOptions) -> Result<Self, OptimError> {
        Self::with_backend(Cpu, options)
    }
}

fn numel_of(name: &str, shape: &[usize]) -> Result<usize, OptimError> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n > 0 && n <= usize::MAX / 8)
        .ok_or_else(|| OptimError::Shape {
            param: name.to_string(),
            shape: shape.to_vec(),
        })
}

impl<B: Backend> Optimizer<B> {
    /// An optimizer with no parameters on `backend`.
    pub fn with_backend(backend: B, options: OptimizerOptions) -> Result<Self, OptimError> {
        if let Some(n) = options.max_grad_norm
            && !(n.is_finite() && n > 0.0)
        {
            return Err(OptimError::Hyperparameter {
                name: "max_grad_norm",
                value: n,
            });
        }
        Ok(Optimizer {
            backend,
            options,
            groups: Vec::new(),
            states: Vec::new(),
            layouts: Vec::new(),
            params: Vec::new(),
            names: HashMap::new(),
            global_steps: 0,
            stats: Vec::new(),
            select: Vec::new(),
            pending_plans: Vec::new(),
            specialized: true,
            plans: Vec::new(),
            flags: Vec::new(),
            call_flags: Vec::new(),
            eval: false,
            coverage: CoverageCheck::default(),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Adds a parameter group: parameters added to it take `config` (unless given their own),
    /// and [`Optimizer::set_group_lr`] sets their learning rate together. Returns its index.
    pub fn add_group(&mut self, config: impl Into<ParamConfig>) -> Result<usize, OptimError> {
        let config: ParamConfig = config.into();
        config.validate()?;
        self.groups.push(config);
        Ok(self.groups.len() - 1)
    }

    fn group_config(&self, group: usize) -> Result<ParamConfig, OptimError> {
        self.groups
            .get(group)
            .copied()
            .ok_or(OptimError::UnknownGroup(group))
    }

    /// Registers a parameter of `shape` with initial values `init` in `group`, with the group's
    /// configuration.
    pub fn add_param(
        &mut self,
        name: &str,
        shape: &[usize],
        init: &[f32],
        group: usize,
    ) -> Result<ParamId, OptimError> {
        let config = self.group_config(group)?;
        self.add_param_with(name, shape, init, group, config)
    }

    /// Registers a parameter with its own configuration (a per-parameter override of formats or
    /// hyperparameters); it still belongs to `group` for learning-rate changes.
    pub fn add_param_with(
        &mut self,
        name: &str,
        shape: &[usize],
        init: &[f32],
        group: usize,
        config: impl Into<ParamConfig>,
    ) -> Result<ParamId, OptimError> {
        let config: ParamConfig = config.into();
        self.group_config(group)?;
        config.validate()?;
        let numel = numel_of(name, shape)?;
        let resolved = config.resolve(numel, shape);
        check_init(name, init, resolved.param)?;
        let init = Init::Values(self.backend.host_input(HostValues::F32(init)));
        self.register(
            name,
            shape.to_vec(),
            init,
            group,
            config,
            resolved,
            (self.len(), 0),
        )
    }

    /// Registers a parameter whose slots are imported next (a checkpoint being loaded): fresh
    /// slots, no initial values held.
    pub(crate) fn add_param_fresh(
        &mut self,
        name: &str,
        shape: &[usize],
        group: usize,
        config: ParamConfig,
    ) -> Result<ParamId, OptimError> {
        self.group_config(group)?;
        config.validate()?;
        let numel = numel_of(name, shape)?;
        let resolved = config.resolve(numel, shape);
        self.register(
            name,
            shape.to_vec(),
            Init::Fresh,
            group,
            config,
            resolved,
            (self.len(), 0),
        )
    }

    /// Registers a parameter that lives in the caller's buffer (a framework's tensor): lpmm
    /// steps it in place and keeps no copy of it, only its other regions (a Kahan compensation,
    /// a split remainder), gradient accumulator and states. Its storage must be a framework
    /// dtype ([`crate::backend::Format::lendable`]: f32 for `F32`; bf16 for `Bf16`,
    /// `Bf16Kahan`, `SplitF32`) and `values` that buffer, whose values must be finite. Every
    /// later operation that touches the parameter takes the buffer again ([`Optimizer::step_lent`],
    /// [`Optimizer::begin_step`], [`Lender`]).
    pub fn add_lent_param(
        &mut self,
        name: &str,
        shape: &[usize],
        values: B::Input<'_>,
        group: usize,
        config: impl Into<ParamConfig>,
    ) -> Result<ParamId, OptimError> {
        let config: ParamConfig = config.into();
        self.group_config(group)?;
        config.validate()?;
        let numel = numel_of(name, shape)?;
        let resolved = config.resolve(numel, shape);
        let want = resolved.param.format().and_then(|f| f.lendable());
        let (dtype, len) = self.backend.input_info(&values);
        if want != Some(dtype) || len != numel {
            return Err(OptimError::Lent {
                param: name.to_string(),
                reason: match want {
                    None => format!(
                        "its storage {} cannot live in a caller's tensor",
                        resolved.param.describe()
                    ),
                    Some(w) => format!(
                        "its storage needs a {numel}-element {} tensor, not {len} {}",
                        w.name(),
                        dtype.name()
                    ),
                },
            });
        }
        let limit = resolved.param.format().map_or(f32::MAX, |f| f.limit());
        if !self.backend.fits(values, limit)? {
            return Err(OptimError::Lent {
                param: name.to_string(),
                reason: format!(
                    "its values are not all finite and within {limit:e}, the largest magnitude its storage {} holds",
                    resolved.param.describe()
                ),
            });
        }
        self.register(
            name,
            shape.to_vec(),
            Init::Lent,
            group,
            config,
            resolved,
            (self.len(), 0),
        )
    }

    /// Registers one shard of a logical parameter of `global_shape` for sharded data
    /// parallelism (lpmm-dist): elements `range` of it, with initial values `init`
    /// (`range.len()` of them). Formats are decided on the logical parameter's size and shape,
    /// never the shard's, and random words are keyed by (`stream`, logical element index), so a
    /// shard stores exactly the bits the unsharded parameter would hold in that range, whatever
    /// the number of shards. `range.start` must be a multiple of the resolved configuration's
    /// [`ParamConfig::shard_alignment`] (quantization blocks, packed words, random blocks and
    /// the norm's partial sums stay whole); storages with tensor-wide statistics
    /// (rank-1, factorized) only take the whole parameter. The shard's own shape is
    /// `[range.len()]`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_param_shard(
        &mut self,
        name: &str,
        global_shape: &[usize],
        range: std::ops::Range<usize>,
        init: &[f32],
        group: usize,
        config: impl Into<ParamConfig>,
        stream: usize,
    ) -> Result<ParamId, OptimError> {
        let config: ParamConfig = config.into();
        self.group_config(group)?;
        config.validate()?;
        let numel = numel_of(name, global_shape)?;
        let resolved = config.resolve(numel, global_shape);
        let whole = range.start == 0 && range.end == numel;
        let tensor_wide = !resolved.splittable();
        if range.is_empty()
            || range.end > numel
            || (!whole && (!range.start.is_multiple_of(resolved.shard_alignment()) || tensor_wide))
        {
            return Err(OptimError::Shard {
                param: name.to_string(),
                reason: format!(
                    "shard {range:?} of {numel} elements: a shard is a non-empty range starting at a multiple of {} (ParamConfig::shard_alignment), and the whole tensor when a state has tensor-wide statistics",
                    resolved.shard_alignment()
                ),
            });
        }
        check_init(name, init, resolved.param)?;
        // A whole tensor keeps its shape (rank-1 and factorized states need it).
        let shape = if whole {
            global_shape.to_vec()
        } else {
            vec![range.len()]
        };
        let init = Init::Values(self.backend.host_input(HostValues::F32(init)));
        self.register(
            name,
            shape,
            init,
            group,
            config,
            resolved,
            (stream, range.start),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn register(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        init: Init<'_, B>,
        group: usize,
        config: ParamConfig,
        resolved: ParamConfig,
        (stream, offset): (usize, usize),
    ) -> Result<ParamId, OptimError> {
        if self.names.contains_key(name) {
            return Err(OptimError::DuplicateName(name.to_string()));
        }
        let numel: usize = shape.iter().product();
        if let Init::Values(init) = &init {
            let (_, len) = self.backend.input_info(init);
            if len != numel {
                return Err(OptimError::Length {
                    param: name.to_string(),
                    what: "initial values",
                    expected: numel,
                    actual: len,
                });
            }
        }
        let (group_lr, own_lr) = (self.groups[group].hyper.lr(), config.hyper.lr());
        let lr_rule = if own_lr == group_lr {
            LrRule::Group
        } else if group_lr > 0.0 {
            LrRule::Scaled(own_lr / group_lr)
        } else {
            LrRule::Fixed
        };
        let layout = ParamLayout {
            shape,
            numel,
            formats: resolved.formats(),
            stream: stream as u64,
            offset: offset as u64,
            lent: matches!(init, Init::Lent),
        };
        let param = self.backend.allocate(&layout, init, self.options.seed)?;
        let step_plan = self.compile(&layout, &resolved);
        let index = self.states.len();
        self.names.insert(name.to_string(), index);
        self.states.push(ParamState {
            name: name.to_string(),
            group,
            requested: config,
            config: resolved,
            steps: 0,
            accumulations: 0,
            pending: false,
            lr_rule,
            rule_state: RuleState::default(),
            step_plan,
            expects_gradient: true,
            released: false,
        });
        self.layouts.push(layout);
        self.params.push(param);
        self.stats.push((ExactSum::new(), true));
        self.select.push(false);
        self.pending_plans.push(None);
        self.plans.push(None);
        self.flags.push(false);
        self.call_flags.push(false);
        Ok(ParamId(index))
    }

    /// The step plan of a parameter of `layout` with configuration `config`.
    fn compile(&self, layout: &ParamLayout, config: &ParamConfig) -> StepPlan {
        let plan = StepPlan::new(layout, &config.hyper.consts(1, &RuleState::default()));
        if self.specialized {
            plan
        } else {
            plan.generic()
        }
    }

    /// A parameter's step plan: its tensor-wide phases and the kernel of its fused pass
    /// ([`Cpu::kernel_name`] names the CPU's).
    pub fn step_plan(&self, id: ParamId) -> Result<StepPlan, OptimError> {
        Ok(self.state(id)?.step_plan)
    }

    /// Steps every parameter's fused pass with the specialized kernels where one exists (`true`,
    /// the default) or on the generic element-wise path (`false`): the same bits either way (the
    /// generic path is the reference the kernels are tested against), only speed differs. Not
    /// saved in checkpoints; [`Optimizer::load_state`] keeps this optimizer's.
    pub fn set_specialized_kernels(&mut self, on: bool) {
        self.specialized = on;
        for i in 0..self.states.len() {
            self.states[i].step_plan = self.compile(&self.layouts[i], &self.states[i].config);
        }
    }

    /// The parameter named `name`.
    pub fn param_id(&self, name: &str) -> Result<ParamId, OptimError> {
        self.names
            .get(name)
            .map(|&i| ParamId(i))
            .ok_or_else(|| OptimError::UnknownParam(name.to_string()))
    }

    /// Number of registered parameters.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// Whether no parameter is registered.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// The name of a parameter.
    pub fn name(&self, id: ParamId) -> Result<&str, OptimError> {
        Ok(&self.state(id)?.name)
    }

    /// The configuration in force for a parameter (after the minimum-size policy).
    pub fn config(&self, id: ParamId) -> Result<ParamConfig, OptimError> {
        Ok(self.state(id)?.config)
    }

    /// Whether the parameter lives in the caller's buffer ([`Optimizer::add_lent_param`]).
    pub fn is_lent(&self, id: ParamId) -> Result<bool, OptimError> {
        self.state(id)?;
        Ok(self.layouts[id.0].lent)
    }

    /// The options in force.
    pub fn options(&self) -> &OptimizerOptions {
        &self.options
    }

    /// Steps taken by `step()`.
    pub fn steps(&self) -> u64 {
        self.global_steps
    }

    /// What a step does when parameters that expect a gradient received none
    /// ([`StepReport::missing_gradients`]): ignore, warn (the default) or refuse the step. Not
    /// saved in checkpoints; [`Optimizer::load_state`] keeps this optimizer's.
    pub fn set_missing_gradient(&mut self, policy: MissingGradientPolicy) {
        self.coverage.set_policy(policy);
    }

    /// The missing-gradient policy in force.
    pub fn missing_gradient(&self) -> MissingGradientPolicy {
        self.coverage.policy()
    }

    /// The likely causes and instructions that the missing-gradient warning and error give: a
    /// framework integration names its own operators and API here
    /// ([`MissingGradientHelp::CORE`] by default).
    pub fn set_missing_gradient_help(&mut self, help: MissingGradientHelp) {
        self.coverage.set_help(help);
    }

    /// Whether parameter `id` is expected to receive a gradient in every step (the default), or
    /// may go without one — frozen on purpose while registered, or used only in some steps — and
    /// is then never counted in [`StepReport::missing_gradients`]. A parameter that does receive
    /// a gradient still steps. Not saved in checkpoints; [`Optimizer::load_state`] keeps it.
    pub fn set_expects_gradient(&mut self, id: ParamId, expects: bool) -> Result<(), OptimError> {
        self.state(id)?;
        self.states[id.0].expects_gradient = expects;
        Ok(())
    }

    /// Whether parameter `id` is expected to receive a gradient in every step
    /// ([`Optimizer::set_expects_gradient`]).
    pub fn expects_gradient(&self, id: ParamId) -> Result<bool, OptimError> {
        Ok(self.state(id)?.expects_gradient)
    }

    /// Whether parameter `id` received a gradient since the last step: accumulated (pending), or
    /// taken by a released step. A step from accumulators counts it as covered exactly when this
    /// is true.
    pub fn received_gradient(&self, id: ParamId) -> Result<bool, OptimError> {
        let m = self.state(id)?;
        Ok(m.pending || m.released)
    }

    /// Keeps `other`'s settings that checkpoints do not hold (the missing-gradient policy, which
    /// parameters expect a gradient, the specialized kernels on or off) across a load that
    /// rebuilds the optimizer.
    pub(crate) fn keep_settings(&mut self, other: &Self) {
        self.coverage = other.coverage.clone();
        for (m, o) in self.states.iter_mut().zip(&other.states) {
            m.expects_gradient = o.expects_gradient;
        }
        if self.specialized != other.specialized {
            self.set_specialized_kernels(other.specialized);
        }
    }

    /// A step went ahead: released steps before it are accounted for.
    fn forget_released(&mut self) {
        for m in &mut self.states {
            m.released = false;
        }
    }

    pub(crate) fn state(&self, id: ParamId) -> Result<&ParamState, OptimError> {
        self.states
            .get(id.0)
            .ok_or_else(|| OptimError::UnknownParam(format!("#{}", id.0)))
    }

    /// Sets the learning rate of every parameter.
    pub fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
        for g in 0..self.groups.len() {
            self.set_group_lr(g, lr)?;
        }
        Ok(())
    }

    /// Sets the learning rate of `group`, effective from the next step. Parameters that follow
    /// the group take `lr`; a parameter registered with its own learning rate keeps its ratio to
    /// the group's (`LrRule::Scaled`), or keeps its learning rate if the group's was 0 when it was
    /// registered (`LrRule::Fixed`).
    pub fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<(), OptimError> {
        self.group_config(group)?;
        let valid = |v: f64| v.is_finite() && v >= 0.0 && (v as f32).is_finite();
        if !valid(lr) {
            return Err(OptimError::Hyperparameter {
                name: "lr",
                value: lr,
            });
        }
        // Check every resulting rate before changing anything.
        for m in self.states.iter().filter(|m| m.group == group) {
            if let LrRule::Scaled(k) = m.lr_rule
                && !valid(lr * k)
            {
                return Err(OptimError::Hyperparameter {
                    name: "lr",
                    value: lr * k,
                });
            }
        }
        self.groups[group].hyper.set_lr(lr);
        for m in self.states.iter_mut().filter(|m| m.group == group) {
            let own = match m.lr_rule {
                LrRule::Group => lr,
                LrRule::Scaled(k) => lr * k,
                LrRule::Fixed => continue,
            };
            m.config.hyper.set_lr(own);
            m.requested.hyper.set_lr(own);
        }
        Ok(())
    }

    fn check_len(&self, id: ParamId, what: &'static str, len: usize) -> Result<(), OptimError> {
        let state = self.state(id)?;
        let numel = self.layouts[id.0].numel;
        if len != numel {
            return Err(OptimError::Length {
                param: state.name.clone(),
                what,
                expected: numel,
                actual: len,
            });
        }
        Ok(())
    }

    /// Adds a micro-batch gradient into the parameter's gradient accumulator (in its storage
    /// format, stochastically rounded if configured so). The next step consumes and resets it.
    /// A float accumulator (f32, bf16) keeps what it cannot represent as ±Inf or NaN — a
    /// non-finite micro-batch, or a sum beyond its range — for the step's non-finite policy,
    /// which reports the parameter. A quantized accumulator cannot hold such values: a
    /// non-finite micro-batch ([`OptimError::Quant`] naming the element), or one whose sum with
    /// what the accumulator holds would overflow ([`OptimError::AccumulatorOverflow`]), is
    /// refused and nothing changes.
    pub fn accumulate(&mut self, id: ParamId, grad: &[f32]) -> Result<(), OptimError> {
        self.check_len(id, "gradient", grad.len())?;
        if self.layouts[id.0]
            .format(SlotKind::Grad)
            .is_some_and(|f| !f.holds_non_finite())
            && let Some(index) = grad.iter().position(|v| !v.is_finite())
        {
            return Err(lpmm_quant::QuantError::NonFinite {
                index,
                value: grad[index],
            }
            .into());
        }
        let grad = self.backend.host_input(HostValues::F32(grad));
        self.accumulate_input(id, grad)
    }

    /// [`Optimizer::accumulate`] from a buffer in the backend's memory (a framework's gradient
    /// tensor: no copy through the host on a device backend), f32 or bf16.
    pub fn accumulate_input(&mut self, id: ParamId, grad: B::Input<'_>) -> Result<(), OptimError> {
        let (_, len) = self.backend.input_info(&grad);
        self.check_len(id, "gradient", len)?;
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

    /// Reads the parameter's current value as f32 into `out`.
    pub fn read_param(&self, id: ParamId, out: &mut [f32]) -> Result<(), OptimError> {
        self.read_slot(id, SlotKind::Param, out)
    }

    fn read_slot(&self, id: ParamId, slot: SlotKind, out: &mut [f32]) -> Result<(), OptimError> {
        self.check_len(id, "output", out.len())?;
        let out = self.backend.host_output(HostValuesMut::F32(out));
        self.backend
            .read(&self.params[id.0], &self.layouts[id.0], slot, out)?;
        Ok(())
    }

    /// Decodes one slot into a buffer of the backend's (f32 or bf16).
    pub fn read_into(
        &self,
        id: ParamId,
        slot: SlotKind,
        out: B::Output<'_>,
    ) -> Result<(), OptimError> {
        let (_, len) = self.backend.output_info(&out);
        self.check_len(id, "output", len)?;
        self.backend
            .read(&self.params[id.0], &self.layouts[id.0], slot, out)?;
        Ok(())
    }

    /// One slot of the parameter in the canonical host layout (the stored bits, unsharded): what a
    /// checkpoint holds, and how two backends are compared bit for bit. A lent parameter's
    /// parameter slot needs its buffer: [`Optimizer::export_slot_lent`].
    pub fn export_slot(&self, id: ParamId, slot: SlotKind) -> Result<HostSlot, OptimError> {
        self.export_slot_lent(id, slot, None)
    }

    /// [`Optimizer::export_slot`] with a lent parameter's buffer.
    pub fn export_slot_lent(
        &self,
        id: ParamId,
        slot: SlotKind,
        lent: Option<B::Input<'_>>,
    ) -> Result<HostSlot, OptimError> {
        self.state(id)?;
        Ok(self
            .backend
            .export(&self.params[id.0], &self.layouts[id.0], slot, lent)?)
    }

    /// Sets a parameter's rule state ([`RuleState`]: schedule-free AdamW's averaging weights),
    /// as a checkpoint restores it with [`Optimizer::restore`]. It must be finite and
    /// non-negative.
    pub fn restore_rule_state(&mut self, id: ParamId, state: RuleState) -> Result<(), OptimError> {
        self.state(id)?;
        if !state.valid() {
            let value = state.0.into_iter().find(|x| !(x.is_finite() && *x >= 0.0));
            return Err(OptimError::Hyperparameter {
                name: "rule state",
                value: value.unwrap_or(f64::NAN),
            });
        }
        self.states[id.0].rule_state = state;
        Ok(())
    }

    /// A parameter's rule state ([`RuleState`]).
    pub fn rule_state(&self, id: ParamId) -> Result<RuleState, OptimError> {
        Ok(self.state(id)?.rule_state)
    }

    /// Whether the parameters hold their evaluation point ([`Optimizer::eval`]).
    pub fn in_eval(&self) -> bool {
        self.eval
    }

    /// Moves every parameter whose rule evaluates at another point than it trains at
    /// (schedule-free AdamW: from `y` to the average `x`, the `schedulefree` package's
    /// `optimizer.eval()`) to its evaluation point; other parameters do not change. Steps are
    /// refused ([`OptimError::EvalMode`]) until [`Optimizer::train`]. Stored values round as the
    /// parameter's storage rounds (stochastic rounding draws from a stream no step uses), so a
    /// low-precision `y` comes back within its rounding, not bit for bit. A no-op in
    /// evaluation mode. Lent parameters need their buffers: [`Optimizer::eval_lent`].
    pub fn eval(&mut self) -> Result<(), OptimError> {
        self.transform(true, None)
    }

    /// Back to the training point ([`Optimizer::eval`]'s inverse: `train()`).
    pub fn train(&mut self) -> Result<(), OptimError> {
        self.transform(false, None)
    }

    /// [`Optimizer::eval`] with the buffers of lent parameters.
    pub fn eval_lent(&mut self, lender: &mut dyn Lender<B>) -> Result<(), OptimError> {
        self.transform(true, Some(lender))
    }

    /// [`Optimizer::train`] with the buffers of lent parameters.
    pub fn train_lent(&mut self, lender: &mut dyn Lender<B>) -> Result<(), OptimError> {
        self.transform(false, Some(lender))
    }

    /// The parameters a mode change moves.
    fn transforms(&self, eval: bool) -> Vec<(usize, ParamStep)> {
        self.states
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                let rule = m.config.hyper.transform(eval)?;
                Some((
                    i,
                    ParamStep {
                        plan: m.step_plan,
                        // Counters no step reaches (steps stay below 2^53).
                        t: TRANSFORM_COUNTER + 2 * m.steps + u64::from(eval),
                        flags: StepFlags(StepFlags::UPDATE_PARAM | StepFlags::TRANSFORM),
                        rule,
                        clip: 1.0,
                    },
                ))
            })
            .collect()
    }

    fn transform(
        &mut self,
        eval: bool,
        mut lender: Option<&mut dyn Lender<B>>,
    ) -> Result<(), OptimError> {
        if self.eval == eval {
            return Ok(());
        }
        let moves = self.transforms(eval);
        if let Some(&(i, _)) = moves
            .iter()
            .find(|(i, _)| self.layouts[*i].lent && lender.is_none())
        {
            return Err(self.unlent(i));
        }
        self.plans.iter_mut().for_each(|p| *p = None);
        for &(i, plan) in &moves {
            if !self.layouts[i].lent {
                self.plans[i] = Some(plan);
            }
        }
        if self.plans.iter().any(Option::is_some) {
            self.run_plans(None, &mut [])?;
        }
        for &(i, plan) in &moves {
            if !self.layouts[i].lent {
                continue;
            }
            let id = ParamId(i);
            let lender = lender.as_deref_mut().expect("checked above");
            lender.lend_mut(id, &mut |buf| {
                self.plans.iter_mut().for_each(|p| *p = None);
                self.plans[i] = Some(plan);
                self.run_plans(None, &mut [(id, buf)])
            })?;
        }
        self.eval = eval;
        Ok(())
    }

    /// Reads a state (1, 2 or 3) of the parameter as f32 into `out` (zeros if the optimizer has
    /// no such state); any other index is [`OptimError::UnknownState`].
    pub fn read_state(&self, id: ParamId, state: usize, out: &mut [f32]) -> Result<(), OptimError> {
        let slot = match state {
            1 => SlotKind::State1,
            2 => SlotKind::State2,
            3 => SlotKind::State3,
            other => return Err(OptimError::UnknownState(other)),
        };
        self.read_slot(id, slot, out)
    }

    /// Replaces one slot of a parameter with host contents in the canonical layout of its
    /// storage (checkpoints, shards assembled by lpmm-dist); a mismatch leaves it unchanged.
    pub fn import_slot(
        &mut self,
        id: ParamId,
        slot: SlotKind,
        host: HostSlot,
    ) -> Result<(), OptimError> {
        self.import_slot_lent(id, slot, &host, None)
    }

    /// [`Optimizer::import_slot`] with a lent parameter's buffer.
    pub fn import_slot_lent(
        &mut self,
        id: ParamId,
        slot: SlotKind,
        host: &HostSlot,
        lent: Option<B::Output<'_>>,
    ) -> Result<(), OptimError> {
        let name = self.state(id)?.name.clone();
        let layout = &self.layouts[id.0];
        let fail = |reason: String| OptimError::Slot {
            param: name.clone(),
            reason: format!("{} slot: {reason}", slot.name()),
        };
        match layout.format(slot) {
            None if !host.is_empty() => {
                return Err(fail("the configuration has no such slot".into()));
            }
            None => return Ok(()),
            Some(f) => f
                .validate(host, &layout.shape, layout.numel, slot != SlotKind::Grad)
                .map_err(fail)?,
        }
        self.backend
            .import(&mut self.params[id.0], layout, slot, host, lent)?;
        Ok(())
    }

    /// Sets a parameter's counters (which position its random streams) and learning-rate rule,
    /// as a checkpoint recorded them. Counters beyond [`MAX_COUNTER`], a scaled rule whose factor
    /// is not finite and positive, and a pending gradient without an accumulator are refused.
    pub fn restore(
        &mut self,
        id: ParamId,
        steps: u64,
        accumulations: u64,
        pending: bool,
        lr_rule: LrRule,
    ) -> Result<(), OptimError> {
        let name = &self.state(id)?.name;
        check_counter(|| format!("parameter {name}'s step counter"), steps)?;
        check_counter(
            || format!("parameter {name}'s accumulation counter"),
            accumulations,
        )?;
        if let LrRule::Scaled(k) = lr_rule
            && !(k.is_finite() && k > 0.0)
        {
            return Err(OptimError::Hyperparameter {
                name: "learning-rate scale",
                value: k,
            });
        }
        if pending && self.layouts[id.0].format(SlotKind::Grad).is_none() {
            return Err(OptimError::NoAccumulator(name.clone()));
        }
        let m = &mut self.states[id.0];
        m.steps = steps;
        m.accumulations = accumulations;
        m.pending = pending;
        m.lr_rule = lr_rule;
        Ok(())
    }

    /// Sets the count of `step()` calls (a checkpoint's); beyond [`MAX_COUNTER`] it is refused.
    pub fn set_steps(&mut self, steps: u64) -> Result<(), OptimError> {
        check_counter(|| "the step counter".into(), steps)?;
        self.global_steps = steps;
        Ok(())
    }

    /// Refuses a step that would take the global counter, or the step counter of a parameter
    /// with `takes_part`, past [`MAX_COUNTER`] (before anything changes).
    /// In evaluation mode no parameter steps.
    fn check_training(&self) -> Result<(), OptimError> {
        if self.eval {
            return Err(OptimError::EvalMode);
        }
        Ok(())
    }

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

    /// Steps every parameter whose accumulator holds gradients, consuming them. Lent parameters
    /// need their buffers: [`Optimizer::step_lent`].
    pub fn step(&mut self) -> Result<StepReport, OptimError> {
        let step = self.begin_step()?;
        self.finish_step(step)
    }

    /// [`Optimizer::step`] with the buffers of lent parameters (each stepped in place).
    pub fn step_lent(
        &mut self,
        lent: &mut [(ParamId, B::Output<'_>)],
    ) -> Result<StepReport, OptimError> {
        let step = self.begin_step()?;
        if !step.skipped() {
            self.step_part(&step, lent)?;
        }
        self.finish_step(step)
    }

    /// The first part of a step that a caller drives parameter by parameter (a framework that
    /// lends one tensor at a time): the gradient pre-pass and its decision (skip, clip), with no
    /// parameter moved yet. Then [`Optimizer::step_part`] for lent parameters (in any order,
    /// each at most once) and [`Optimizer::finish_step`], which steps every other participant.
    pub fn begin_step(&mut self) -> Result<StepInProgress, OptimError> {
        // Pre-pass over the gradients when the norm is needed (clipping) or the step may be
        // skipped: one read of each accumulator.
        if self.options.max_grad_norm.is_some()
            || self.options.non_finite == NonFinitePolicy::SkipStep
        {
            let local = self.gradient_summary()?;
            let any = !local.non_finite.is_empty();
            self.begin_with_summary(Some((local.sum, any)), local.non_finite)
        } else {
            for (s, m) in self.select.iter_mut().zip(&self.states) {
                *s = m.pending;
            }
            self.begin_with_summary(None, Vec::new())
        }
    }

    /// Steps the given participants of a begun step, lent ones in their buffers.
    pub fn step_part(
        &mut self,
        step: &StepInProgress,
        part: &mut [(ParamId, B::Output<'_>)],
    ) -> Result<(), OptimError> {
        if step.skipped() {
            return Ok(());
        }
        for (id, _) in part.iter() {
            self.state(*id)?;
            if self.pending_plans[id.0].is_none() {
                return Err(OptimError::Lent {
                    param: self.states[id.0].name.clone(),
                    reason: "it has no gradient in this step, or was stepped already".into(),
                });
            }
        }
        self.plans.iter_mut().for_each(|p| *p = None);
        for (id, _) in part.iter() {
            self.plans[id.0] = self.pending_plans[id.0].take();
        }
        self.run_plans(None, part)
    }

    /// Finishes a begun step: steps every participant not stepped by [`Optimizer::step_part`]
    /// (a lent one left out is an error naming it) and reports.
    pub fn finish_step(&mut self, step: StepInProgress) -> Result<StepReport, OptimError> {
        let StepInProgress { mut report, .. } = step;
        if report.skipped {
            return Ok(report);
        }
        if let Some(i) = self
            .pending_plans
            .iter()
            .zip(&self.layouts)
            .position(|(p, l)| p.is_some() && l.lent)
        {
            return Err(OptimError::Lent {
                param: self.states[i].name.clone(),
                reason: "it takes part in this step but its buffer was not lent (step_lent or step_part)"
                    .into(),
            });
        }
        std::mem::swap(&mut self.plans, &mut self.pending_plans);
        self.run_plans(None, &mut [])?;
        for (index, state) in self.states.iter_mut().enumerate() {
            if self.select[index] {
                self.select[index] = false;
                if self.flags[index] && !report.non_finite.contains(&ParamId(index)) {
                    report.non_finite.push(ParamId(index));
                }
                report.updated += 1;
                state.stepped();
                state.pending = false;
            }
        }
        self.global_steps += 1;
        Ok(report)
    }

    /// Runs the backend's step on `self.plans` (cleared after), folding its non-finite flags
    /// into `self.flags` (cleared when a step begins).
    fn run_plans(
        &mut self,
        released: Option<(usize, B::Input<'_>)>,
        lent: &mut [(ParamId, B::Output<'_>)],
    ) -> Result<(), OptimError> {
        let result = self.backend.step(StepWork {
            params: &mut self.params,
            layouts: &self.layouts,
            plans: &self.plans,
            released,
            lent,
            seed: self.options.seed,
            non_finite: &mut self.call_flags,
        });
        for ((f, &c), p) in self.flags.iter_mut().zip(&self.call_flags).zip(&self.plans) {
            if p.is_some() {
                *f |= c;
            }
        }
        self.plans.iter_mut().for_each(|p| *p = None);
        Ok(result?)
    }

    /// A step whose gradients come from the caller's buffers (a framework's gradient tensors
    /// after a backward pass: no accumulator is needed and no copy is made), together with
    /// every parameter whose accumulator holds gradients (e.g. accumulated during the backward
    /// pass by a layer over an lpmm parameter). The policies keep their meaning over all of them
    /// — the exact global norm for clipping, all or nothing under SkipStep — and each given
    /// gradient is released (`Gradients::consumed`) as soon as its parameter has stepped, so the
    /// caller can drop it parameter by parameter. Lent parameters get their buffers from
    /// `lender`. A parameter cannot take both a given gradient and an accumulated one (an error
    /// naming it; nothing moves).
    pub fn step_gradients(
        &mut self,
        grads: &mut dyn Gradients<B>,
        mut lender: Option<&mut dyn Lender<B>>,
    ) -> Result<StepReport, OptimError> {
        let n = self.len();
        let need_stats = self.options.max_grad_norm.is_some()
            || self.options.non_finite == NonFinitePolicy::SkipStep;
        let mut report = StepReport::default();
        let mut sum = ExactSum::new();
        let mut given = vec![false; n];
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
                if need_stats {
                    let (s, finite) = backend.input_stats(g)?;
                    sum.merge(&s);
                    if !finite {
                        report.non_finite.push(id);
                    }
                }
                Ok(())
            })?;
        }
        // Every parameter taking part (given or accumulated) must have a step left.
        self.check_step_counters(|i| given[i] || self.states[i].pending)?;
        // Coverage, before anything moves (no gradient has been consumed yet).
        let missing = missing_gradients(&self.states, |i| given[i] || self.states[i].pending);
        self.coverage.check(&missing, self.global_steps + 1)?;
        self.forget_released();
        report.missing_gradients = missing;
        // The accumulated ones.
        for (s, m) in self.select.iter_mut().zip(&self.states) {
            *s = m.pending;
        }
        if need_stats && self.select.iter().any(|&s| s) {
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
        let mut clip = 1.0f32;
        if need_stats {
            let norm = sum.to_f64().sqrt();
            report.grad_norm = Some(norm);
            if let Some(max) = self.options.max_grad_norm
                && norm.is_finite()
                && norm > max
            {
                clip = (max / (norm + 1e-6)) as f32;
            }
            if !report.non_finite.is_empty() && self.options.non_finite == NonFinitePolicy::SkipStep
            {
                report.skipped = true;
                for (i, &g) in given.iter().enumerate() {
                    if g {
                        grads.consumed(ParamId(i));
                    }
                }
                for (m, s) in self.states.iter_mut().zip(self.select.iter_mut()) {
                    m.pending = false;
                    *s = false;
                }
                self.backend
                    .clear_gradients(&mut self.params, &self.layouts, None)?;
                return Ok(report);
            }
        }
        let plan = |state: &ParamState| state.plan(StepFlags(StepFlags::UPDATE_PARAM), clip);
        self.flags.iter_mut().for_each(|f| *f = false);
        // Accumulated gradients: every held parameter in one call, lent ones one at a time.
        self.plans.iter_mut().for_each(|p| *p = None);
        for i in 0..n {
            if self.select[i] && !self.layouts[i].lent {
                self.plans[i] = Some(plan(&self.states[i]));
            }
        }
        if self.plans.iter().any(Option::is_some) {
            self.run_plans(None, &mut [])?;
        }
        for i in 0..n {
            if !(self.select[i] && self.layouts[i].lent) {
                continue;
            }
            let id = ParamId(i);
            self.plans[i] = Some(plan(&self.states[i]));
            let Some(lender) = lender.as_deref_mut() else {
                return Err(self.unlent(i));
            };
            lender.lend_mut(id, &mut |buf| self.run_plans(None, &mut [(id, buf)]))?;
        }
        // Given gradients, released as they are consumed.
        for i in (0..n).filter(|&i| given[i]) {
            let id = ParamId(i);
            self.plans.iter_mut().for_each(|p| *p = None);
            self.plans[i] = Some(plan(&self.states[i]));
            let lent = self.layouts[i].lent;
            grads.gradient(id, &mut |g| {
                let Some(g) = g else { return Ok(()) };
                if !lent {
                    return self.run_plans(Some((i, g)), &mut []);
                }
                let Some(lender) = lender.as_deref_mut() else {
                    return Err(self.unlent(i));
                };
                lender.lend_mut(id, &mut |buf| {
                    self.run_plans(Some((i, g)), &mut [(id, buf)])
                })
            })?;
            grads.consumed(id);
        }
        for (i, &was_given) in given.iter().enumerate().take(n) {
            if was_given || self.select[i] {
                let id = ParamId(i);
                if self.flags[i] && !report.non_finite.contains(&id) {
                    report.non_finite.push(id);
                }
                let m = &mut self.states[i];
                m.stepped();
                m.pending = false;
                self.select[i] = false;
                report.updated += 1;
            }
        }
        self.global_steps += 1;
        Ok(report)
    }

    fn unlent(&self, i: usize) -> OptimError {
        OptimError::Lent {
            param: self.states[i].name.clone(),
            reason: "it takes part in this step but no lender was given".into(),
        }
    }

    /// The first half of a step split across ranks (lpmm-dist): marks every parameter with
    /// pending gradients as taking part and returns the exact sum of squares of their finite
    /// gradient values and the parameters whose gradients are not all finite. Sums from several
    /// optimizers (the shards of one model) add exactly ([`ExactSum::merge`], or an integer
    /// all-reduce of [`ExactSum::to_words`]) to the unsharded model's sum, bit for bit.
    pub fn gradient_summary(&mut self) -> Result<GradientSummary, OptimError> {
        for (s, m) in self.select.iter_mut().zip(&self.states) {
            *s = m.pending;
        }
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
        Ok(summary)
    }

    /// The second half of a split step, after [`Optimizer::gradient_summary`]: steps with the
    /// whole model's sum of squares (the norm for clipping) and whether any part of the model
    /// has a non-finite gradient (the SkipStep decision), as `step` would on the unsharded
    /// model. `local_non_finite` is this optimizer's part, reported back. `global` is `None`
    /// when neither clipping nor SkipStep needs the pre-pass.
    pub fn step_with_summary(
        &mut self,
        global: Option<(ExactSum, bool)>,
        local_non_finite: Vec<ParamId>,
    ) -> Result<StepReport, OptimError> {
        let step = self.begin_with_summary(global, local_non_finite)?;
        self.finish_step(step)
    }

    /// The decision of a step from the global summary: the norm, the clip factor, a skip (which
    /// consumes every gradient), or the plans of the participants (`self.select`).
    fn begin_with_summary(
        &mut self,
        global: Option<(ExactSum, bool)>,
        local_non_finite: Vec<ParamId>,
    ) -> Result<StepInProgress, OptimError> {
        self.check_step_counters(|i| self.select[i])?;
        let missing = missing_gradients(&self.states, |i| self.select[i]);
        if let Err(e) = self.coverage.check(&missing, self.global_steps + 1) {
            // Refused before anything moved; the participants are chosen again next time.
            self.select.iter_mut().for_each(|s| *s = false);
            return Err(e);
        }
        self.forget_released();
        let mut report = StepReport {
            non_finite: local_non_finite,
            missing_gradients: missing,
            ..StepReport::default()
        };
        let mut clip = 1.0f32;
        if let Some((sum, any_non_finite)) = global {
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
                for (m, s) in self.states.iter_mut().zip(self.select.iter_mut()) {
                    m.pending = false;
                    *s = false;
                }
                self.backend
                    .clear_gradients(&mut self.params, &self.layouts, None)?;
                return Ok(StepInProgress { report, clip });
            }
        }
        self.flags.iter_mut().for_each(|f| *f = false);
        for ((plan, &s), state) in self
            .pending_plans
            .iter_mut()
            .zip(&self.select)
            .zip(&self.states)
        {
            *plan = s.then(|| state.plan(StepFlags(StepFlags::UPDATE_PARAM), clip));
        }
        Ok(StepInProgress { report, clip })
    }

    /// Gradient release: steps one parameter now with `grad` (plus anything its accumulator
    /// holds), so a training loop can step each parameter from its backward hook and never hold
    /// all gradients. Global-norm clipping needs every gradient and is not applied here.
    pub fn step_param(&mut self, id: ParamId, grad: &[f32]) -> Result<StepReport, OptimError> {
        self.check_len(id, "gradient", grad.len())?;
        let grad = self.backend.host_input(HostValues::F32(grad));
        self.release_step(id, grad, true, None)
    }

    /// [`Optimizer::step_param`] with the gradient in the backend's memory and, for a lent
    /// parameter, its buffer.
    pub fn step_param_input<'l>(
        &mut self,
        id: ParamId,
        grad: B::Input<'l>,
        lent: Option<B::Output<'l>>,
    ) -> Result<StepReport, OptimError> {
        self.release_step(id, grad, true, lent)
    }

    /// Optimizer accumulation (optimi's, after Zhang et al.'s AdamAccumulation): folds a
    /// micro-batch gradient straight into the optimizer states — the rule's state update with
    /// this gradient, the step counter advancing — without weight decay and without moving the
    /// parameter. Finish the accumulation with [`Optimizer::step_param`] on the last micro-batch.
    /// With gradient storage `None` no gradient memory is ever held.
    pub fn accumulate_states(
        &mut self,
        id: ParamId,
        grad: &[f32],
    ) -> Result<StepReport, OptimError> {
        self.check_len(id, "gradient", grad.len())?;
        let grad = self.backend.host_input(HostValues::F32(grad));
        self.release_step(id, grad, false, None)
    }

    /// [`Optimizer::accumulate_states`] with the gradient in the backend's memory and, for a
    /// lent parameter, its buffer (read for Adam's L2 penalty; not moved).
    pub fn accumulate_states_input<'l>(
        &mut self,
        id: ParamId,
        grad: B::Input<'l>,
        lent: Option<B::Output<'l>>,
    ) -> Result<StepReport, OptimError> {
        self.release_step(id, grad, false, lent)
    }

    fn release_step<'l>(
        &mut self,
        id: ParamId,
        grad: B::Input<'l>,
        update_param: bool,
        lent: Option<B::Output<'l>>,
    ) -> Result<StepReport, OptimError> {
        let (_, len) = self.backend.input_info(&grad);
        self.check_len(id, "gradient", len)?;
        if self.layouts[id.0].lent != lent.is_some() {
            return Err(OptimError::Lent {
                param: self.states[id.0].name.clone(),
                reason: if lent.is_some() {
                    "a buffer was lent for a parameter lpmm holds".into()
                } else {
                    "it is lent: pass its buffer".into()
                },
            });
        }
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
        // The gradient is `grad` plus whatever the accumulator holds: both must be finite.
        let mut finite = self.backend.finite(grad)?;
        if self.states[id.0].pending {
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
            if self.options.non_finite == NonFinitePolicy::SkipStep {
                // Skipped and consumed, as `step` does.
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
        ));
        self.flags[id.0] = false;
        match lent {
            Some(l) => self.run_plans(Some((id.0, grad)), &mut [(id, l)])?,
            None => self.run_plans(Some((id.0, grad)), &mut [])?,
        }
        if self.flags[id.0] && !report.non_finite.contains(&id) {
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

impl From<BackendError> for OptimError {
    fn from(e: BackendError) -> Self {
        OptimError::Backend(e)
    }
}
