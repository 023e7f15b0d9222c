//! The optimizer: parameters registered with their configuration, micro-batch gradient
//! accumulation, the step, gradient release, learning-rate control, clipping and the
//! non-finite-gradient policy. The step's schedule is the executor's ([`crate::exec`]), the
//! numeric work the backend's ([`crate::backend::Backend`]); the CPU backend defines the
//! semantics. What integrations and backends need beyond a training loop's API is in
//! [`Parts`] and [`PartsMut`].

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::backend::{
    Backend, BackendError, F32_MAX_BITS, HostSlot, HostValues, Init, MatrixShape, ParamId,
    ParamLayout, ParamStep, RuleState, SlotKind, StepFlags, StepPlan, fits,
};
use crate::config::ParamConfig;
use crate::coverage::{CoverageCheck, MissingGradients};
use crate::cpu::Cpu;
use crate::error::OptimError;
use crate::exact::ExactSum;
use crate::format::Storage;

mod info;
mod parts;
mod step;

pub use crate::lent::{Lender, Lent};
pub use info::{Mode, Out, ParamInfo, ParamKey, Settings, Status};
pub use parts::{Parts, PartsMut};
pub use step::{Accumulated, Grad, Gradients, Step, WithGradient};

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

/// A rule state a checkpoint may hold ([`RuleState::valid`]).
pub(crate) fn check_rule_state(state: RuleState) -> Result<(), OptimError> {
    if !state.valid() {
        let value = state.0.into_iter().find(|x| !(x.is_finite() && *x >= 0.0));
        return Err(OptimError::Hyperparameter {
            name: "rule state",
            value: value.unwrap_or(f64::NAN),
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
    /// the others (bitsandbytes skips such elements too, but zeroes their states). The step
    /// finds them as it goes: without global-norm clipping the gradients are not read before it.
    SkipElements,
}

/// Settings that apply to the whole optimizer: `OptimizerOptions::default()` (seed 0, no
/// clipping, skip a step with a non-finite gradient), changed with the `with_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// Parameters whose gradient held a non-finite value (under
    /// [`NonFinitePolicy::SkipElements`], as the step found them: also a parameter with an
    /// element left unchanged because its update did not fit its slot).
    pub non_finite: Vec<ParamId>,
    /// The global gradient norm, when it was computed (clipping or the skip policy).
    pub grad_norm: Option<f64>,
    /// The parameters that expect a gradient and received none in this step: a step from
    /// accumulators ([`Step::accumulated`], [`Step::summarized`]) counts those not accumulated
    /// since the last step; [`Step::given`] those the source has no gradient for and that hold
    /// none accumulated. A parameter stepped by a released step ([`Step::param`],
    /// [`Step::states_only`]) since the last step counts as covered; a released step itself is
    /// not a check (`checked` 0). Parameters excluded with
    /// [`Optimizer::set_expects_gradient`] are not counted.
    pub missing_gradients: MissingGradients,
}

/// This optimizer's part of a step's gradient pre-pass ([`PartsMut::gradient_summary`]).
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
    /// A released step (`Step::param`, `Step::states_only`) took a gradient for it since the last
    /// step: it counts as covered.
    pub released: bool,
}

impl ParamState {
    /// The plan of the parameter's next step (on the generic path where `settings` turn the
    /// specialized kernels off).
    pub fn plan(&self, flags: StepFlags, clip: f32, settings: &Settings) -> ParamStep {
        let (hyper, t) = (&self.config.hyper, self.steps + 1);
        ParamStep {
            plan: settings.plan(self.step_plan),
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

/// The random-stream counters of [`Optimizer::set_mode`] start here:
/// `2^62 + 2 steps + 1` for the move to evaluation, `2^62 + 2 steps` back.
pub(crate) const TRANSFORM_COUNTER: u64 = 1 << 62;

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
    given: Vec<bool>,
    /// What checkpoints do not hold ([`Optimizer::settings_mut`]).
    pub(crate) settings: Settings,
    plans: Vec<Option<ParamStep>>,
    /// The step executor's scratch ([`crate::exec`]).
    exec: crate::exec::Scratch,
    /// The matrix phase's workspace, allocated at registration for the largest matrix whose
    /// rule takes the phase, and its capacity (elements, `m × m` elements).
    matrices: Option<B::Matrices>,
    matrix_capacity: (usize, usize),
    /// The parameters hold their evaluation point ([`Mode::Eval`]): no step until
    /// [`Optimizer::set_mode`] with [`Mode::Train`].
    pub(crate) eval: bool,
    /// The missing-gradient check and the set it warned about last (its policy and help are
    /// the settings').
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
            given: Vec::new(),
            settings: Settings::default(),
            plans: Vec::new(),
            exec: Default::default(),
            matrices: None,
            matrix_capacity: (0, 0),
            eval: false,
            coverage: CoverageCheck::default(),
        })
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
            (self.states.len(), 0),
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
            (self.states.len(), 0),
        )
    }

    /// Registers a parameter that lives in the caller's buffer (a framework's tensor): lpmm
    /// steps it in place and keeps no copy of it, only its other regions (a Kahan compensation,
    /// a split remainder), gradient accumulator and states. Its storage must be a framework
    /// dtype ([`crate::backend::Format::lendable`]: f32 for `F32`; bf16 for `Bf16`,
    /// `Bf16Kahan`, `SplitF32`) and `values` that buffer, whose values must be finite. Every
    /// later operation that touches the parameter takes the buffer again ([`Lent`]).
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
            (self.states.len(), 0),
        )
    }

    /// Registers one shard of a logical parameter ([`PartsMut::add_param_shard`]): elements `range` of it, with initial values `init`
    /// (`range.len()` of them). Formats are decided on the logical parameter's size and shape,
    /// never the shard's, and random words are keyed by (`stream`, logical element index), so a
    /// shard stores exactly the bits the unsharded parameter would hold in that range, whatever
    /// the number of shards. `range.start` must be a multiple of the resolved configuration's
    /// [`ParamConfig::shard_alignment`] (quantization blocks, packed words, random blocks and
    /// the norm's partial sums stay whole); storages with tensor-wide statistics
    /// (rank-1, factorized) only take the whole parameter. The shard's own shape is
    /// `[range.len()]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_param_shard(
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
        let step_plan = Self::compile(&layout, &resolved);
        if step_plan.has_matrix() {
            self.fit_matrices(name, &layout.shape, &resolved)?;
        }
        let param = self.backend.allocate(&layout, init, self.options.seed)?;
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
        self.given.push(false);
        self.plans.push(None);
        self.exec.push();
        Ok(ParamId(index))
    }

    /// A rule with a matrix phase steps matrices only, and the workspace must hold this one's
    /// (a bigger one is allocated in place of the old, before anything is registered).
    fn fit_matrices(
        &mut self,
        name: &str,
        shape: &[usize],
        config: &ParamConfig,
    ) -> Result<(), OptimError> {
        let matrix = MatrixShape::of(shape).ok_or_else(|| OptimError::NotAMatrix {
            param: name.to_string(),
            rule: config.hyper.name(),
            shape: shape.to_vec(),
        })?;
        let (elements, square) = self.matrix_capacity;
        if self.matrices.is_some() && matrix.numel() <= elements && matrix.square() <= square {
            return Ok(());
        }
        let want = (elements.max(matrix.numel()), square.max(matrix.square()));
        // The old workspace stays until the new one exists: a failed registration leaves the
        // optimizer as it was.
        let matrices = self
            .backend
            .matrices(want.0, want.1)
            .map_err(OptimError::Backend)?;
        self.matrices = Some(matrices);
        self.matrix_capacity = want;
        Ok(())
    }

    /// Bytes of the matrix phase's workspace (0 where no rule takes the phase).
    pub(crate) fn matrix_bytes(&self) -> usize {
        self.matrices
            .as_ref()
            .map_or(0, |m| self.backend.matrices_bytes(m))
    }

    /// The step plan of a parameter of `layout` with configuration `config` (its specialized
    /// kernels on; [`Settings::specialized_kernels`] is applied when a step is planned).
    pub(crate) fn compile(layout: &ParamLayout, config: &ParamConfig) -> StepPlan {
        StepPlan::new(layout, &config.hyper.consts(1, &RuleState::default()))
    }

    /// Keeps `other`'s settings that checkpoints do not hold (the settings, which parameters
    /// expect a gradient) across a load that rebuilds the optimizer.
    pub(crate) fn keep_settings(&mut self, other: &Self) {
        self.settings = other.settings;
        self.coverage = other.coverage.clone();
        for (m, o) in self.states.iter_mut().zip(&other.states) {
            m.expects_gradient = o.expects_gradient;
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

    /// Whether parameter `id` is expected to receive a gradient in every step (the default), or
    /// may go without one — frozen on purpose while registered, or used only in some steps — and
    /// is then never counted in [`StepReport::missing_gradients`]. A parameter that does receive
    /// a gradient still steps. Not saved in checkpoints; [`Optimizer::load`] keeps it.
    pub fn set_expects_gradient(&mut self, id: ParamId, expects: bool) -> Result<(), OptimError> {
        self.state(id)?;
        self.states[id.0].expects_gradient = expects;
        Ok(())
    }

    /// Sets the learning rate of every parameter. A rate refused for any group changes none.
    pub fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
        for g in 0..self.groups.len() {
            self.check_group_lr(g, lr)?;
        }
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
        self.check_group_lr(group, lr)?;
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

    /// Whether [`Optimizer::set_group_lr`] takes `lr` for `group`: the rate and every parameter's
    /// resulting one valid as a registered rate is (finite, non-negative, and not a positive
    /// value that rounds to 0 in f32: a group registered with it is refused, and a checkpoint
    /// holding it would not load).
    fn check_group_lr(&self, group: usize, lr: f64) -> Result<(), OptimError> {
        self.group_config(group)?;
        crate::rule::check::finite_non_negative("lr", lr)?;
        for m in self.states.iter().filter(|m| m.group == group) {
            if let LrRule::Scaled(k) = m.lr_rule {
                crate::rule::check::finite_non_negative("lr", lr * k)?;
            }
        }
        Ok(())
    }

    pub(crate) fn check_len(
        &self,
        id: ParamId,
        what: &'static str,
        len: usize,
    ) -> Result<(), OptimError> {
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

    /// Decodes one slot of parameter `id` — the parameter, the gradient accumulator or a state
    /// (zeros for a slot its configuration does not have) — into `out`: host f32 values
    /// (`&mut [f32]`, `&mut Vec<f32>`), host bf16 values ([`crate::backend::HostValuesMut`],
    /// rounded to nearest), or a buffer of the backend's ([`Out::Backend`]). A lent parameter's
    /// value is the caller's buffer and cannot be read here.
    pub fn read<'o>(
        &self,
        id: ParamId,
        slot: SlotKind,
        out: impl Into<Out<'o, B>>,
    ) -> Result<(), OptimError> {
        let out = match out.into() {
            Out::Host(host) => {
                self.check_len(id, "output", host.info().1)?;
                self.backend.host_output(host)
            }
            Out::Backend(out) => out,
        };
        let (_, len) = self.backend.output_info(&out);
        self.check_len(id, "output", len)?;
        self.backend
            .read(&self.params[id.0], &self.layouts[id.0], slot, out)?;
        Ok(())
    }

    /// Moves every parameter whose rule evaluates at another point than it trains at
    /// (schedule-free AdamW: from `y` to the average `x`, the `schedulefree` package's
    /// `optimizer.eval()`) to its point in `mode`; other parameters do not change. In
    /// [`Mode::Eval`] steps are refused ([`OptimError::EvalMode`]) until the mode is
    /// [`Mode::Train`] again. Stored values round as the parameter's storage rounds (stochastic
    /// rounding draws from a stream no step uses), so a low-precision `y` comes back within its
    /// rounding, not bit for bit. A no-op in the mode it is in. Lent parameters that move need
    /// their buffers in `lent` ([`Lent::None`] when no parameter is lent).
    pub fn set_mode(&mut self, mode: Mode, mut lent: Lent<'_, '_, B>) -> Result<(), OptimError> {
        let eval = mode == Mode::Eval;
        if self.eval == eval {
            return Ok(());
        }
        self.lents().check(&self.backend, &lent)?;
        self.plans.iter_mut().for_each(|p| *p = None);
        self.exec.begin();
        for (i, plan) in self.transforms(eval) {
            self.plans[i] = Some(plan);
        }
        self.run_step(None, &mut lent)?;
        self.eval = eval;
        Ok(())
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
                        plan: self.settings.plan(m.step_plan),
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

    /// Replaces one slot of a parameter with host contents in the canonical layout of its
    /// storage; a mismatch leaves it unchanged ([`PartsMut::import_slot`]).
    pub(crate) fn import_slot(
        &mut self,
        id: ParamId,
        slot: SlotKind,
        host: &HostSlot,
        lent: Option<B::Output<'_>>,
    ) -> Result<(), OptimError> {
        if !self.check_import(id, slot, host)? {
            return Ok(());
        }
        self.backend.import(
            &mut self.params[id.0],
            &self.layouts[id.0],
            slot,
            host,
            lent,
        )?;
        Ok(())
    }

    /// Whether [`Optimizer::import_slot`] takes `host` for `slot` (nothing changes): `false`
    /// where the configuration has no such slot and `host` is empty (nothing to import).
    pub(crate) fn check_import(
        &self,
        id: ParamId,
        slot: SlotKind,
        host: &HostSlot,
    ) -> Result<bool, OptimError> {
        let name = &self.state(id)?.name;
        let layout = &self.layouts[id.0];
        let fail = |reason: String| OptimError::Slot {
            param: name.clone(),
            reason: format!("{} slot: {reason}", slot.name()),
        };
        match layout.format(slot) {
            None if !host.is_empty() => Err(fail("the configuration has no such slot".into())),
            None => Ok(false),
            Some(f) => f
                .validate(host, &layout.shape, layout.numel, slot != SlotKind::Grad)
                .map_err(fail)
                .map(|()| true),
        }
    }

    /// Sets a parameter's counters and learning-rate rule ([`PartsMut::restore`]).
    pub(crate) fn restore(
        &mut self,
        id: ParamId,
        steps: u64,
        accumulations: u64,
        pending: bool,
        lr_rule: LrRule,
    ) -> Result<(), OptimError> {
        self.check_restore(id, steps, accumulations, pending, lr_rule)?;
        let m = &mut self.states[id.0];
        m.steps = steps;
        m.accumulations = accumulations;
        m.pending = pending;
        m.lr_rule = lr_rule;
        Ok(())
    }

    /// Whether [`Optimizer::restore`] takes these values (nothing changes).
    pub(crate) fn check_restore(
        &self,
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
        Ok(())
    }

    /// Sets a parameter's rule state ([`PartsMut::restore_rule_state`]).
    pub(crate) fn restore_rule_state(
        &mut self,
        id: ParamId,
        state: RuleState,
    ) -> Result<(), OptimError> {
        self.state(id)?;
        check_rule_state(state)?;
        self.states[id.0].rule_state = state;
        Ok(())
    }

    /// Sets the count of `step()` calls ([`PartsMut::set_steps`]).
    pub(crate) fn set_steps(&mut self, steps: u64) -> Result<(), OptimError> {
        check_counter(|| "the step counter".into(), steps)?;
        self.global_steps = steps;
        Ok(())
    }
}

impl From<BackendError> for OptimError {
    fn from(e: BackendError) -> Self {
        OptimError::Backend(e)
    }
}
