//! lpmm's optimizers on burn's wgpu device (Mesa's lavapipe in CI): lpmm-wgpu runs on burn's own
//! wgpu device and queue, steps the module's parameters in burn's buffers and reads its gradients
//! where burn wrote them. A step maps nothing back to the host but lpmm's 4-byte non-finite
//! flags when no gradient norm is needed, and its results equal lpmm's CPU reference bit for bit.

use std::sync::OnceLock;

use crate::common::{
    D_IN, D_OUT, HIDDEN, Mlp, grads, host_grads, read, reference, reference_step, values,
};
use burn_core::tensor::Device;
use lpmm_burn::{Lpmm8bitAdamWConfig, LpmmOptimizerConfig};
use lpmm_optim::{NonFinitePolicy, presets};

/// The tests share one device and its read counters: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// burn's wgpu device shared with lpmm (initialised once per process), or `None` with a message
/// when there is no adapter; `LPMM_REQUIRE_WGPU=1` (CI) makes that a failure.
fn device() -> Option<Device> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    match DEVICE
        .get_or_init(|| lpmm_burn::wgpu::init(Device::wgpu_options()).map_err(|e| e.to_string()))
    {
        Ok(d) => Some(d.clone().autodiff()),
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_WGPU=1 but {e}");
            }
            eprintln!("skipping the burn wgpu test: {e}");
            None
        }
    }
}

/// Trains on the wgpu device and with lpmm's CPU reference on the same gradients; every
/// parameter bit must agree after every step. Returns the host reads (maps, bytes) of each step.
fn same_as_cpu(config: LpmmOptimizerConfig, steps: usize) -> Option<Vec<(u64, u64)>> {
    let _serial = serial();
    let device = device()?;
    let mut model = Mlp::new(&device, 7);
    let mut optim = config.init();
    let (mut r, ids) = reference(&config, &values(&model));
    let mut reads = Vec::new();
    for step in 0..steps {
        let g = grads(&model, step, &device);
        let want = reference_step(&mut r, &ids, host_grads(&model, &g), 1e-2);
        let counts = |o: &lpmm_burn::LpmmOptimizer| {
            let s = o.stats();
            (s.host_reads.unwrap_or(0), s.host_read_bytes.unwrap_or(0))
        };
        let before = counts(&optim);
        model = optim.step(1e-2, model, g).unwrap();
        let after = counts(&optim);
        reads.push((after.0 - before.0, after.1 - before.1));
        assert_eq!(optim.last_report(), Some(want), "step {step}");
        assert_eq!(model.bits(), read(&r, &ids), "step {step}");
    }
    Some(reads)
}

/// Bytes of the model's parameters (as many as of its gradients).
const MODEL_BYTES: u64 = 4 * (D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT) as u64;

#[test]
fn eight_bit_adamw_on_burns_wgpu_device_equals_the_cpu_reference_without_host_round_trips() {
    let config = Lpmm8bitAdamWConfig::new()
        .lpmm()
        .with_non_finite(NonFinitePolicy::SkipElements);
    let Some(reads) = same_as_cpu(config, 4) else {
        return;
    };
    // The first step registers the parameters (lpmm checks that a lent parameter is finite).
    // Every later step reads back only lpmm's non-finite flags: one 4-byte word per parameter
    // after each parameter's step (4 parameters: 4 reads of 16 bytes) -- no parameter, gradient
    // or state crosses to the host.
    for &(maps, bytes) in &reads[1..] {
        assert_eq!((maps, bytes), (4, 64), "{reads:?}");
    }
}

#[test]
fn clipping_and_the_skip_step_policy_on_wgpu_equal_the_cpu_reference() {
    // The gradient norm is needed: lpmm-wgpu brings each gradient back to the host to sum its
    // squares in the CPU's order (the price of a norm bit-identical to the CPU's), so such a step
    // reads the gradients' bytes, and still never a parameter or a state.
    let config = Lpmm8bitAdamWConfig::new()
        .with_max_grad_norm(Some(0.05))
        .lpmm();
    let Some(reads) = same_as_cpu(config, 3) else {
        return;
    };
    for &(maps, bytes) in &reads[1..] {
        assert_eq!((maps, bytes), (8, MODEL_BYTES + 64), "{reads:?}");
    }
}

#[test]
fn eight_bit_parameters_held_by_lpmm_on_wgpu_equal_the_cpu_reference() {
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(3);
    same_as_cpu(config, 3);
}

#[test]
fn the_step_writes_burns_own_buffers() {
    let _serial = serial();
    let Some(device) = device() else {
        return;
    };
    let mut model = Mlp::new(&device, 1);
    let mut optim = Lpmm8bitAdamWConfig::new().init();
    for step in 0..3 {
        let g = grads(&model, step, &device);
        model = optim.step(1e-3, model, g).unwrap();
    }
    let stats = optim.stats();
    assert_eq!(stats.lane, Some("wgpu"));
    assert_eq!((stats.params, stats.held, stats.copies), (4, 0, 0));
    // lpmm allocated no parameter and no gradient memory on the device: the module's buffers
    // are the parameters, burn's gradient buffers are read where they are.
    assert_eq!(optim.memory_report().slot_totals()[0], 0);
    assert_eq!(optim.memory_report().slot_totals()[1], 0);
}
