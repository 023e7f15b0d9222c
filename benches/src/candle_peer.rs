//! candle-nn's AdamW (f32) over one tensor: the Rust peer every candle user has.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

/// An AdamW optimizer over one f32 parameter of `n` elements, with a fixed gradient.
#[derive(Debug)]
pub struct CandleAdamW {
    opt: AdamW,
    grads: GradStore,
}

impl CandleAdamW {
    /// Parameter and gradient from `init` and `grad`.
    pub fn new(init: &[f32], grad: &[f32], lr: f64) -> candle_core::Result<Self> {
        let var = Var::from_tensor(&Tensor::from_slice(init, init.len(), &Device::Cpu)?)?;
        let mut grads = GradStore::default();
        grads.insert(
            var.as_tensor(),
            Tensor::from_slice(grad, grad.len(), &Device::Cpu)?,
        );
        let opt = AdamW::new(
            vec![var],
            ParamsAdamW {
                lr,
                ..Default::default()
            },
        )?;
        Ok(Self { opt, grads })
    }

    /// One step.
    pub fn step(&mut self) -> candle_core::Result<()> {
        self.opt.step(&self.grads)
    }
}
