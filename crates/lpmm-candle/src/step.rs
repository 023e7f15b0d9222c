//! The step: gradients from candle's `GradStore` and lpmm's accumulators, the `Var`s lent, the
//! copied `Var`s set after it; micro-batch accumulation; the move between the training and
//! evaluation points.

use candle_core::backprop::GradStore;
use candle_core::{DType, Error, Result, Tensor};
use lpmm_optim::Parts;
use lpmm_optim::{Mode, SlotKind};
use lpmm_optim::{Optimizer, StepReport};

#[cfg(feature = "cuda")]
use crate::engine::Engine;
use crate::engine::on_engine;
use crate::error::wrap;
use crate::gradients::GradSource;
use crate::lane::Lane;
use crate::lending::{VarLender, with_lent_vars};
use crate::optimizer::{Inner, LpmmOptimizer};
use crate::register::{Entry, contents};

/// Steps `opt` from `grads`/`shared` and every pending accumulator, the `Var`s lent.
fn step_on<B: Lane>(
    opt: &mut Optimizer<B>,
    vars: &[Entry],
    by_id: &[Option<usize>],
    grads: Option<&mut GradStore>,
    shared: Option<&GradStore>,
) -> Result<StepReport> {
    let mut source = GradSource {
        grads,
        shared,
        vars,
        by_id,
        backend: Parts::of(opt).backend().clone(),
    };
    let mut lender = VarLender::new(opt, vars, by_id);
    opt.step(lpmm_optim::Step::given(&mut source).lent(lpmm_optim::Lent::Lender(&mut lender)))
        .map_err(wrap)
}

/// Adds a micro-batch's gradients into `opt`'s accumulators, dropping each from `grads` once
/// added.
fn accumulate_on<B: Lane>(
    opt: &mut Optimizer<B>,
    vars: &[Entry],
    grads: &mut GradStore,
) -> Result<()> {
    let backend = Parts::of(opt).backend().clone();
    for e in vars {
        if let Some(g) = grads.remove(e.var.as_tensor()) {
            backend.input(&g, |v| {
                opt.accumulate(e.id, lpmm_optim::Grad::Input(v))
                    .map_err(wrap)
            })?;
        }
    }
    Ok(())
}

/// The smallest magnitude f32 rounds to infinity in f16 (to nearest, ties to even: halfway
/// between 65504, f16's largest, and 65536).
const F16_OVERFLOW: f32 = 65520.0;

/// How many of `values` (finite in lpmm's storage) become infinite in f16, and the largest.
fn f16_overflow(values: &[f32]) -> Option<(usize, f32)> {
    let over = values
        .iter()
        .filter(|v| v.is_finite() && v.abs() >= F16_OVERFLOW);
    let (n, max) = over.fold((0, 0f32), |(n, m), v| (n + 1, m.max(v.abs())));
    (n > 0).then_some((n, max))
}

/// Says so where an f16 `Var` is set to values that overflow f16 (the `Var` then holds
/// infinities where lpmm's parameter is finite).
fn warn_f16_overflow(name: &str, values: &[f32]) {
    if let Some((n, max)) = f16_overflow(values) {
        lpmm_optim::user_warning(
            "lpmm-candle",
            &format!(
                "Var {name} is f16 and {n} of its values in lpmm's storage overflow f16 (up to \
                 {max}): the Var holds infinity there while lpmm's parameter is finite; keep it \
                 in f32 or bf16"
            ),
        );
    }
}

impl Inner {
    /// Sets every `Var` that is not lent to its parameter as lpmm stores it.
    pub(crate) fn sync(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &self.opt {
            return e.sync(self.vars.iter().filter(|e| !e.lent).map(|e| (e.id, &e.var)));
        }
        let opt = self.opt.cpu()?;
        for e in self.vars.iter().filter(|e| !e.lent) {
            let mut values = vec![0f32; e.var.elem_count()];
            opt.read(e.id, SlotKind::Param, &mut values).map_err(wrap)?;
            if e.var.dtype() == DType::F16 {
                warn_f16_overflow(&e.name, &values);
            }
            let t =
                Tensor::from_vec(values, e.var.shape(), e.var.device())?.to_dtype(e.var.dtype())?;
            e.var.set(&t)?;
            e.written.set(contents(&e.var));
        }
        Ok(())
    }

