//! Memory accounting: the bytes each slot of each parameter allocates.

use crate::backend::{Backend, SLOTS, SlotKind};
use crate::format::Storage;
use crate::optimizer::Optimizer;

/// The bytes one parameter's slots allocate.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ParamMemory {
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its element count.
    pub numel: usize,
    /// Storage in force for parameter, gradient accumulator and states 1, 2 and 3 ([`Storage::None`]
    /// for a state the rule does not use).
    pub storage: [Storage; SLOTS],
    /// Bytes of parameter, gradient accumulator and states 1, 2 and 3 (codes and scales included).
    pub bytes: [usize; SLOTS],
}

impl ParamMemory {
    /// All slots together.
    pub fn total(&self) -> usize {
        self.bytes.iter().sum()
    }
}

/// Bytes per slot per parameter, and totals.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct MemoryReport {
    /// One entry per parameter, in registration order.
    pub params: Vec<ParamMemory>,
    /// Bytes of the matrix phase's workspace (Muon's: four f32 matrices the size of the
    /// largest matrix's, held between steps and shared by every parameter; 0 where no rule
    /// takes the phase). Not model memory: not in [`MemoryReport::total`].
    pub workspace: usize,
}

impl MemoryReport {
    /// Parameters' elements in all.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.numel).sum()
    }

    /// Bytes of parameter, gradient and states 1, 2 and 3 over all parameters.
    pub fn slot_totals(&self) -> [usize; SLOTS] {
        let mut t = [0; SLOTS];
        for p in &self.params {
            for (a, b) in t.iter_mut().zip(p.bytes) {
                *a += b;
            }
        }
        t
    }

    /// All model memory, in bytes.
    pub fn total(&self) -> usize {
        self.slot_totals().iter().sum()
    }

    /// Bytes per parameter element.
    pub fn bytes_per_param(&self) -> f64 {
        self.total() as f64 / self.numel().max(1) as f64
    }
}

impl<B: Backend> Optimizer<B> {
    /// The bytes each slot of each parameter occupies on the backend, scratch it keeps for the
    /// parameter included (the code maps, shared by all slots of a kind, and the optimizer's
    /// bookkeeping are not model memory and are not counted; nor is a lent parameter's buffer,
    /// which is the caller's, nor a gradient accumulator the backend has not yet allocated: the
    /// CPU backend allocates one on a parameter's first accumulation).
    pub fn memory_report(&self) -> MemoryReport {
        let params = self
            .states
            .iter()
            .zip(&self.layouts)
            .zip(&self.params)
            .map(|((m, layout), p)| {
                let c = m.config;
                let slots = c.slots();
                ParamMemory {
                    name: m.name.clone(),
                    shape: layout.shape.clone(),
                    numel: layout.numel,
                    storage: std::array::from_fn(|k| {
                        let slot = SlotKind::ALL[k];
                        if c.hyper.uses(slot) {
                            slots[k]
                        } else {
                            Storage::None
                        }
                    }),
                    bytes: self.backend.bytes(p, layout),
                }
            })
            .collect();
        MemoryReport {
            params,
            workspace: self.matrix_bytes(),
        }
    }
}
