//! Low-bit AdamW against its anchors: bitsandbytes 0.50.2 `AdamW8bit` and torchao 0.18
//! `AdamW4bit` on CPU over 50 steps (golden/optim_trajectories.safetensors; the anchors' rules are
//! in golden/README.md). Bounds are relative to the tensor's largest |parameter| (about 0.5).

mod common;

use lpmm_optim::{Hyper, ParamConfig, Storage};

fn adamw() -> Hyper {
    Hyper::Adam(lpmm_optim::Adam {
        lr: 1e-3,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled: true,
    })
}

fn check(results: &[(u64, &str, f64, f64)], bound: impl Fn(u64, &str) -> f64) {
    let mut failures = Vec::new();
    for &(t, name, abs, rel) in results {
        println!(
            "step {t:2} {name:3}: max abs {abs:.3e}, rel {rel:.3e} (bound {:.0e})",
            bound(t, name)
        );
        if rel > bound(t, name) {
            failures.push(format!("step {t} {name}: {rel:.3e}"));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

/// Same rule, same maps (bit for bit), same block size and minimum size. bitsandbytes' CPU
/// quantizer is inexact (a 65,536-bin lookup table; it disagrees with the exact nearest code on
/// 3.2% of the step-1 second-moment codes here), so the trajectories agree to 1.5e-8 after one step
/// and then drift apart by the difference of two quantization noises: measured 7.1e-4 after 10
/// steps, 2.2e-3 (about one learning rate in absolute terms) after 50. "b" (33 elements) keeps f32
/// states in both, where only bitsandbytes' `sqrt(v) + eps*c2` form differs: measured 6e-8.
#[test]
fn adamw_8bit_follows_bitsandbytes() {
    let config = ParamConfig::f32(adamw())
        .with_state1(Storage::DYNAMIC8_SIGNED)
        .with_state2(Storage::DYNAMIC8_UNSIGNED);
    check(
        &common::compare("bnb_adamw8bit", config, 50),
        |t, name| match (t, name) {
            (_, "b") => 1e-6,
            (1, _) => 1e-7,
            (10, _) => 1.5e-3,
            _ => 4e-3,
        },
    );
}

/// Same maps (signed dynamic-exponent m, linear-without-zero v), block 128, nearest rounding
/// (torchao breaks ties upwards, lpmm to the lower magnitude: ties are rare). torchao quantizes
/// only tensors whose size is a multiple of 128: it keeps "w2" (4,396 elements) in f32, a silent
/// memory cliff lpmm does not have. With torchao's choice mimicked for "w2", every tensor agrees
/// within 1e-5 after 50 steps (measured 2.7e-6); with lpmm's policy "w2" differs by the 4-bit
/// quantization noise (measured 2.9e-2).
#[test]
fn adamw_4bit_follows_torchao() {
    let config = ParamConfig::f32(adamw())
        .with_state1(Storage::FOUR_BIT_SIGNED)
        .with_state2(Storage::FOUR_BIT_UNSIGNED);
    let mimic = |name: &str| (name == "w2").then(|| ParamConfig::f32(adamw()));
    check(
        &common::compare_with("torchao_adamw4bit", config, 50, mimic),
        |_, _| 1e-5,
    );
    let ours = common::compare("torchao_adamw4bit", config, 50);
    check(&ours, |_, name| if name == "w2" { 5e-2 } else { 1e-5 });
    let w2 = ours
        .iter()
        .filter(|r| r.1 == "w2" && r.0 == 50)
        .map(|r| r.3)
        .fold(0.0, f64::max);
    assert!(
        w2 > 1e-3,
        "lpmm quantizes w2, so it must differ from torchao's f32 w2 ({w2:e})"
    );
}