    /// Refuses a step where a `Var` lpmm holds a copy of was written since lpmm set it
    /// (`Var::set`, `VarMap::load`): the step would start from lpmm's copy and overwrite the
    /// write.
    fn check_copies(&self) -> Result<()> {
        for e in self.vars.iter().filter(|e| !e.lent) {
            if let Some(w) = e.written.get()
                && contents(&e.var) != Some(w)
            {
                return Err(Error::Msg(format!(
                    "Var {} was written since lpmm's last step (Var::set, VarMap::load), but lpmm \
                     holds its value in its own storage ({:?} Var, not the storage's dtype) and \
                     would step from that, losing the write: nothing was stepped. Load the \
                     weights before creating the optimizer, or create the Vars in \
                     LpmmConfig::var_dtype so that lpmm steps them in place",
                    e.name,
                    e.var.dtype()
                )));
            }
        }
        Ok(())
    }

    fn check_lr(&mut self) -> Result<()> {
        if let Some(lr) = self.rejected_lr.take() {
            return Err(Error::Msg(format!(
                "learning rate {lr} was rejected: it must be finite, >= 0 and finite in f32"
            )));
        }
        Ok(())
    }

    /// Steps from `source` and every pending accumulator, then logs and keeps the report.
    pub(crate) fn step(
        &mut self,
        grads: Option<&mut GradStore>,
        shared: Option<&GradStore>,
    ) -> Result<StepReport> {
        self.check_lr()?;
        self.check_copies()?;
        let Inner {
            opt, vars, by_id, ..
        } = self;
        let report = on_engine!(opt, o => step_on(o, vars, by_id, grads, shared))?;
        self.sync()?;
        self.log(&report);
        self.last = Some(report.clone());
        Ok(report)
    }
}

impl LpmmOptimizer {
    /// Adds the gradients of one micro-batch into lpmm's gradient accumulators (in their storage
    /// format), dropping each from `grads` once added, so the f32 gradients never outlive their
    /// accumulation. `Var`s without a gradient are skipped. Finish with
    /// [`LpmmOptimizer::apply`].
    pub fn accumulate(&mut self, mut grads: GradStore) -> Result<()> {
        let mut inner = self.shared.lock();
        let Inner { opt, vars, .. } = &mut *inner;
        on_engine!(opt, o => accumulate_on(o, vars, &mut grads))
    }

    /// Steps every parameter with accumulated gradients (micro-batches of
    /// [`LpmmOptimizer::accumulate`], an lpmm layer's backward passes).
    pub fn apply(&mut self) -> Result<StepReport> {
        self.shared.lock().step(None, None)
    }

    /// Steps from the gradients of a backward pass (and any accumulated ones), dropping each from
    /// `grads` once its parameter has stepped.
    pub fn step_grads(&mut self, grads: &mut GradStore) -> Result<StepReport> {
        self.shared.lock().step(Some(grads), None)
    }

    /// Moves the `Var`s to the point the optimizer evaluates at (schedule-free AdamW: the average
    /// `x`, as the `schedulefree` package's `optimizer.eval()`); parameters of other rules do not
    /// change. Steps are refused until [`LpmmOptimizer::train`]. Call it before evaluating or
    /// saving the model for inference; a no-op when already there.
    pub fn eval(&mut self) -> Result<()> {
        self.switch(true)
    }

    /// Moves the `Var`s back to the training point ([`LpmmOptimizer::eval`]'s inverse).
    pub fn train(&mut self) -> Result<()> {
        self.switch(false)
    }

    fn switch(&mut self, eval: bool) -> Result<()> {
        let mut inner = self.shared.lock();
        with_lent_vars!(&mut *inner, o, lender => {
            if eval {
                o.set_mode(Mode::Eval, lpmm_optim::Lent::Lender(&mut lender)).map_err(wrap)
            } else {
                o.set_mode(Mode::Train, lpmm_optim::Lent::Lender(&mut lender)).map_err(wrap)
            }
        })?;
        inner.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_overflow_counts_what_f16_rounds_to_infinity() -> Result<()> {
        let values = [
            1.0,
            65504.0,
            65519.0,
            65520.0,
            -70000.0,
            f32::INFINITY,
            f32::NAN,
        ];
        // The count agrees with candle's own conversion (which the Var is set through).
        let t = Tensor::new(&values, &candle_core::Device::Cpu)?.to_dtype(DType::F16)?;
        let back = t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let became_infinite = values
            .iter()
            .zip(&back)
            .filter(|(v, b)| v.is_finite() && b.is_infinite())
            .count();
        assert_eq!(became_infinite, 2);
        assert_eq!(f16_overflow(&values), Some((2, 70000.0)));
        assert_eq!(f16_overflow(&values[..3]), None);
        Ok(())
    }
}
