//! Where lent parameters' buffers come from ([`Lent`], [`Lender`]): a framework's tensors that
//! *are* lpmm's parameters ([`crate::Optimizer::add_lent_param`]), handed to the operations that
//! move or read them. The step executor ([`crate::exec`]) obtains and checks them.

use crate::backend::{Backend, ParamId};
use crate::error::OptimError;

/// Lends the buffers of lent parameters ([`crate::Optimizer::add_lent_param`]) to operations that
/// need them: a framework hands out its tensors' memory only inside a callback (candle's in-place
/// operations), so the optimizer asks for one buffer at a time.
pub trait Lender<B: Backend> {
    /// Calls `f` with parameter `id`'s buffer, read-only.
    fn lend(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(B::Input<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError>;
    /// Calls `f` with parameter `id`'s buffer, writable.
    fn lend_mut(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(B::Output<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError>;
}

/// Where the buffers of lent parameters ([`crate::Optimizer::add_lent_param`]) are, for the
/// operations that move them: [`crate::Optimizer::step`] (`Step::lent`) and
/// [`crate::Optimizer::set_mode`]. [`crate::Optimizer::save`] and [`crate::Optimizer::load`] take
/// a [`Lender`] ([`crate::Checkpoint::lender`]).
pub enum Lent<'s, 'a: 's, B: Backend> {
    /// No buffers: no lent parameter may move (an error naming the first that would).
    None,
    /// The buffers, each with its parameter (at most once each).
    Buffers(&'s mut [(ParamId, B::Output<'a>)]),
    /// Buffers lent one at a time, on request.
    Lender(&'s mut dyn Lender<B>),
}

impl<B: Backend> std::fmt::Debug for Lent<'_, '_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lent::None => f.write_str("None"),
            Lent::Buffers(b) => {
                let ids: Vec<ParamId> = b.iter().map(|(id, _)| *id).collect();
                f.debug_tuple("Buffers").field(&ids).finish()
            }
            Lent::Lender(_) => f.write_str("Lender(..)"),
        }
    }
}
