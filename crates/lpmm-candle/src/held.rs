//! The parameters lpmm holds for the layers of [`nn`](crate::nn): registered from a layer's
//! initial weight, decoded for each use, and given the gradient of each backward pass.

use candle_core::{Result, Tensor};
use lpmm_optim::Out;
use lpmm_optim::Parts;
use lpmm_optim::{Optimizer, ParamId, SlotKind};

use crate::engine::{on_engine, on_engine_ref};
use crate::error::wrap;
use crate::lane::{Lane, initial_f32};
use crate::optimizer::Inner;

/// Decodes held parameter `id` into `t` (a fresh f32 tensor of its shape on `opt`'s device).
fn decode_on<B: Lane>(opt: &Optimizer<B>, id: ParamId, t: &Tensor) -> Result<()> {
    let backend = Parts::of(opt).backend().clone();
    backend
        .output(t, &mut |out| {
            opt.read(id, SlotKind::Param, Out::Backend(out))
        })
        .map_err(wrap)
}

/// Hands `grad` to held parameter `id`: added into its accumulator, or a released step where its
/// configuration keeps none. Read where candle computed it.
fn give_on<B: Lane>(opt: &mut Optimizer<B>, id: ParamId, grad: &Tensor) -> Result<()> {
    let released = opt.param(id).map_err(wrap)?.config.grad == lpmm_optim::Storage::None;
    let backend = Parts::of(opt).backend().clone();
    backend.input(grad, |g| {
        if released {
            opt.step(lpmm_optim::Step::param(id, lpmm_optim::Grad::Input(g)))
                .map(drop)
                .map_err(wrap)
        } else {
            opt.accumulate(id, lpmm_optim::Grad::Input(g)).map_err(wrap)
        }
    })
}

impl Inner {
    /// Registers a parameter lpmm holds for a layer ([`nn`](crate::nn)), initialised with
    /// `init`, on `init`'s device (the CPU, or with feature `cuda` a CUDA device: the engine's
    /// device, as a `Var`'s picks it).
    pub(crate) fn register_held(&mut self, name: &str, init: &Tensor) -> Result<ParamId> {
        self.take_device(init.device(), |location, engine| {
            format!(
                "layer {name}'s weight is on {location:?}, but this optimizer steps parameters on \
                 {engine}: lpmm steps the parameters of one device"
            )
        })?;
        let shape = init.dims().to_vec();
        let (group, config) = self.config.config_for(name, &shape);
        initial_f32(init, |values| {
            on_engine!(&mut self.opt, o => o.add_param_with(name, &shape, values, group, config))
                .map_err(wrap)
        })
    }

    /// Held parameter `id` decoded into `t` (f32, its shape, on the engine's device).
    pub(crate) fn decode_held(&self, id: ParamId, t: &Tensor) -> Result<()> {
        on_engine_ref!(&self.opt, o => decode_on(o, id, t))
    }

    /// A layer's gradient for held parameter `id` (see [`give_on`]).
    pub(crate) fn give_held(&mut self, id: ParamId, grad: &Tensor) -> Result<()> {
        on_engine!(&mut self.opt, o => give_on(o, id, grad))
    }
}
