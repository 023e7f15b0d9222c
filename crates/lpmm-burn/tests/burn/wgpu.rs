//! lpmm's optimizers on burn's wgpu device (Mesa's lavapipe in CI): lpmm-wgpu runs on burn's own
//! wgpu device and queue, steps the module's parameters in burn's buffers and reads its gradients
//! where burn wrote them. A step maps nothing back to the host but lpmm's 4-byte non-finite
//! flags when no gradient norm is needed, and its results equal lpmm's CPU reference bit for bit.

use crate::common::{
    D_IN, D_OUT, HIDDEN, Mlp, grads, host_grads, read, reference, reference_step, serial, values,
    wgpu_device as device,
};
use burn_core::tensor::Device;
use lpmm_burn::{Lpmm8bitAdamWConfig, LpmmOptimizerConfig};
use lpmm_optim::{NonFinitePolicy, presets};

/// Trains on the wgpu device and with lpmm's CPU reference on the same gradients; every
/// parameter bit must agree after every step. Returns the host reads (maps, bytes) of each step.
fn same_as_cpu(config: LpmmOptimizerConfig, steps: usize) -> Option<Vec<(u64, u64)>> {
    let _serial = serial();
    let device = device()?;
    let mut model = Mlp::new(&device, 7);
    let mut optim = config.init_whole_module();
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
    let mut optim = Lpmm8bitAdamWConfig::new().init_whole_module();
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

/// The per-tensor optimizer (burn's `ModuleOptimizer` over `LpmmTensorOptimizer`) on the wgpu
/// device against lpmm's CPU reference, every bit after every step; `keep` keeps a clone of the
/// model during each step, as burn-train's `Learner` does. Returns each step's host reads.
fn per_tensor_same_as_cpu(
    config: LpmmOptimizerConfig,
    steps: usize,
    keep: bool,
) -> Option<(Vec<(u64, u64)>, lpmm_burn::LpmmTensorStats)> {
    let _serial = serial();
    let device = device()?;
    let mut model = Mlp::new(&device, 7);
    let handle = config.build().unwrap();
    let mut optim = burn_optim::ModuleOptimizer::from(handle.clone());
    let (mut r, ids) = reference(&config, &values(&model));
    let mut reads = Vec::new();
    // The device's counters (the optimizer's own appear with its first engine).
    let backend = lpmm_burn::wgpu::backend(&device).unwrap();
    let counts =
        |_: &lpmm_burn::LpmmTensorOptimizer| (backend.host_reads(), backend.host_read_bytes());
    for step in 0..steps {
        let g = grads(&model, step, &device);
        reference_step(&mut r, &ids, host_grads(&model, &g), 1e-2);
        let kept = keep.then(|| model.clone());
        let before = counts(&handle);
        model = optim.step(1e-2, model, g);
        let after = counts(&handle);
        drop(kept);
        reads.push((after.0 - before.0, after.1 - before.1));
        assert_eq!(model.bits(), read(&r, &ids), "step {step}");
    }
    let stats = handle.stats();
    assert_eq!(stats.lane, Some("wgpu"));
    assert_eq!((stats.error_count, stats.params), (0, 4), "{stats:?}");
    Some((reads, stats))
}

#[test]
fn per_tensor_eight_bit_adamw_on_wgpu_equals_the_cpu_reference_without_host_round_trips() {
    let config = Lpmm8bitAdamWConfig::new()
        .lpmm()
        .with_non_finite(NonFinitePolicy::SkipElements);
    let Some((reads, stats)) = per_tensor_same_as_cpu(config, 4, false) else {
        return;
    };
    // Each tensor step reads back lpmm's non-finite flags and nothing else: one read of one
    // word per parameter the engine holds (4 here: 16 bytes), 4 tensors, 4 reads. The first
    // step registers the parameters too: lpmm checks that each is finite (4 reads of 4 bytes),
    // and the flags read then grow with the parameters registered (4 + 8 + 12 + 16 bytes).
    assert_eq!(reads[0], (8, 56), "{reads:?}");
    for &r in &reads[1..] {
        assert_eq!(r, (4, 64), "{reads:?}");
    }
    assert_eq!(stats.copies, 0);
    // Under `SkipStep` the gradient's finiteness is read first: one more read per tensor.
    let config = Lpmm8bitAdamWConfig::new().lpmm();
    let (reads, _) = per_tensor_same_as_cpu(config, 3, false).unwrap();
    // (4 finiteness checks of 4 bytes, 4 flag reads of 16.)
    assert_eq!(reads[0], (12, 72), "{reads:?}");
    for &r in &reads[1..] {
        assert_eq!(r, (8, 80), "{reads:?}");
    }
}

#[test]
fn per_tensor_steps_copy_a_shared_parameter_on_the_device() {
    // burn-train's `Learner` keeps the model it steps: each parameter is shared, so each step
    // copies it -- on the device, with no more host reads than the flags.
    let config = Lpmm8bitAdamWConfig::new()
        .lpmm()
        .with_non_finite(NonFinitePolicy::SkipElements);
    let Some((reads, stats)) = per_tensor_same_as_cpu(config, 3, true) else {
        return;
    };
    for &r in &reads[1..] {
        assert_eq!(r, (4, 64), "{reads:?}");
    }
    assert_eq!(stats.copies, 12, "{stats:?}");
}

#[test]
fn per_tensor_held_parameters_on_wgpu_equal_the_cpu_reference() {
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(3);
    per_tensor_same_as_cpu(config, 3, false);
}

#[test]
fn a_per_tensor_state_moves_between_wgpu_and_the_cpu() {
    use burn_core::tensor::{Tensor, TensorData};
    use burn_optim::Optimizer as _;
    let _serial = serial();
    let Some(gpu) = device() else {
        return;
    };
    let gpu = gpu.inner();
    let cpu = Device::flex();
    let config = LpmmOptimizerConfig::from(presets::adamw_8bit(0.0)).with_seed(6);
    let values: Vec<f32> = (0..64 * 80)
        .map(|i| ((i % 13) as f32 - 6.0) * 0.01)
        .collect();
    let grad = |k: usize, d: &Device| {
        let g: Vec<f32> = (0..64 * 80)
            .map(|i| (((i * 7 + k * 3) % 17) as f32 - 8.0) * 1e-3)
            .collect();
        Tensor::<2>::from_data(TensorData::new(g, [64, 80]), d)
    };
    let t0 = |d: &Device| Tensor::<2>::from_data(TensorData::new(values.clone(), [64, 80]), d);
    let bits = |t: Tensor<2>| -> Vec<u32> {
        let v: Vec<f32> = t.into_data().try_to_vec().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    };
    let optim = config.build().unwrap();
    let (mut t, mut s) = (t0(&cpu), None);
    for k in 0..6 {
        (t, s) = optim.step(0.01, t, grad(k, &cpu), s);
    }
    let straight = bits(t);
    // 2 steps on the CPU, 2 on wgpu, 2 on the CPU again (an optimizer of its own: a second
    // tensor met by one optimizer is another parameter, with another random stream).
    let optim = config.build().unwrap();
    let (mut t, mut s) = (t0(&cpu), None);
    for k in 0..6 {
        let d = if (2..4).contains(&k) { &gpu } else { &cpu };
        s = s.map(|s| lpmm_burn::LpmmTensorOptimizer::to_device(s, d));
        t = t.to_device(d);
        (t, s) = optim.step(0.01, t, grad(k, d), s);
    }
    assert_eq!(bits(t), straight);
    assert_eq!(optim.stats().error_count, 0, "{:?}", optim.stats());
}
