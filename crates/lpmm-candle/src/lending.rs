//! The `Var`s lent to lpmm as its parameters: a [`Lender`] that hands each `Var`'s storage to a
//! step, a checkpoint or a move between the training and evaluation points.

use candle_core::Var;
use lpmm_optim::Parts;
use lpmm_optim::{Lender, OptimError, Optimizer, ParamId};

use crate::lane::{Lane, lend_input};
use crate::register::{Entry, var_of};

/// The `Var`s as lpmm's lent parameters.
pub(crate) struct VarLender<'a, B> {
    vars: &'a [Entry],
    by_id: &'a [Option<usize>],
    backend: B,
}

/// Runs `$body` with `$o` bound to the engine's optimizer and `$lender` to the `Var`s lent to it
/// (a [`VarLender`]), on `$inner` (an `&mut Inner`), whatever the engine's backend.
macro_rules! with_lent_vars {
    ($inner:expr, $o:ident, $lender:ident => $body:expr) => {{
        let $crate::optimizer::Inner {
            opt, vars, by_id, ..
        } = $inner;
        $crate::engine::on_engine!(opt, $o => {
            let mut $lender = $crate::lending::VarLender::new($o, vars, by_id);
            $body
        })
    }};
}

pub(crate) use with_lent_vars;

impl<'a, B: Lane> VarLender<'a, B> {
    pub(crate) fn new(opt: &Optimizer<B>, vars: &'a [Entry], by_id: &'a [Option<usize>]) -> Self {
        VarLender {
            vars,
            by_id,
            backend: Parts::of(opt).backend().clone(),
        }
    }
}

impl<B> VarLender<'_, B> {
    fn var(&self, id: ParamId) -> std::result::Result<&Var, OptimError> {
        var_of(self.vars, self.by_id, id)
            .ok_or_else(|| OptimError::UnknownParam(format!("#{}", id.index())))
    }
}

impl<B: Lane> Lender<B> for VarLender<'_, B> {
    fn lend(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(B::Input<'_>) -> std::result::Result<(), OptimError>,
    ) -> std::result::Result<(), OptimError> {
        let var = self.var(id)?;
        lend_input(&self.backend, var.as_tensor(), f)
    }

    fn lend_mut(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(B::Output<'_>) -> std::result::Result<(), OptimError>,
    ) -> std::result::Result<(), OptimError> {
        let var = self.var(id)?;
        self.backend.output(var.as_tensor(), f)
    }
}
