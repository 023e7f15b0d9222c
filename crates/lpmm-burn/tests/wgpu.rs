//! lpmm's optimizers on burn's wgpu device (Mesa's lavapipe in CI): lpmm-wgpu runs on burn's own
//! wgpu device and queue, steps the module's parameters in burn's buffers and reads its gradients
//! where burn wrote them. A step maps nothing back to the host but lpmm's 4-byte non-finite
//! flags when no gradient norm is needed, and its results equal lpmm's CPU reference bit for bit.

mod common;

use std::sync::OnceLock;

use burn_core::tensor::Device;
use common::{Mlp, grads, host_grads, shapes, values};
use lpmm_burn::{Lpmm8bitAdamWConfig, LpmmOptimizerConfig};
use lpmm_optim::{NonFinitePolicy, Optimizer, ParamId, presets};

/// burn's wgpu device shared with lpmm (initialised once per process), or `None` with a message
/// when there is no adapter; `LPMM_REQUIRE_WGPU=1` (CI) makes that a failure.
fn device() -> Option<Device> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    match DEVICE.get_or_init(|| {
        lpmm_burn::wgpu::init(Device::wgpu_options()).map_err(|e| e.to_string())
    }) {
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

fn reference(config: &LpmmOptimizerConfig, init: &[Vec<f32>]) -> (Optimizer, Vec<ParamId>) {
    let mut r = Optimizer::new(config.options).unwrap();
    r.add_group(config.param).unwrap();
    let ids = shapes()
        .iter()
        .zip(init)
        .enumerate()
        .map(|(i, (s, v))| r.add_param(&format!("p{i}"), s, v, 0).unwrap())
        .collect();
    (r, ids)
}

fn read(r: &Optimizer, ids: &[ParamId]) -> Vec<Vec<u32>> {
    ids.iter()
        .zip(shapes())
        .map(|(&id, s)| {
            let mut out = vec![0f32; s.iter().product()];
            r.read_param(id, &mut out).unwrap();
            out.into_iter().map(f32::to_bits).collect()
        })
        .collect()
}

/// Trains on the wgpu device and with lpmm's CPU reference on the same gradients; every
/// parameter bit must agree after every step. Returns the host reads of each step.
fn same_as_cpu(config: LpmmOptimizerConfig, steps: usize) -> Option<Vec<u64>> {
    let device = device()?;
    let mut model = Mlp::new(&device, 7);
    let mut optim = config.init();
    let (mut r, ids) = reference(&config, &values(&model));
    let mut reads = Vec::new();
    for step in 0..steps {
        let g = grads(&model, step, &device);
        for (&id, h) in ids.iter().zip(host_grads(&model, &g)) {
            r.accumulate(id, &h).unwrap();
        }
        r.set_lr(1e-2).unwrap();
        let want = r.step().unwrap();
        let before = optim.stats().host_reads.unwrap_or(0);
        model = optim.step(1e-2, model, g).unwrap();
        reads.push(optim.stats().host_reads.unwrap() - before);
        assert_eq!(optim.last_report(), Some(want), "step {step}");
        assert_eq!(model.bits(), read(&r, &ids), "step {step}");
    }
    Some(reads)
}

#[test]
fn eight_bit_adamw_on_burns_wgpu_device_equals_the_cpu_reference_with_one_host_read_a_step() {
    let config = Lpmm8bitAdamWConfig::new()
        .lpmm()
        .with_non_finite(NonFinitePolicy::SkipElements);
    let Some(reads) = same_as_cpu(config, 4) else {
        return;
    };
    // The first step registers the parameters (lpmm checks a lent parameter is finite: one read
    // each); every later step reads back only the 4-byte flags.
    assert!(reads[1..].iter().all(|&r| r == 1), "{reads:?}");
}

#[test]
fn clipping_and_the_skip_step_policy_on_wgpu_equal_the_cpu_reference() {
    // The gradient norm is needed: lpmm-wgpu reads the per-parameter partial sums back (a few
    // reads a step, never a parameter or a gradient).
    let config = Lpmm8bitAdamWConfig::new()
        .with_max_grad_norm(Some(0.05))
        .lpmm();
    let Some(reads) = same_as_cpu(config, 3) else {
        return;
    };
    assert!(reads[1..].iter().all(|&r| r >= 1), "{reads:?}");
}

#[test]
fn eight_bit_parameters_held_by_lpmm_on_wgpu_equal_the_cpu_reference() {
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(3);
    same_as_cpu(config, 3);
}

#[test]
fn the_step_writes_burns_own_buffers() {
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
    // lpmm allocated no parameter memory on the device.
    assert_eq!(optim.memory_report().slot_totals()[0], 0);
}
