//! The optimizer: parameters registered with their configuration, micro-batch gradient
//! accumulation, the step, gradient release, learning-rate control, clipping and the
//! non-finite-gradient policy. The numeric work is the backend's ([`crate::Backend`]); the CPU
//! backend defines the semantics.

use serde::{Deserialize, Serialize};

use rayon::prelude::*;

use crate::backend::{Backend, HostSlot, LrRule, ParamMeta, SlotKind};
use crate::config::{ParamConfig, Storage};
use crate::cpu::Cpu;
use crate::error::OptimError;
use crate::exact::ExactSum;
use crate::rule::Rule;

/// A registered parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub(crate) usize);

impl ParamId {
    /// The parameter's index in registration order.
    pub fn index(self) -> usize {
        self.0
    }
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

/// Settings that apply to the whole optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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

/// What a step did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepReport {
    /// Parameters that were updated.
    pub updated: usize,
    /// Whether the whole step was skipped for a non-finite gradient.
    pub skipped: bool,
    /// Parameters whose gradient held a non-finite value.
    pub non_finite: Vec<ParamId>,
    /// The global gradient norm, when it was computed (clipping or the skip policy).
    pub grad_norm: Option<f64>,
}

/// This optimizer's part of a step's gradient pre-pass ([`Optimizer::gradient_summary`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GradientSummary {
    /// Exact sum of squares of the finite gradient values.
    pub sum: ExactSum,
    /// Parameters whose gradients are not all finite.
    pub non_finite: Vec<ParamId>,
}

/// The optimizer over all registered parameters, on backend `B` (the CPU by default).
#[derive(Debug, Clone)]
pub struct Optimizer<B: Backend = Cpu> {
    pub(crate) backend: B,
    pub(crate) options: OptimizerOptions,
    pub(crate) groups: Vec<ParamConfig>,
    pub(crate) metas: Vec<ParamMeta>,
    pub(crate) params: Vec<B::Param>,
    /// Steps taken by `step()` (the global counter; per-parameter counters are in the metas).
    pub(crate) global_steps: u64,
    /// Per-parameter scratch for the backend's answers, allocated at registration so a step
    /// allocates nothing.
    stats: Vec<(ExactSum, bool)>,
    flags: Vec<bool>,
}

