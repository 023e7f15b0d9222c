//! What the optimizer reports: each step's report kept and logged with `tracing`, and the
//! memory lpmm and candle hold.

use lpmm_optim::{MemoryReport, StepReport};

use crate::engine::on_engine_ref;
use crate::optimizer::{Inner, LpmmOptimizer};

impl Inner {
    /// Logs a step's report: skipped steps and non-finite gradients as warnings.
    pub(crate) fn log(&self, report: &StepReport) {
        let steps = on_engine_ref!(&self.opt, o => o.status().steps);
        let names: Vec<String> = report
            .non_finite
            .iter()
            .filter_map(
                |id| on_engine_ref!(&self.opt, o => o.param(*id).ok().map(|p| p.name.to_string())),
            )
            .collect();
        if report.skipped {
            tracing::warn!(
                step = steps,
                non_finite = ?names,
                "lpmm skipped the step: non-finite gradients (no parameter or state changed)"
            );
        } else if !names.is_empty() {
            tracing::warn!(
                step = steps,
                non_finite = ?names,
                "lpmm left the elements with non-finite gradients unchanged"
            );
        }
        tracing::debug!(
            step = steps,
            updated = report.updated,
            grad_norm = report.grad_norm,
            "lpmm step"
        );
    }
}

impl LpmmOptimizer {
    /// The model memory lpmm holds (parameters in their storage — a lent parameter, which is
    /// the `Var`, is not counted here —, gradient accumulators, states).
    pub fn memory_report(&self) -> MemoryReport {
        on_engine_ref!(&self.shared.lock().opt, o => o.memory_report())
    }

    /// Bytes candle holds for the `Var`s themselves (in their dtype), lent or not.
    pub fn candle_bytes(&self) -> usize {
        self.shared
            .lock()
            .vars
            .iter()
            .map(|e| e.var.elem_count() * e.var.dtype().size_in_bytes())
            .sum()
    }

    /// Bytes of the `Var`s lent to lpmm as its parameters (stepped in place): model memory that
    /// candle holds and [`LpmmOptimizer::memory_report`] does not count.
    pub fn lent_bytes(&self) -> usize {
        self.shared
            .lock()
            .vars
            .iter()
            .filter(|e| e.lent)
            .map(|e| e.var.elem_count() * e.var.dtype().size_in_bytes())
            .sum()
    }

    /// The names of the registered `Var`s whose parameter lpmm holds as a second copy.
    pub fn copied_vars(&self) -> Vec<String> {
        self.shared
            .lock()
            .vars
            .iter()
            .filter(|e| !e.lent)
            .map(|e| e.name.clone())
            .collect()
    }

    /// The last step's report (skipped, non-finite parameters, global gradient norm).
    pub fn last_report(&self) -> Option<StepReport> {
        self.shared.lock().last.clone()
    }
}
