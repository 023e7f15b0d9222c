//! [`LpmmState`]: one parameter's state as burn's `ModuleOptimizer` keeps it.

use std::sync::Arc;

use burn_core::tensor::Device;
use burn_optim::{RecordState, StateSink, StateSource};
use lpmm_optim::checkpoint::CanonicalParam;

use super::engine::{Slot, lock, on_any};
use crate::BurnError;
use crate::persist;

/// One parameter's lpmm state, as burn's `ModuleOptimizer` keeps it between steps (its
/// `Optimizer::State`).
///
/// While training, the state is a handle to the parameter's slots in lpmm's storage on the
/// parameter's device (codes, block scales, a Kahan compensation or split remainder, the step
/// counter): lpmm-wgpu's buffers on burn's wgpu device, host memory on burn's CPU backends. It is
/// stepped there in place. Cloning it is cheap; a clone that steps (a cloned `ModuleOptimizer`)
/// gets its own copy of the slots first, so two clones never change each other's state.
///
/// In a record (`ModuleOptimizer::to_record`, burn-train's checkpointer), it is the parameter's
/// tensors in lpmm's canonical layout under readable names (`{param_id}.state1` for the first
/// moment's codes, `{param_id}.state1.absmax` for its block scales, `{param_id}.lpmm` for the
/// metadata and checksum; the module record holds the parameter's value). Loaded back, it waits
/// for the parameter's next step, which moves it onto the parameter's device; a state that cannot
/// be used there (another optimizer's record, a damaged one, another shape or configuration) is
/// re-initialised, as burn does with a state it cannot rebuild, and reported
/// ([`crate::LpmmTensorStats::reinitialised`]).
#[derive(Clone)]
pub struct LpmmState<const D: usize> {
    pub(crate) inner: Arc<StateInner>,
}

impl<const D: usize> std::fmt::Debug for LpmmState<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.inner {
            StateInner::Live(slot) => f.debug_tuple("Live").field(slot).finish(),
            StateInner::Loaded(l) => f
                .debug_struct("Loaded")
                .field("stream", &l.stream)
                .field("shape", &l.param.shape)
                .finish(),
            StateInner::Refused(reason) => f.debug_tuple("Refused").field(reason).finish(),
        }
    }
}

/// Where a state is.
pub(crate) enum StateInner {
    /// Its slots in an engine.
    Live(Slot),
    /// Read from a record, or moved off its device: registered again at the next step.
    Loaded(Box<Loaded>),
    /// A record held something here that is not a usable lpmm state: re-initialised at the next
    /// step, and reported then.
    Refused(String),
}

/// A state on the host, in lpmm's canonical layout.
#[derive(Debug, Clone)]
pub(crate) struct Loaded {
    /// Its slots and counters (`name`, `group` unused).
    pub param: CanonicalParam,
    /// Its random-stream index.
    pub stream: u64,
    /// The parameter's value is the tensor's (the parameter slot lacks its primary region).
    pub outside: bool,
    /// The options it was stepped with (its seed, its non-finite policy), kept for its record.
    pub options: lpmm_optim::OptimizerOptions,
    /// What names it in messages: the parameter's id in the record it came from, or its stream.
    pub label: String,
}

impl<const D: usize> LpmmState<D> {
    pub(crate) fn new(inner: StateInner) -> Self {
        LpmmState {
            inner: Arc::new(inner),
        }
    }

    /// The state on the host (slots exported from the engine where it is live).
    pub(crate) fn to_loaded(&self) -> Result<Loaded, BurnError> {
        match &*self.inner {
            StateInner::Live(slot) => export(slot),
            StateInner::Loaded(l) => Ok((**l).clone()),
            StateInner::Refused(reason) => Err(BurnError::Record(reason.clone())),
        }
    }

    /// The state moved to `device`: unchanged where it is live there (or not live); otherwise its
    /// slots come to the host and are registered on `device` at the next step.
    #[allow(clippy::wrong_self_convention)] // burn's name (`Optimizer::to_device`), consuming as burn's
    pub(crate) fn to_device(self, device: &Device) -> Self {
        match &*self.inner {
            StateInner::Live(slot) if slot.device != *device => match export(slot) {
                Ok(loaded) => LpmmState::new(StateInner::Loaded(Box::new(loaded))),
                Err(e) => LpmmState::new(StateInner::Refused(format!(
                    "its state could not be moved to {device:?}: {e}"
                ))),
            },
            _ => self,
        }
    }

    /// Why a live state cannot be stepped with a parameter of `shape`, if it cannot: the module's
    /// tensor under its id was replaced by one of another shape since its last step (its slots
    /// are laid out for the old one, even where the element count is the same).
    pub(crate) fn other_shape(&self, shape: &[usize]) -> Option<String> {
        let StateInner::Live(slot) = &*self.inner else {
            return None;
        };
        let engine = lock(&slot.engine);
        on_any!(&*engine, e => {
            let old = &e.entries[slot.id.index()].shape;
            (old.as_slice() != shape).then(|| {
                format!(
                    "stream {}: the parameter's shape changed from {old:?} to {shape:?} since its \
                     last step (its tensor was replaced)",
                    slot.stream
                )
            })
        })
    }

    /// Whether the state is live in the slots of optimizer `owner` on `device`, held by no clone.
    pub(crate) fn live_here(&self, owner: u64, device: &Device) -> bool {
        let unique = Arc::strong_count(&self.inner) == 1 && Arc::weak_count(&self.inner) == 0;
        matches!(&*self.inner, StateInner::Live(s) if unique && s.owner == owner && s.device == *device)
    }
}

/// A live state's slots on the host.
fn export(slot: &Slot) -> Result<Loaded, BurnError> {
    let engine = lock(&slot.engine);
    let (param, outside, options) =
        on_any!(&*engine, e => e.export(slot.id).map(|(p, o)| (p, o, e.opt.status().options)))?;
    Ok(Loaded {
        param,
        stream: slot.stream,
        outside,
        options,
        label: format!("stream {}", slot.stream),
    })
}

impl<const D: usize> RecordState for LpmmState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        let loaded = match self.to_loaded() {
            Ok(l) => l,
            Err(e) => {
                // Nothing to save (a refused record's leftovers), or the device failed: the
                // parameter is re-initialised when this record is loaded, which says so then.
                if !matches!(&*self.inner, StateInner::Refused(_)) {
                    crate::warn(&format!(
                        "parameter {prefix}: its state could not be saved ({e}); a load of this record re-initialises it"
                    ));
                }
                return;
            }
        };
        if let Err(e) = persist::state::flatten(&loaded, D, prefix, out) {
            crate::warn(&format!(
                "parameter {prefix}: its state could not be saved ({e}); a load of this record re-initialises it"
            ));
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, _device: &Device) -> Option<Self> {
        Some(LpmmState::new(
            match persist::state::unflatten(prefix, D, src) {
                Ok(loaded) => StateInner::Loaded(Box::new(loaded)),
                Err(reason) => StateInner::Refused(format!("parameter {prefix}: {reason}")),
            },
        ))
    }
}