impl Optimizer<Cpu> {
    /// An optimizer with no parameters on the CPU backend.
    pub fn new(options: OptimizerOptions) -> Result<Self, OptimError> {
        Self::with_backend(Cpu, options)
    }
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
            metas: Vec::new(),
            params: Vec::new(),
            global_steps: 0,
            stats: Vec::new(),
            flags: Vec::new(),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Adds a parameter group: parameters added to it take `config` (unless given their own),
    /// and [`Optimizer::set_group_lr`] sets their learning rate together. Returns its index.
    pub fn add_group(&mut self, config: ParamConfig) -> Result<usize, OptimError> {
        config.validate()?;
        self.groups.push(config);
        Ok(self.groups.len() - 1)
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
        let config = *self
            .groups
            .get(group)
            .ok_or(OptimError::UnknownGroup(group))?;
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
        config: ParamConfig,
    ) -> Result<ParamId, OptimError> {
        if group >= self.groups.len() {
            return Err(OptimError::UnknownGroup(group));
        }
        config.validate()?;
        let numel = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| n > 0 && n <= usize::MAX / 8)
            .ok_or_else(|| OptimError::Shape {
                param: name.to_string(),
                shape: shape.to_vec(),
            })?;
        let resolved = config.resolve(numel, shape);
        let stream = self.metas.len();
        self.register(
            name,
            shape.to_vec(),
            init,
            group,
            config,
            resolved,
            (stream, 0),
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
        config: ParamConfig,
        stream: usize,
    ) -> Result<ParamId, OptimError> {
        if group >= self.groups.len() {
            return Err(OptimError::UnknownGroup(group));
        }
        config.validate()?;
        let numel = global_shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| n > 0 && n <= usize::MAX / 8)
            .ok_or_else(|| OptimError::Shape {
                param: name.to_string(),
                shape: global_shape.to_vec(),
            })?;
        let resolved = config.resolve(numel, global_shape);
        let whole = range.start == 0 && range.end == numel;
        let tensor_wide = [resolved.state1, resolved.state2]
            .iter()
            .any(|s| matches!(s, Storage::Rank1 { .. } | Storage::Factorized));
        if range.is_empty()
            || range.end > numel
            || (!whole && (!range.start.is_multiple_of(resolved.shard_alignment()) || tensor_wide))
        {
            return Err(OptimError::Unsupported {
                backend: self.backend.name(),
                what: format!(
                    "shard {range:?} of {name} ({numel} elements): a shard is a non-empty range starting at a multiple of {} (ParamConfig::shard_alignment), and the whole tensor when a state has tensor-wide statistics",
                    resolved.shard_alignment()
                ),
            });
        }
        // A whole tensor keeps its shape (rank-1 and factorized states need it).
        let shape = if whole {
            global_shape.to_vec()
        } else {
            vec![range.len()]
        };
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
        init: &[f32],
        group: usize,
        config: ParamConfig,
        resolved: ParamConfig,
        (stream, offset): (usize, usize),
    ) -> Result<ParamId, OptimError> {
        if self.metas.iter().any(|m| m.name == name) {
            return Err(OptimError::DuplicateName(name.to_string()));
        }
        let numel: usize = shape.iter().product();
        if init.len() != numel {
            return Err(OptimError::Length {
                param: name.to_string(),
                what: "initial values",
                expected: numel,
                actual: init.len(),
            });
        }
        if let Some(index) = init.iter().position(|v| !v.is_finite()) {
            return Err(OptimError::NonFiniteParam {
                param: name.to_string(),
                index,
                value: init[index],
            });
        }
        let (group_lr, own_lr) = (self.groups[group].hyper.lr(), config.hyper.lr());
        let lr_rule = if own_lr == group_lr {
            LrRule::Group
        } else if group_lr > 0.0 {
            LrRule::Scaled(own_lr / group_lr)
        } else {
            LrRule::Fixed
        };
        let meta = ParamMeta {
            name: name.to_string(),
            shape,
            numel,
            requested: config,
            config: resolved,
            group,
            steps: 0,
            accumulations: 0,
            pending: false,
            rule: Rule::new(&resolved.hyper, 1),
            active: false,
            update_param: true,
            lr_rule,
            stream,
            offset,
        };
        let index = self.metas.len();
        let param = self
            .backend
            .allocate(index, &meta, init, self.options.seed)?;
        self.metas.push(meta);
        self.params.push(param);
        self.stats.push((ExactSum::new(), true));
        self.flags.push(false);
        Ok(ParamId(index))
    }

    /// The parameter named `name`.
    pub fn param_id(&self, name: &str) -> Result<ParamId, OptimError> {
        self.metas
            .iter()
            .position(|m| m.name == name)
            .map(ParamId)
            .ok_or_else(|| OptimError::UnknownParam(name.to_string()))
    }

    /// Number of registered parameters.
    pub fn len(&self) -> usize {
        self.metas.len()
    }

    /// Whether no parameter is registered.
    pub fn is_empty(&self) -> bool {
        self.metas.is_empty()
    }

    /// The name of a parameter.
    pub fn name(&self, id: ParamId) -> Result<&str, OptimError> {
        Ok(&self.meta(id)?.name)
    }

    /// The configuration in force for a parameter (after the minimum-size policy).
    pub fn config(&self, id: ParamId) -> Result<ParamConfig, OptimError> {
        Ok(self.meta(id)?.config)
    }

    /// The options in force.
    pub fn options(&self) -> &OptimizerOptions {
        &self.options
    }

    /// Steps taken by `step()`.
    pub fn steps(&self) -> u64 {
        self.global_steps
    }

    pub(crate) fn meta(&self, id: ParamId) -> Result<&ParamMeta, OptimError> {
        self.metas
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
        if group >= self.groups.len() {
            return Err(OptimError::UnknownGroup(group));
        }
        let valid = |v: f64| v.is_finite() && v >= 0.0 && (v as f32).is_finite();
        if !valid(lr) {
            return Err(OptimError::Hyperparameter {
                name: "lr",
                value: lr,
            });
        }
        // Check every resulting rate before changing anything.
        for m in self.metas.iter().filter(|m| m.group == group) {
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
        for m in self.metas.iter_mut().filter(|m| m.group == group) {
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

    fn check_len(
        &self,
        id: ParamId,
        what: &'static str,
        len: usize,
    ) -> Result<&ParamMeta, OptimError> {
        let meta = self.meta(id)?;
        if len != meta.numel {
            return Err(OptimError::Length {
                param: meta.name.clone(),
                what,
                expected: meta.numel,
                actual: len,
            });
        }
        Ok(meta)
    }

    /// Adds a micro-batch gradient into the parameter's gradient accumulator (in its storage
    /// format, stochastically rounded if configured so). The next step consumes and resets it.
    /// Non-finite values are kept for the step's policy, except in quantized accumulators, which
    /// cannot hold them: there the call fails and nothing changes.
    pub fn accumulate(&mut self, id: ParamId, grad: &[f32]) -> Result<(), OptimError> {
        let meta = self.check_len(id, "gradient", grad.len())?;
        if meta.config.grad == Storage::None {
            return Err(OptimError::NoAccumulator(meta.name.clone()));
        }
        if matches!(meta.config.grad, Storage::Quantized { .. })
            && let Some(index) = grad.iter().position(|v| !v.is_finite())
        {
            return Err(lpmm_quant::QuantError::NonFinite {
                index,
                value: grad[index],
            }
            .into());
        }
        self.backend.accumulate(
            id.0,
            &mut self.params[id.0],
            &self.metas[id.0],
            grad,
            self.options.seed,
        );
        let meta = &mut self.metas[id.0];
        meta.accumulations += 1;
        meta.pending = true;
        Ok(())
    }

    /// Reads the parameter's current value as f32 into `out`.
    pub fn read_param(&self, id: ParamId, out: &mut [f32]) -> Result<(), OptimError> {
        let meta = self.check_len(id, "output", out.len())?;
        self.backend
            .read(&self.params[id.0], meta, SlotKind::Param, out);
        Ok(())
    }

    /// One slot of the parameter in the canonical host layout (the stored bits, unsharded): what a
    /// checkpoint holds, and how two backends are compared bit for bit.
    pub fn export_slot(&self, id: ParamId, slot: SlotKind) -> Result<HostSlot, OptimError> {
        let meta = self
            .metas
            .get(id.0)
            .ok_or_else(|| OptimError::UnknownParam(format!("#{}", id.0)))?;
        Ok(self.backend.export(&self.params[id.0], meta, slot))
    }

    /// Reads a state (1 or 2) of the parameter as f32 into `out` (zeros if the optimizer has no
    /// such state).
    pub fn read_state(&self, id: ParamId, state: usize, out: &mut [f32]) -> Result<(), OptimError> {
        let meta = self.check_len(id, "output", out.len())?;
        let slot = if state == 1 {
            SlotKind::State1
        } else {
            SlotKind::State2
        };
        self.backend.read(&self.params[id.0], meta, slot, out);
        Ok(())
    }

    /// Replaces one slot of a parameter with host contents in the canonical layout of its
    /// storage (checkpoints, shards assembled by lpmm-dist); a mismatch leaves it unchanged.
    pub fn import_slot(
        &mut self,
        id: ParamId,
        slot: SlotKind,
        host: HostSlot,
    ) -> Result<(), OptimError> {
        let meta = self.meta(id)?;
        let name = meta.name.clone();
        self.backend
            .import(&mut self.params[id.0], &self.metas[id.0], slot, host)
            .map_err(|reason| OptimError::Slot {
                param: name,
                reason,
            })
    }

    /// Sets a parameter's counters (which position its random streams) and learning-rate rule,
    /// as a checkpoint recorded them.
    pub fn restore(
        &mut self,
        id: ParamId,
        steps: u64,
        accumulations: u64,
        pending: bool,
        lr_rule: LrRule,
    ) -> Result<(), OptimError> {
        self.meta(id)?;
        let m = &mut self.metas[id.0];
        m.steps = steps;
        m.accumulations = accumulations;
        m.pending = pending;
        m.lr_rule = lr_rule;
        Ok(())
    }

    /// Sets the count of `step()` calls (a checkpoint's).
    pub fn set_steps(&mut self, steps: u64) {
        self.global_steps = steps;
    }

    /// Steps every parameter whose accumulator holds gradients, consuming them.
    pub fn step(&mut self) -> Result<StepReport, OptimError> {
        // Pre-pass over the gradients when the norm is needed (clipping) or the step may be
        // skipped: one read of each accumulator.
        if self.options.max_grad_norm.is_some()
            || self.options.non_finite == NonFinitePolicy::SkipStep
        {
            let local = self.gradient_summary();
            let any = !local.non_finite.is_empty();
            Ok(self.step_with_summary(Some((local.sum, any)), local.non_finite))
        } else {
            for meta in &mut self.metas {
                meta.active = meta.pending;
            }
            Ok(self.step_with_summary(None, Vec::new()))
        }
    }

    /// The first half of a step split across ranks (lpmm-dist): marks every parameter with
    /// pending gradients as taking part and returns the exact sum of squares of their finite
    /// gradient values and the parameters whose gradients are not all finite. Sums from several
    /// optimizers (the shards of one model) add exactly ([`ExactSum::merge`], or an integer
    /// all-reduce of [`ExactSum::to_words`]) to the unsharded model's sum, bit for bit.
    pub fn gradient_summary(&mut self) -> GradientSummary {
        for meta in &mut self.metas {
            meta.active = meta.pending;
        }
        self.backend
            .gradient_stats(&mut self.params, &self.metas, &mut self.stats);
        let mut summary = GradientSummary::default();
        for (index, (meta, (sum, finite))) in self.metas.iter().zip(&self.stats).enumerate() {
            if meta.active {
                summary.sum.merge(sum);
                if !finite {
                    summary.non_finite.push(ParamId(index));
                }
            }
        }
        summary
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
    ) -> StepReport {
        let mut report = StepReport {
            non_finite: local_non_finite,
            ..StepReport::default()
        };
        let policy = self.options.non_finite;
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
            if any_non_finite && policy == NonFinitePolicy::SkipStep {
                report.skipped = true;
                for meta in &mut self.metas {
                    meta.pending = false;
                    meta.active = false;
                }
                self.backend.clear_gradients(&mut self.params);
                return report;
            }
        }
        for meta in self.metas.iter_mut().filter(|m| m.active) {
            meta.rule = Rule::new(&meta.config.hyper, meta.steps + 1);
            meta.update_param = true;
        }
        self.backend.step(
            &mut self.params,
            &self.metas,
            self.options.seed,
            clip,
            None,
            &mut self.flags,
        );
        for (index, &flag) in self.flags.iter().enumerate() {
            if flag && !report.non_finite.contains(&ParamId(index)) {
                report.non_finite.push(ParamId(index));
            }
        }
        for meta in self.metas.iter_mut().filter(|m| m.active) {
            meta.steps += 1;
            meta.pending = false;
            meta.active = false;
            report.updated += 1;
        }
        self.global_steps += 1;
        report
    }

    /// Gradient release: steps one parameter now with `grad` (plus anything its accumulator
    /// holds), so a training loop can step each parameter from its backward hook and never hold
    /// all gradients. Global-norm clipping needs every gradient and is not applied here.
    pub fn step_param(&mut self, id: ParamId, grad: &[f32]) -> Result<StepReport, OptimError> {
        self.release_step(id, grad, true)
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
        self.release_step(id, grad, false)
    }

    fn release_step(
        &mut self,
        id: ParamId,
        grad: &[f32],
        update_param: bool,
    ) -> Result<StepReport, OptimError> {
        self.check_len(id, "gradient", grad.len())?;
        let mut report = StepReport::default();
        for (i, m) in self.metas.iter_mut().enumerate() {
            m.active = i == id.0;
        }
        // The gradient is `grad` plus whatever the accumulator holds: both must be finite.
        // One vectorized pass on all threads (NaN and Inf patterns exceed every finite one).
        let mut finite = grad
            .par_chunks(1 << 16)
            .all(|c| lpmm_formats::simd::abs_max_bits(c) < 0x7F80_0000);
        if self.metas[id.0].pending {
            self.backend
                .gradient_stats(&mut self.params, &self.metas, &mut self.stats);
            finite &= self.stats[id.0].1;
        }
        if !finite {
            report.non_finite.push(id);
            if self.options.non_finite == NonFinitePolicy::SkipStep {
                // Skipped and consumed, as `step` does.
                report.skipped = true;
                self.backend
                    .clear_gradients(std::slice::from_mut(&mut self.params[id.0]));
                let m = &mut self.metas[id.0];
                m.pending = false;
                m.active = false;
                return Ok(report);
            }
        }

        let meta = &mut self.metas[id.0];
        meta.rule = Rule::new(&meta.config.hyper, meta.steps + 1);
        meta.update_param = update_param;
        self.backend.step(
            &mut self.params,
            &self.metas,
            self.options.seed,
            1.0,
            Some((id.0, grad)),
            &mut self.flags,
        );
        if self.flags[id.0] && !report.non_finite.contains(&id) {
            report.non_finite.push(id);
        }
        let m = &mut self.metas[id.0];
        m.active = false;
        m.update_param = true;
        m.steps += 1;
        m.pending = false;
        report.updated = 1;
        Ok(report)
    }
}
