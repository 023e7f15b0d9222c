//! The optimizer's parts, for implementors of integrations and backends ([`Parts`],
//! [`PartsMut`]).

use std::ops::Range;

use crate::backend::{Backend, HostSlot, ParamId, ParamLayout, SLOTS, SlotKind};
use crate::checkpoint::{Canonical, CanonicalParam};
use crate::config::ParamConfig;
use crate::error::OptimError;
use crate::rule::RuleState;

use super::{GradientSummary, Lender, LrRule, Optimizer};

/// Read access to an optimizer's parts, for implementors of integrations and backends:
/// `Parts::of(&opt)`.
///
/// What a framework integration (lpmm-candle, lpmm-burn), the sharded optimizer (lpmm-dist) or a
/// backend's conformance suite needs beyond a training loop's API — a slot's stored bits in and
/// out, the canonical form of the whole state, the counters a checkpoint restores, shards, the
/// gradient pre-pass of a sharded step, the backend and the parameters' layouts — is here
/// ([`Parts`] reads) and in [`PartsMut`] (changes). Each checks what it is given before anything
/// changes, as the optimizer's own methods do.
///
/// A training loop never needs these: [`Optimizer::save`] and [`Optimizer::load`] checkpoint
/// the whole state, and [`Optimizer::read`] decodes a slot.
#[derive(Debug, Clone, Copy)]
pub struct Parts<'a, B: Backend>(&'a Optimizer<B>);

/// Write access to an optimizer's parts, for implementors of integrations and backends
/// ([`Parts`] says which): `PartsMut::of(&mut opt)`.
#[derive(Debug)]
pub struct PartsMut<'a, B: Backend>(&'a mut Optimizer<B>);

impl<'a, B: Backend> Parts<'a, B> {
    /// The parts of `opt`.
    pub fn of(opt: &'a Optimizer<B>) -> Self {
        Parts(opt)
    }

    /// The backend.
    pub fn backend(&self) -> &'a B {
        &self.0.backend
    }

    /// How parameter `id` is laid out on the backend (fixed at registration).
    pub fn layout(&self, id: ParamId) -> Result<&'a ParamLayout, OptimError> {
        self.0.state(id)?;
        Ok(&self.0.layouts[id.0])
    }

    /// One slot of the parameter in the canonical host layout (the stored bits, unsharded): what
    /// a checkpoint holds, and how two backends are compared bit for bit. A lent parameter's
    /// parameter slot is read from its buffer, `lent` (`None` for every other slot and
    /// parameter).
    pub fn export_slot(
        &self,
        id: ParamId,
        slot: SlotKind,
        lent: Option<B::Input<'_>>,
    ) -> Result<HostSlot, OptimError> {
        self.0.state(id)?;
        Ok(self
            .0
            .backend
            .export(&self.0.params[id.0], &self.0.layouts[id.0], slot, lent)?)
    }

    /// The whole optimizer in the canonical layout (what [`Optimizer::save`] writes; a burn
    /// record or a sharded checkpoint holds it in another container). Lent parameters' values
    /// are read through `lender`; without one, their parameter slots are empty (their values
    /// are held outside: [`Canonical::check_outside`] names them).
    pub fn canonical(
        &self,
        mut lender: Option<&mut dyn Lender<B>>,
    ) -> Result<Canonical, OptimError> {
        let opt = self.0;
        let mut params = Vec::with_capacity(opt.states.len());
        for (i, m) in opt.states.iter().enumerate() {
            let (layout, p) = (&opt.layouts[i], &opt.params[i]);
            let mut slots: [HostSlot; SLOTS] = Default::default();
            for (slot, out) in SlotKind::ALL.into_iter().zip(slots.iter_mut()) {
                *out = match (&mut lender, slot == SlotKind::Param && layout.lent) {
                    (Some(lender), true) => {
                        let mut got = None;
                        lender.lend(ParamId(i), &mut |buf| {
                            got = Some(opt.backend.export(p, layout, slot, Some(buf))?);
                            Ok(())
                        })?;
                        got.unwrap_or_default()
                    }
                    _ => opt.backend.export(p, layout, slot, None)?,
                };
            }
            params.push(CanonicalParam {
                name: m.name.clone(),
                shape: layout.shape.clone(),
                group: m.group,
                requested: m.requested,
                steps: m.steps,
                accumulations: m.accumulations,
                pending: m.pending,
                lr_rule: m.lr_rule,
                rule_state: m.rule_state,
                slots,
            });
        }
        Ok(Canonical {
            options: opt.options,
            global_steps: opt.global_steps,
            groups: opt.groups.clone(),
            params,
            eval: opt.eval,
        })
    }
}

impl<'a, B: Backend> PartsMut<'a, B> {
    /// The parts of `opt`.
    pub fn of(opt: &'a mut Optimizer<B>) -> Self {
        PartsMut(opt)
    }

    /// Read access to the same parts.
    pub fn parts(&self) -> Parts<'_, B> {
        Parts(self.0)
    }

    /// Replaces one slot of a parameter with host contents in the canonical layout of its
    /// storage (checkpoints, shards assembled by lpmm-dist); a mismatch leaves it unchanged. A
    /// lent parameter's parameter slot is written to its buffer, `lent` (`None` for every other
    /// slot and parameter).
    pub fn import_slot(
        &mut self,
        id: ParamId,
        slot: SlotKind,
        host: &HostSlot,
        lent: Option<B::Output<'_>>,
    ) -> Result<(), OptimError> {
        self.0.import_slot(id, slot, host, lent)
    }

    /// Sets a parameter's counters (which position its random streams) and learning-rate rule,
    /// as a checkpoint recorded them. Counters beyond [`super::MAX_COUNTER`], a scaled rule
    /// whose factor is not finite and positive, and a pending gradient without an accumulator
    /// are refused.
    pub fn restore(
        &mut self,
        id: ParamId,
        steps: u64,
        accumulations: u64,
        pending: bool,
        lr_rule: LrRule,
    ) -> Result<(), OptimError> {
        self.0.restore(id, steps, accumulations, pending, lr_rule)
    }

    /// Sets a parameter's rule state ([`RuleState`]: schedule-free AdamW's averaging weights),
    /// as a checkpoint restores it. It must be finite and non-negative.
    pub fn restore_rule_state(&mut self, id: ParamId, state: RuleState) -> Result<(), OptimError> {
        self.0.restore_rule_state(id, state)
    }

    /// Sets the count of `step()` calls (a checkpoint's); beyond [`super::MAX_COUNTER`] it is
    /// refused.
    pub fn set_steps(&mut self, steps: u64) -> Result<(), OptimError> {
        self.0.set_steps(steps)
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
        range: Range<usize>,
        init: &[f32],
        group: usize,
        config: impl Into<ParamConfig>,
        stream: usize,
    ) -> Result<ParamId, OptimError> {
        self.0
            .add_param_shard(name, global_shape, range, init, group, config, stream)
    }

    /// The first half of a step split across ranks (lpmm-dist): the exact sum of squares of the
    /// finite accumulated gradient values and the parameters whose gradients are not all
    /// finite. Sums from several optimizers (the shards of one model) add exactly
    /// ([`crate::backend::ExactSum::merge`], or an integer all-reduce of
    /// [`crate::backend::ExactSum::to_words`]) to the
    /// unsharded model's sum, bit for bit; [`super::Step::summarized`] takes the step.
    pub fn gradient_summary(&mut self) -> Result<GradientSummary, OptimError> {
        self.0.gradient_summary()
    }
}
