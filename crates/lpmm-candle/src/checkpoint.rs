//! Checkpoints of an [`LpmmOptimizer`]: the optimizer's complete state, the `Var`s lent to it
//! included. The only calls of lpmm-optim's checkpoint functions in this crate.

use candle_core::Result;

use lpmm_optim::{Checkpoint, LoadPolicy};

use crate::LpmmOptimizer;
use crate::error::wrap;
use crate::lending::with_lent_vars;

impl LpmmOptimizer {
    /// Writes the optimizer's complete state, the `Var`s' values included, to `path` (an lpmm
    /// safetensors checkpoint, atomic).
    pub fn save(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let mut inner = self.shared.lock();
        with_lent_vars!(&mut *inner, o, lender => o.save(path, Checkpoint::new().lender(&mut lender)).map_err(wrap))
    }

    /// Restores a checkpoint of [`LpmmOptimizer::save`] into this optimizer (the same parameters
    /// and configuration): the `Var`s take the saved values, the states, counters and random
    /// streams continue exactly. The learning rates are the checkpoint's (a schedule's
    /// `set_learning_rate` had changed them when it was saved; [`Optimizer::learning_rate`]
    /// returns the saved one); any other difference of configuration is refused, and a refused
    /// load changes nothing.
    ///
    /// [`Optimizer::learning_rate`]: candle_nn::Optimizer::learning_rate
    pub fn load(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let mut inner = self.shared.lock();
        let lr = with_lent_vars!(&mut *inner, o, lender => {
            let how = Checkpoint::new()
                .lender(&mut lender)
                .policy(LoadPolicy::TakeLearningRates);
            o.load(path, how).map_err(wrap)?;
            Ok::<_, candle_core::Error>(o.groups().first().map(|g| g.hyper.lr()))
        })?;
        // The default group's rate, as `set_learning_rate` set it (its ratio is 1).
        if let Some(lr) = lr {
            inner.lr = lr;
            inner.rejected_lr = None;
        }
        inner.sync()
    }
}
