//! What a user configures per parameter tensor: the storage format of each slot (parameter,
//! gradient accumulator, optimizer states) and the optimizer's hyperparameters.

use serde::{Deserialize, Serialize};

use crate::error::OptimError;
use crate::format::{Format, Storage};
use crate::rule::Hyper;
use crate::vocab::{SLOTS, SlotKind};

/// Everything that decides how one parameter tensor is stored and stepped. Made from a preset
/// ([`crate::presets`]) or [`ParamConfig::f32`], then changed with the `with_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ParamConfig {
    /// The optimizer and its hyperparameters.
    pub hyper: Hyper,
    /// How the parameter is stored.
    pub param: Storage,
    /// How the gradient accumulator is stored.
    pub grad: Storage,
    /// How the first state (momentum / first moment) is stored.
    pub state1: Storage,
    /// How the second state (Adam's second moment) is stored.
    pub state2: Storage,
    /// How the third state (AdEMAMix's slow first moment, CAME's instability) is stored.
    #[serde(default = "f32_storage")]
    pub state3: Storage,
    /// Tensors with fewer elements keep quantized slots in f32 (bitsandbytes' `min_8bit_size`),
    /// decided on the whole tensor, never on a shard.
    pub min_quantized_size: usize,
}

impl ParamConfig {
    /// All f32: the reference every low-precision configuration is compared with.
    pub fn f32(hyper: impl Into<Hyper>) -> Self {
        ParamConfig {
            hyper: hyper.into(),
            param: Storage::F32,
            grad: Storage::F32,
            state1: Storage::F32,
            state2: Storage::F32,
            state3: Storage::F32,
            min_quantized_size: 4096,
        }
    }

    /// With update rule and hyperparameters `hyper`.
    pub fn with_hyper(self, hyper: impl Into<Hyper>) -> Self {
        ParamConfig {
            hyper: hyper.into(),
            ..self
        }
    }

    /// With the parameter stored as `s`.
    pub fn with_param(self, s: Storage) -> Self {
        ParamConfig { param: s, ..self }
    }

    /// With the gradient accumulator stored as `s`.
    pub fn with_grad(self, s: Storage) -> Self {
        ParamConfig { grad: s, ..self }
    }

    /// With state 1 (momentum / first moment) stored as `s`.
    pub fn with_state1(self, s: Storage) -> Self {
        ParamConfig { state1: s, ..self }
    }

    /// With state 2 (Adam's second moment) stored as `s`.
    pub fn with_state2(self, s: Storage) -> Self {
        ParamConfig { state2: s, ..self }
    }

    /// With state 3 (AdEMAMix's slow first moment, CAME's instability) stored as `s`.
    pub fn with_state3(self, s: Storage) -> Self {
        ParamConfig { state3: s, ..self }
    }

    /// The storage of `slot`.
    pub fn storage(&self, slot: SlotKind) -> Storage {
        self.slots()[slot as usize]
    }

    /// With minimum quantized size `n` (see the field).
    pub fn with_min_quantized_size(self, n: usize) -> Self {
        ParamConfig {
            min_quantized_size: n,
            ..self
        }
    }

    /// The granularity a shard of a parameter with this (resolved) configuration may start at:
    /// 256 elements, or the largest quantization block of its slots, so that blocks, packed
    /// words, random blocks and the gradient norm's partial sums stay whole on one shard.
    pub fn shard_alignment(&self) -> usize {
        self.slots()
            .iter()
            .filter_map(|s| s.format())
            .map(|f| f.alignment())
            .fold(256, usize::max)
    }

    /// Whether a tensor with this (resolved) configuration may be cut into shards: no slot keeps
    /// tensor-wide statistics and the rule needs no tensor-wide sums (Adafactor's and CAME's
    /// RMS of the update).
    pub fn splittable(&self) -> bool {
        self.slots()
            .iter()
            .zip(SlotKind::ALL)
            .filter(|&(_, slot)| self.hyper.uses(slot))
            .filter_map(|(s, _)| s.format())
            .all(|f| !f.tensor_wide())
            && self.hyper.consts(1, &Default::default()).stats() == 0
    }

    /// The slots' storages: parameter, gradient accumulator, states 1, 2 and 3.
    pub fn slots(&self) -> [Storage; SLOTS] {
        [self.param, self.grad, self.state1, self.state2, self.state3]
    }

    /// The format of each slot of a tensor with this (resolved) configuration: `None` where the
    /// slot is not allocated (no accumulator, states the rule does not use).
    pub fn formats(&self) -> [Option<Format>; SLOTS] {
        let slots = self.slots();
        std::array::from_fn(|k| {
            slots[k]
                .format()
                .filter(|_| self.hyper.uses(SlotKind::ALL[k]))
        })
    }

    /// The storage each slot will really use for a tensor of `numel` elements and `shape`:
    /// quantized slots of tensors below `min_quantized_size` are f32, and a format that cannot
    /// hold the shape falls back (rank-1 states of vectors to blocks, a factorized state 2 to f32;
    /// a factorized state 3, CAME's instability, is not kept for vectors: [`Storage::None`]).
    pub fn resolve(&self, numel: usize, shape: &[usize]) -> ParamConfig {
        let small = numel < self.min_quantized_size;
        let pick = |s: Storage| match s.format() {
            Some(f) if small && f.quantized() => Storage::F32,
            Some(f) => f.resolve(shape).unwrap_or(s),
            None => s,
        };
        let state3 = match self.state3 {
            Storage::Factorized if shape.len() < 2 => Storage::None,
            s => pick(s),
        };
        ParamConfig {
            param: pick(self.param),
            grad: pick(self.grad),
            state1: pick(self.state1),
            state2: pick(self.state2),
            state3,
            ..*self
        }
    }

    /// Checks the hyperparameters and that each slot's storage is allowed there.
    pub fn validate(&self) -> Result<(), OptimError> {
        self.hyper.validate()?;
        for (slot, name) in [(SlotKind::State2, "state2"), (SlotKind::State3, "state3")] {
            if self.storage(slot) == Storage::Factorized && !self.hyper.factorable(slot) {
                return Err(OptimError::StorageNotAllowed {
                    slot: name,
                    storage: format!(
                        "factorized ({}'s {name} is not an average of squares it reads factorized)",
                        self.hyper.name()
                    ),
                });
            }
        }
        // A slot the rule reads only as a factorized reconstruction (CAME's instability).
        for (slot, name) in [(SlotKind::State2, "state2"), (SlotKind::State3, "state3")] {
            let storage = self.storage(slot);
            if let Some(why) = self.hyper.needs_factorized(slot)
                && storage != Storage::Factorized
            {
                return Err(OptimError::StorageNotAllowed {
                    slot: name,
                    storage: format!("{} ({why})", storage.describe()),
                });
            }
        }
        for (kind, name, s) in [
            (SlotKind::Param, "parameter", self.param),
            (SlotKind::Grad, "gradient", self.grad),
            (SlotKind::State1, "state1", self.state1),
            (SlotKind::State2, "state2", self.state2),
            (SlotKind::State3, "state3", self.state3),
        ] {
            let ok = match s.format() {
                None => kind == SlotKind::Grad,
                Some(f) => f.allowed(kind),
            };
            if !ok {
                return Err(OptimError::StorageNotAllowed {
                    slot: name,
                    storage: s.describe(),
                });
            }
        }
        Ok(())
    }
}

/// The default of a field added after checkpoints were first written.
fn f32_storage() -> Storage {
    Storage::F32
}
