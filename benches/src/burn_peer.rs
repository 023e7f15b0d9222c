//! burn's AdamW (burn-optim 0.22, f32, ndarray backend on CPU) over one tensor.
//!
//! burn 0.22 picks the backend by device at run time: the parameter lives on
//! `Device::ndarray().autodiff()`, its gradient on the plain ndarray device, as
//! `GradientsParams::from_grads` would leave it. burn-optim has no 8-bit optimizer (0.22.1).

use burn_core as burn;

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData};
use burn_optim::{AdamWConfig, GradientsParams, ModuleOptimizer};

/// One trainable tensor.
#[derive(Module, Debug)]
struct Single {
    weight: Param<Tensor<1>>,
}

/// An AdamW optimizer over one f32 parameter, with a fixed gradient.
pub struct BurnAdamW {
    /// `ModuleOptimizer::step` consumes the module and returns the updated one.
    module: Option<Single>,
    optim: ModuleOptimizer,
    grad: Tensor<1>,
    device: Device,
    lr: f64,
}

impl std::fmt::Debug for BurnAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BurnAdamW").field("lr", &self.lr).finish()
    }
}

impl BurnAdamW {
    /// Parameter and gradient from `init` and `grad`; torch's AdamW defaults (eps 1e-8, weight
    /// decay 1e-2).
    #[allow(deprecated)] // `Device::ndarray` is deprecated in favour of `Device::flex` in 0.22.
    pub fn new(init: &[f32], grad: &[f32], lr: f64) -> Self {
        let inner = Device::ndarray();
        let device = inner.clone().autodiff();
        let weight = Param::from_tensor(Tensor::<1>::from_data(
            TensorData::new(init.to_vec(), [init.len()]),
            &device,
        ));
        let grad = Tensor::<1>::from_data(TensorData::new(grad.to_vec(), [grad.len()]), &inner);
        Self {
            module: Some(Single { weight }),
            optim: AdamWConfig::new()
                .with_epsilon(1e-8)
                .with_weight_decay(1e-2)
                .init(),
            grad,
            device,
            lr,
        }
    }

    /// One step. The gradient container is consumed by the step, so a new one is built each
    /// time around the same gradient tensor (a reference-count bump, no copy).
    pub fn step(&mut self) {
        let Some(module) = self.module.take() else {
            return;
        };
        let mut grads = GradientsParams::new();
        grads.register(module.weight.id, self.grad.clone());
        self.module = Some(self.optim.step(self.lr, module, grads));
        // ndarray runs eagerly; kept so the timing holds on any backend.
        let _ = self.device.sync();
    }
}
