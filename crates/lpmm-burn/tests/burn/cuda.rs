//! lpmm's optimizers on burn's CUDA device (feature `cuda`): lpmm-cuda steps the module's
//! parameters in burn's device memory (`CudaView`s of cubecl's pointers, the one `unsafe` of
//! lpmm-burn) and reads its gradients there; every step equals lpmm's CPU reference bit for bit.
//! Runs where a driver and a GPU are present and says so plainly elsewhere;
//! `LPMM_REQUIRE_CUDA=1` makes their absence a failure.

#![cfg(feature = "cuda")]

use crate::common::{Mlp, grads, host_grads, read, reference, reference_step, values};
use burn_core::tensor::Device;
use lpmm_burn::{Lpmm8bitAdamWConfig, LpmmOptimizerConfig};
use lpmm_optim::{NonFinitePolicy, presets};

/// burn's CUDA device 0, or `None` with a message when there is no driver or device.
fn device() -> Option<Device> {
    if let Err(e) = lpmm_cuda::Cuda::new(0) {
        if std::env::var("LPMM_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
            panic!("LPMM_REQUIRE_CUDA=1 but {e}");
        }
        eprintln!("skipping the burn CUDA test: {e}");
        return None;
    }
    Some(Device::cuda(0).autodiff())
}

/// Trains on burn's CUDA device and with lpmm's CPU reference on the same gradients.
fn same_as_cpu(config: LpmmOptimizerConfig, steps: usize) {
    let Some(device) = device() else {
        return;
    };
    let mut model = Mlp::new(&device, 7);
    let mut optim = config.init_whole_module();
    let (mut r, ids) = reference(&config, &values(&model));
    for step in 0..steps {
        let g = grads(&model, step, &device);
        let want = reference_step(&mut r, &ids, host_grads(&model, &g), 1e-2);
        model = optim.step(1e-2, model, g).unwrap();
        assert_eq!(optim.last_report(), Some(want), "step {step}");
        assert_eq!(model.bits(), read(&r, &ids), "step {step}");
    }
    let stats = optim.stats();
    assert_eq!(stats.lane, Some("cuda"));
    assert_eq!(stats.copies, 0);
}

#[test]
fn eight_bit_adamw_on_burns_cuda_device_equals_the_cpu_reference() {
    let config = Lpmm8bitAdamWConfig::new()
        .lpmm()
        .with_non_finite(NonFinitePolicy::SkipElements);
    same_as_cpu(config, 4);
}

#[test]
fn clipping_and_held_eight_bit_parameters_on_cuda_equal_the_cpu_reference() {
    same_as_cpu(
        Lpmm8bitAdamWConfig::new()
            .with_max_grad_norm(Some(0.05))
            .lpmm(),
        3,
    );
    same_as_cpu(
        LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(3),
        3,
    );
}
