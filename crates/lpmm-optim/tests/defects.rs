//! Issue 22's defects, one test each: every one fails at commit 6ebcecf and passes now. The file
//! as written then, against that commit's API, is commit 91afe55's; since then it follows the
//! API. To see them fail: `git worktree add /tmp/before 6ebcecf && git show
//! 91afe55:crates/lpmm-optim/tests/defects.rs > /tmp/before/crates/lpmm-optim/tests/defects.rs
//! && cd /tmp/before && cargo test --release -p lpmm-optim --test defects`. tests/hostile.rs has
//! the full table of bad inputs.

use lpmm_optim::{
    Adam, Hyper, LrRule, OptimError, Optimizer, OptimizerOptions, ParamConfig, Storage,
    StoreRounding, presets,
};
use lpmm_optim::{Checkpoint, Cpu, PartsMut, SlotKind, checkpoint::Canonical};

fn bf(r: StoreRounding) -> Storage {
    Storage::Bf16(r)
}

#[test]
fn item1_init_above_bf16_max_is_refused() {
    for p in [
        bf(StoreRounding::Nearest),
        bf(StoreRounding::Stochastic),
        Storage::Bf16Kahan,
    ] {
        let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
        let g = opt
            .add_group(ParamConfig::f32(Hyper::sgd(0.1, 0.0)).with_param(p))
            .unwrap();
        let r = opt.add_param("w", &[2], &[1.0, 3.4e38], g);
        assert!(r.is_err(), "{p:?}: 3.4e38 accepted into bf16");
    }
}

#[test]
fn item1_bf16_momentum_overflow_is_reported() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt
        .add_group(
            ParamConfig::f32(Hyper::sgd(1e-40, 0.9))
                .with_state1(bf(StoreRounding::Nearest))
                .with_grad(Storage::None),
        )
        .unwrap();
    let id = opt.add_param("w", &[2], &[0.0, 0.0], g).unwrap();
    let r = opt
        .step(lpmm_optim::Step::param(id, &[1.0, 3.4e38]))
        .unwrap();
    let mut m = [0f32; 2];
    opt.read(id, SlotKind::State1, &mut m).unwrap();
    assert!(
        m.iter().all(|x| x.is_finite()) && !r.non_finite.is_empty(),
        "momentum {m:?}, report {r:?}"
    );
}

#[test]
fn item2_accumulated_overflow_in_8bit_is_not_silent() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::lpmm_sgdm(1e-3, 0.9)).unwrap();
    let id = opt.add_param("w", &[2], &[0.0, 0.0], g).unwrap();
    opt.accumulate(id, &[0.5, 3e38]).unwrap();
    let second = opt.accumulate(id, &[0.25, 3e38]);
    let report = opt.step(lpmm_optim::Accumulated).unwrap();
    assert!(
        second.is_err() || !report.non_finite.is_empty(),
        "accumulate {second:?}, step report {report:?}"
    );
}

#[test]
fn item3_parameter_named_maps_round_trips() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-defects-");
    let path = tmp.path().join("maps.safetensors");
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_8bit_bf16(1e-3)).unwrap();
    opt.add_param("maps", &[4], &[0.0; 4], g).unwrap();
    opt.save(&path, Checkpoint::new()).unwrap();
    Canonical::read(&path)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
}

#[test]
fn item4_restore_u64_max_is_refused() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
    let id = opt.add_param("w", &[4], &[0.0; 4], g).unwrap();
    let r = PartsMut::of(&mut opt).restore(id, u64::MAX, 0, false, LrRule::Group);
    assert!(r.is_err(), "restore(u64::MAX) accepted");
}

#[test]
fn item4_eps_zero_is_refused() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let r = opt.add_group(ParamConfig::f32(Hyper::Adam(Adam::adamw(1e-3).eps(0.0))));
    assert!(r.is_err(), "eps = 0 accepted");
}

#[test]
fn item4_read_state_4_is_refused() {
    // States are 1, 2 and 3 (AdEMAMix and CAME use the third); AdamW's state 3 reads as zeros.
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
    let id = opt.add_param("w", &[4], &[0.0; 4], g).unwrap();
    let mut out = [1f32; 4];
    // A state index is a `SlotKind` now: state 0 or 4 does not compile.
    opt.read(id, SlotKind::State3, &mut out).unwrap();
    assert_eq!(out, [0.0; 4]);
}

#[test]
fn item4_load_state_with_other_configuration_is_refused() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-defects-");
    let path = tmp.path().join("other-config.safetensors");
    let mut a = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = a.add_group(presets::adamw_f32(1e-3)).unwrap();
    a.add_param("w", &[4], &[0.0; 4], g).unwrap();
    a.save(&path, Checkpoint::new()).unwrap();
    let mut b = Optimizer::new(OptimizerOptions::default().with_seed(9)).unwrap();
    let g = b.add_group(presets::lpmm_sgdm(0.1, 0.9)).unwrap();
    b.add_param("w", &[4], &[0.0; 4], g).unwrap();
    assert!(
        b.load(&path, Checkpoint::new()).is_err(),
        "configuration silently replaced"
    );
}

