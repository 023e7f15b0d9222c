//! Checkpoints of an [`LpmmOptimizer`]: the optimizer's complete state, the `Var`s lent to it
//! included. The only calls of lpmm-optim's checkpoint functions in this crate.

use candle_core::Result;

use lpmm_optim::Checkpoint;

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
    /// and storages): the `Var`s take the saved values, the states, counters and random streams
    /// continue exactly.
    pub fn load(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let mut inner = self.shared.lock();
        with_lent_vars!(&mut *inner, o, lender => {
            o.load(path, Checkpoint::new().lender(&mut lender)).map_err(wrap)
        })?;
        inner.sync()
    }
}
