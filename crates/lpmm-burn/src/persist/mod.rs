//! Persistence: every call lpmm-burn makes to lpmm-optim's checkpoint and slot API (the canonical
//! layout, slot export and import, counters, lpmm's own checkpoint files) is in this module, so
//! that a change of that API is made here alone. [`record`] puts the whole-module optimizer's
//! state in a burn record; [`state`] puts one parameter's state (the per-tensor optimizer's) in
//! the records burn's `ModuleOptimizer` writes.

pub(crate) mod record;
pub(crate) mod state;

use lpmm_optim::{Parts, PartsMut};
use std::path::Path;

use lpmm_optim::backend::Backend;
use lpmm_optim::checkpoint::{Canonical, CanonicalParam};
use lpmm_optim::{HostSlot, OptimError, Optimizer, ParamId, RuleState, SlotKind};

use crate::BurnError;

/// burn's dtype of an lpmm slot's tensor (records and per-parameter states store them as is).
pub(crate) fn burn_dtype(d: lpmm_optim::backend::Dtype) -> burn_core::tensor::DType {
    use burn_core::tensor::DType;
    use lpmm_optim::backend::Dtype;
    match d {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
        Dtype::U16 => DType::U16,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
    }
}

/// Sets a parameter's counters (step and accumulation counters, pending flag, learning-rate
/// rule) and its rule's host state as `p` recorded them.
pub(crate) fn restore_counters<B: Backend>(
    opt: &mut Optimizer<B>,
    id: ParamId,
    p: &CanonicalParam,
) -> Result<(), OptimError> {
    PartsMut::of(opt).restore(id, p.steps, p.accumulations, p.pending, p.lr_rule)?;
    PartsMut::of(opt).restore_rule_state(id, p.rule_state)
}

/// Replaces one slot of a parameter with canonical host contents; a lent parameter's parameter
/// slot writes its primary region into `lent`.
pub(crate) fn import_slot<B: Backend>(
    opt: &mut Optimizer<B>,
    id: ParamId,
    slot: SlotKind,
    host: &HostSlot,
    lent: Option<B::Output<'_>>,
) -> Result<(), OptimError> {
    PartsMut::of(opt).import_slot(id, slot, host, lent)
}

/// One slot of a parameter in the canonical host layout; a lent parameter's parameter slot is
/// read from `lent`.
pub(crate) fn export_slot<B: Backend>(
    opt: &Optimizer<B>,
    id: ParamId,
    slot: SlotKind,
    lent: Option<B::Input<'_>>,
) -> Result<HostSlot, OptimError> {
    Parts::of(opt).export_slot(id, slot, lent)
}

/// A parameter's rule state (schedule-free AdamW's averaging weights).
pub(crate) fn rule_state<B: Backend>(
    opt: &Optimizer<B>,
    id: ParamId,
) -> Result<RuleState, OptimError> {
    opt.param(id).map(|p| p.rule_state)
}

/// Sets the count of whole steps taken (a loaded checkpoint's).
pub(crate) fn set_global_steps<B: Backend>(
    opt: &mut Optimizer<B>,
    steps: u64,
) -> Result<(), OptimError> {
    PartsMut::of(opt).set_steps(steps)
}

/// The whole optimizer in the canonical layout, lent parameters' values from `lender`.
pub(crate) fn canonical_lent<B: Backend>(
    opt: &Optimizer<B>,
    lender: &mut dyn lpmm_optim::Lender<B>,
) -> Result<Canonical, OptimError> {
    Parts::of(opt).canonical(Some(lender))
}

/// Reads lpmm's own safetensors checkpoint.
pub(crate) fn read_checkpoint(path: impl AsRef<Path>) -> Result<Canonical, BurnError> {
    Ok(Canonical::read(path)?)
}

/// Writes lpmm's own safetensors checkpoint (atomically).
pub(crate) fn write_checkpoint(
    canonical: &Canonical,
    path: impl AsRef<Path>,
) -> Result<(), BurnError> {
    Ok(canonical.write(path)?)
}
