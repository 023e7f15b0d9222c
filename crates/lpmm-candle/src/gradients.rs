//! candle's gradients handed to a step: each read where candle computed it (a `GradStore`) and
//! dropped once its parameter has stepped.

use candle_core::Var;
use candle_core::backprop::GradStore;
use lpmm_optim::{Gradients, OptimError, ParamId, WithGradient};

use crate::lane::{Lane, lend_input};
use crate::register::{Entry, var_of};

/// candle's gradients as lpmm's: each read where it is and dropped once its parameter has
/// stepped.
pub(crate) struct GradSource<'a, B> {
    /// A backward pass's gradients, each removed once its parameter has stepped.
    pub(crate) grads: Option<&'a mut GradStore>,
    /// Gradients only read (`candle_nn::Optimizer::step`).
    pub(crate) shared: Option<&'a GradStore>,
    pub(crate) vars: &'a [Entry],
    pub(crate) by_id: &'a [Option<usize>],
    pub(crate) backend: B,
}

impl<B> GradSource<'_, B> {
    fn store(&self) -> Option<&GradStore> {
        self.grads.as_deref().or(self.shared)
    }

    fn var(&self, id: ParamId) -> Option<&Var> {
        var_of(self.vars, self.by_id, id)
    }
}

impl<B: Lane> Gradients<B> for GradSource<'_, B> {
    fn gradient(
        &mut self,
        id: ParamId,
        f: &mut WithGradient<'_, B>,
    ) -> std::result::Result<(), OptimError> {
        let grad = self
            .var(id)
            .and_then(|v| self.store().and_then(|s| s.get(v.as_tensor())));
        let Some(grad) = grad else { return f(None) };
        lend_input(&self.backend, grad, |v| f(Some(v)))
    }

    fn consumed(&mut self, id: ParamId) {
        if let Some(var) = self.var(id).cloned()
            && let Some(grads) = self.grads.as_deref_mut()
        {
            grads.remove(var.as_tensor());
        }
    }
}
