//! Memory accounting: the bytes each slot of each parameter allocates.

use crate::config::Storage;
use crate::optimizer::Optimizer;

/// The bytes one parameter's slots allocate.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamMemory {
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its element count.
    pub numel: usize,
    /// Storage in force for parameter, gradient accumulator, state 1 and state 2.
    pub storage: [Storage; 4],
    /// Bytes of parameter, gradient accumulator, state 1 and state 2 (codes and scales included).
    pub bytes: [usize; 4],
}

impl ParamMemory {
    /// All slots together.
    pub fn total(&self) -> usize {
        self.bytes.iter().sum()
    }
}

/// Bytes per slot per parameter, and totals.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MemoryReport {
    /// One entry per parameter, in registration order.
    pub params: Vec<ParamMemory>,
}

impl MemoryReport {
    /// Parameters' elements in all.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.numel).sum()
    }

    /// Bytes of parameter, gradient, state 1 and state 2 over all parameters.
    pub fn slot_totals(&self) -> [usize; 4] {
        let mut t = [0; 4];
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

impl Optimizer {
    /// The bytes each slot of each parameter allocates (the code maps, shared by all slots of a
    /// kind, and per-parameter bookkeeping are not model memory and are not counted).
    pub fn memory_report(&self) -> MemoryReport {
        let params = self
            .metas
            .iter()
            .map(|m| {
                let mut bytes = [0usize; 4];
                for piece in &self.pieces[m.first_piece..m.first_piece + m.pieces] {
                    for (b, slot) in bytes.iter_mut().zip([
                        &piece.param,
                        &piece.grad,
                        &piece.state1,
                        &piece.state2,
                    ]) {
                        *b += slot.bytes();
                    }
                }
                // A rank-1 state's tensor-wide scales, the next step's maxima and each piece's
                // share of them.
                if let Some(r) = &m.rank1 {
                    let partials: usize = self.pieces[m.first_piece..m.first_piece + m.pieces]
                        .iter()
                        .map(|p| p.partial.len())
                        .sum();
                    bytes[3] += 4 * (r.scales.len() + r.next.len() + partials);
                }
                let states = m.config.hyper.states();
                let c = m.config;
                ParamMemory {
                    name: m.name.clone(),
                    shape: m.shape.clone(),
                    numel: m.numel,
                    storage: [
                        c.param,
                        c.grad,
                        if states >= 1 { c.state1 } else { Storage::F32 },
                        if states >= 2 { c.state2 } else { Storage::F32 },
                    ],
                    bytes,
                }
            })
            .collect();
        MemoryReport { params }
    }
}
