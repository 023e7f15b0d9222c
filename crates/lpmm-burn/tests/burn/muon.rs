//! burn-optim 0.22's `Muon` on the inputs of lpmm-optim's Muon golden file
//! (`crates/lpmm-optim/tests/golden/muon.safetensors`, torch 2.15's `torch.optim.Muon`): within
//! the bound lpmm's f32 Muon is held to (`TORCH_BOUND` of lpmm-optim's `tests/muon.rs`, 1e-2 of
//! the tensor's largest |value|), the two configurations burn has (burn has no
//! `"spectral_unclamped"`). burn's momentum is SGD's (`v = mu v + g`, the first `v = g`), torch's
//! a `lerp` (`buf = mu buf + (1 - mu) g`): the two differ by the factor `1 - mu`, which the
//! Newton–Schulz normalisation removes, so they agree up to rounding and eps.
//!
//! `cargo test --release -p lpmm-burn --test burn muon -- --nocapture` prints the differences.

use burn_core::tensor::{Device, Tensor, TensorData};
use burn_optim::decay::WeightDecayConfig;
use burn_optim::momentum::MomentumConfig;
use burn_optim::{AdjustLrFn, MuonConfig, Optimizer};

const GOLDEN: &[u8] = include_bytes!("../../../lpmm-optim/tests/golden/muon.safetensors");
/// lpmm-optim's `tests/muon.rs`: `TORCH_BOUND`.
const BOUND: f64 = 1e-2;
/// The golden matrices: (scenario tensor id, name, shape).
const MATRICES: [(u64, &str, [usize; 2]); 4] = [
    (10, "w", [40, 96]),
    (11, "t", [120, 36]),
    (12, "s", [48, 48]),
    (13, "x", [64, 200]),
];

/// The golden scenario's hash and values (lpmm-optim's `tests/common/mod.rs`, the same integer
/// arithmetic as its Python generators).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn u(tid: u64, t: u64, i: u64) -> f32 {
    let h = mix(tid
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(t.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(i));
    (h >> 40) as f32 / 8_388_608.0 - 1.0
}

fn init(tid: u64, n: usize) -> Vec<f32> {
    (0..n).map(|i| u(tid, 0, i as u64) * 0.5).collect()
}

fn grad(tid: u64, t: u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| u(tid, t, i as u64) * (0.01f32 * (1 + i % 7) as f32))
        .collect()
}

fn golden(st: &safetensors::SafeTensors<'_>, key: &str) -> Vec<f32> {
    let t = st.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Steps each golden matrix 100 times with burn's `optim` at `lr` and returns the largest
/// difference from torch's parameters after step 100 (`{cfg}.{ns}`), relative to the tensor's
/// largest |value|.
fn worst(optim: &burn_optim::Muon, lr: f64, cfg: &str, ns: &str) -> f64 {
    let device = Device::flex();
    let st = safetensors::SafeTensors::deserialize(GOLDEN).expect("golden file parses");
    let mut worst = 0f64;
    for (tid, name, shape) in MATRICES {
        let n = shape[0] * shape[1];
        let mut p = Tensor::<2>::from_data(TensorData::new(init(tid, n), shape), &device);
        let mut state = None;
        for t in 1..=100u64 {
            let g = Tensor::<2>::from_data(TensorData::new(grad(tid, t, n), shape), &device);
            (p, state) = optim.step(lr, p, g, state);
        }
        let got: Vec<f32> = p.into_data().try_to_vec::<f32>().unwrap();
        let want = golden(&st, &format!("{cfg}.{ns}.step100.{name}"));
        let scale = want.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
        let diff = want
            .iter()
            .zip(&got)
            .fold(0f64, |m, (a, b)| m.max(f64::from((a - b).abs())));
        println!(
            "burn-optim Muon, {cfg} ({ns} NS) {name}: {:.3e}",
            diff / scale
        );
        worst = worst.max(diff / scale);
    }
    worst
}

#[test]
fn burn_optims_muon_agrees_with_torch_within_lpmms_bound() {
    let default = MuonConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(0.1)))
        .build();
    let plain_rms = MuonConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
        .with_momentum(MomentumConfig {
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
        })
        .with_ns_steps(3)
        .with_adjust_lr_fn(AdjustLrFn::MatchRmsAdamW)
        .build();
    for (cfg, optim) in [("muon_default", &default), ("muon_plain_rms", &plain_rms)] {
        for ns in ["bf16", "f32"] {
            let w = worst(optim, 0.02, cfg, ns);
            assert!(w <= BOUND, "{cfg} ({ns} NS): {w:.3e} > {BOUND:.0e}");
        }
    }
}