#[test]
fn item5_long_file_name_saves() {
    let name = format!("{}.safetensors", "n".repeat(250 - 12));
    assert_eq!(name.len(), 250);
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
    opt.add_param("w", &[4], &[0.0; 4], g).unwrap();
    let tmp = lpmm_optim::testing::temp_dir("lpmm-defects-");
    opt.save(tmp.path().join(name), Checkpoint::new()).unwrap();
}

#[test]
fn item5_stale_temp_is_cleaned_by_the_next_save() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-defects-");
    let d = tmp.path();
    let path = d.join("stale.safetensors");
    let stale = d.join(".stale.safetensors.tmp-999999-0");
    std::fs::write(&stale, vec![0u8; 1000]).unwrap();
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
    opt.add_param("w", &[4], &[0.0; 4], g).unwrap();
    opt.save(&path, Checkpoint::new()).unwrap();
    assert!(!stale.exists(), "stale temporary file left behind");
}

#[test]
fn item6_lr_round_trips_bit_exactly() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-defects-");
    let path = tmp.path().join("lr.safetensors");
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
    opt.add_param("w", &[4], &[0.0; 4], g).unwrap();
    let lr = 0.0011168202304366027;
    opt.set_lr(lr).unwrap();
    opt.save(&path, Checkpoint::new()).unwrap();
    let back = Canonical::read(&path)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
    let id = back.param("w").map(|p| p.id).unwrap();
    assert_eq!(
        back.param(id)
            .map(|p| p.config)
            .unwrap()
            .hyper
            .lr()
            .to_bits(),
        lr.to_bits()
    );
}

#[test]
fn item6_errors_of_bad_files_are_checkpoint_errors() {
    // A group index past the groups: the error must be OptimError::Checkpoint.
    let tmp = lpmm_optim::testing::temp_dir("lpmm-defects-");
    let path = tmp.path().join("group.safetensors");
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
    opt.add_param("w", &[4], &[0.0; 4], g).unwrap();
    opt.save(&path, Checkpoint::new()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let needle = b"\\\"group\\\":0";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    let mut patched = bytes.clone();
    patched[at + needle.len() - 1] = b'7';
    std::fs::write(&path, &patched).unwrap();
    let e = Canonical::read(&path)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap_err();
    assert!(matches!(e, OptimError::Checkpoint { .. }), "{e:?}");
}

#[test]
fn item1_adamw_bf16_second_moment_overflow_is_reported() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt
        .add_group(
            presets::adamw_f32(1e-3)
                .with_grad(Storage::None)
                .with_state1(bf(StoreRounding::Nearest))
                .with_state2(bf(StoreRounding::Stochastic))
                .build(),
        )
        .unwrap();
    let id = opt.add_param("w", &[2], &[0.1, 0.1], g).unwrap();
    let r = opt
        .step(lpmm_optim::Step::param(id, &[0.01, 5.832e20]))
        .unwrap();
    let mut v = [0f32; 2];
    opt.read(id, SlotKind::State2, &mut v).unwrap();
    assert!(
        v.iter().all(|x| x.is_finite()) && !r.non_finite.is_empty(),
        "v {v:?}, report {r:?}"
    );
}

#[test]
fn item3_a_save_after_overflow_loads() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-defects-");
    let path = tmp.path().join("after-overflow.safetensors");
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt
        .add_group(
            ParamConfig::f32(Hyper::sgd(1e-40, 0.9))
                .with_state1(bf(StoreRounding::Nearest))
                .with_grad(Storage::None),
        )
        .unwrap();
    let id = opt.add_param("w", &[2], &[0.0, 0.0], g).unwrap();
    let _ = opt.step(lpmm_optim::Step::param(id, &[1.0, 3.4e38]));
    opt.save(&path, Checkpoint::new()).unwrap();
    Canonical::read(&path)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
}

#[test]
fn item4_set_steps_u64_max_is_refused() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    // Before: `set_steps` returned nothing and took any value.
    let _ = PartsMut::of(&mut opt).set_steps(u64::MAX);
    assert!(
        opt.status().steps <= 1 << 53,
        "counter set to {}",
        opt.status().steps
    );
}

#[test]
fn item5_stale_temp_is_cleaned_by_the_next_load() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-defects-");
    let d = tmp.path();
    let path = d.join("stale-load.safetensors");
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
    opt.add_param("w", &[4], &[0.0; 4], g).unwrap();
    opt.save(&path, Checkpoint::new()).unwrap();
    let stale = d.join(".stale-load.safetensors.tmp-999998-3");
    std::fs::write(&stale, vec![0u8; 1000]).unwrap();
    Canonical::read(&path)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
    assert!(!stale.exists(), "stale temporary file left behind");
}
