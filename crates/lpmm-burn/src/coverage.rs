//! [`check_gradients`]: the missing-gradient check over a module, for training loops whose
//! optimizer sees one tensor at a time (burn's `ModuleOptimizer`, burn-train's `Learner`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_core::module::Module;
use burn_optim::GradientsParams;
use lpmm_optim::{CoverageCheck, MissingGradientPolicy, MissingGradients};

use crate::BurnError;
use crate::core::Uncovered;
use crate::optimizer::MISSING_GRADIENT_HELP;

/// The parameters of `module` that require a gradient and have none in `grads`, labelled by burn
/// `ParamId` and module path (`"1234 (layers.0.weight)"`), with `policy` applied: `Warn` warns
/// (`tracing` where a subscriber records lpmm's warnings, stderr otherwise) the first time a set
/// of such parameters is found and whenever it changes, `Error` returns
/// [`BurnError::Optim`] with `OptimError::MissingGradient` naming them, `Ignore` only reports.
///
/// burn's `ModuleOptimizer` steps the parameters that have a gradient and tells its per-tensor
/// optimizers nothing of the others, so [`crate::LpmmTensorOptimizer`] cannot see a parameter
/// that never gets one (a layer the loss does not use, a detached tensor). With burn-train, call
/// this where the gradients are made, in `TrainStep::step`:
///
/// ```ignore
/// let grads = GradientsParams::from_grads(loss.backward(), self);
/// lpmm_burn::check_gradients(self, &grads, MissingGradientPolicy::Warn)?; // or .ok()
/// TrainOutput { grads, item }
/// ```
///
/// A parameter frozen on purpose (`Param::set_require_grad(false)`, `Module::no_grad`) and an
/// empty tensor are not counted. The whole-module [`crate::LpmmOptimizer`] makes this check at
/// every step itself.
pub fn check_gradients<M: Module>(
    module: &M,
    grads: &GradientsParams,
    policy: MissingGradientPolicy,
) -> Result<MissingGradients, BurnError> {
    /// The warning's state (which set it last named), process-wide, and the checks made.
    static CHECK: Mutex<Option<CoverageCheck>> = Mutex::new(None);
    static CHECKS: AtomicU64 = AtomicU64::new(0);
    let mut uncovered = Uncovered::new(grads);
    module.visit(&mut uncovered);
    let missing = MissingGradients::new(
        uncovered.checked,
        uncovered.missing.iter().map(String::as_str),
    );
    let step = CHECKS.fetch_add(1, Ordering::Relaxed) + 1;
    let mut check = CHECK.lock().unwrap_or_else(|e| e.into_inner());
    let check = check.get_or_insert_with(|| CoverageCheck::new(policy, MISSING_GRADIENT_HELP));
    check.set_policy(policy);
    check.check(&missing, step)?;
    Ok(missing)
}
