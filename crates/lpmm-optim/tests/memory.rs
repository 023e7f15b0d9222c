//! Memory accounting against what the allocator really hands out, and no allocation in `step`.
//! One test in this binary, so no other test allocates while it measures.

#[path = "support/counting.rs"]
mod counting;

use std::sync::atomic::Ordering;

use counting::{CALLS, Counting, LIVE};
use lpmm_optim::{
    Hyper, MapKind, Optimizer, OptimizerOptions, ParamConfig, Storage, StoreRounding, presets,
};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn accounting_equals_allocation_and_step_allocates_nothing() {
    // The code maps are built once per process and shared (~20 KiB each): not model memory.
    for map in [
        MapKind::DynamicSigned8,
        MapKind::DynamicUnsigned8,
        MapKind::DynamicExponentSigned4,
        MapKind::LinearWithoutZero4,
        MapKind::LinearSigned8,
    ] {
        map.shared();
    }
    let configs = [
        ParamConfig::f32(Hyper::sgd(0.1, 0.9)),
        ParamConfig::f32(Hyper::adamw(1e-3))
            .with_param(Storage::Bf16(StoreRounding::Stochastic))
            .with_grad(Storage::Bf16(StoreRounding::Stochastic))
            .with_state1(Storage::DYNAMIC8_SIGNED)
            .with_state2(Storage::DYNAMIC8_UNSIGNED),
        ParamConfig::f32(Hyper::adamw(1e-3))
            .with_param(Storage::SplitF32)
            .with_grad(Storage::Bf16(StoreRounding::Nearest))
            .with_state1(Storage::FOUR_BIT_SIGNED)
            .with_state2(Storage::FOUR_BIT_UNSIGNED),
        ParamConfig::f32(Hyper::sgd(0.1, 0.9))
            .with_param(Storage::LINEAR8_GROUP64_SR)
            .with_grad(Storage::LINEAR8_GROUP64_SR)
            .with_state1(Storage::LINEAR8_GROUP64_SR),
        ParamConfig::f32(Hyper::lion(1e-4)).with_param(Storage::Bf16Kahan),
        ParamConfig::f32(Hyper::adamw(1e-3))
            .with_state1(Storage::FOUR_BIT_SIGNED)
            .with_state2(Storage::Rank1 {
                map: MapKind::LinearWithoutZero4,
                fallback: lpmm_quant::BlockSize::B128,
            }),
        ParamConfig::f32(Hyper::adamw(1e-3)).with_state2(Storage::Factorized),
        // The third state, the rules' tensor-wide sums and host state.
        presets::adafactor_lpmm().build(),
        presets::came_lpmm(2e-4).build(),
        presets::ademamix_8bit(1e-3).build(),
        presets::schedule_free_adamw_8bit(1e-3).build(),
    ];
    let n = 3 << 20; // three pieces per parameter
    let init: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let grad: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect();
    for config in configs {
        let mut opt =
            Optimizer::new(OptimizerOptions::default().with_max_grad_norm(Some(1.0))).unwrap();
        let group = opt.add_group(config).unwrap();
        let before = LIVE.load(Ordering::SeqCst);
        // A matrix (rank-1 states need 2 dimensions) of three pieces.
        let id = opt
            .add_param("w", &[3 << 10, 1 << 10], &init, group)
            .unwrap();
        let grown = LIVE.load(Ordering::SeqCst) - before;
        let report = opt.memory_report();
        let accounted = report.total() as isize;
        // Model memory is what was allocated, up to the optimizer's bookkeeping (names, shapes,
        // the list of 48 pieces of 2^16 elements, each with its region tables and 192-byte exact
        // norm accumulator: about 0.9 KiB a piece, 43 KiB here; bounded by 64 KiB, 0.26% of the
        // 25 MB a three-slot f32 parameter of 3 * 2^20 elements holds).
        assert!(
            (grown - accounted).abs() < 65536,
            "{config:?}: allocated {grown}, accounted {accounted}"
        );

        opt.accumulate(id, &grad).unwrap();
        opt.step(lpmm_optim::Accumulated).unwrap(); // warms up the thread pool
        opt.accumulate(id, &grad).unwrap();
        let calls = CALLS.load(Ordering::SeqCst);
        let step = opt.step(lpmm_optim::Accumulated).unwrap();
        assert_eq!(
            CALLS.load(Ordering::SeqCst) - calls,
            0,
            "{config:?}: step allocated"
        );
        assert_eq!(step.updated, 1);
    }
}
