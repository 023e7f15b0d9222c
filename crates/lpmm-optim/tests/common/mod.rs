//! The golden scenario of golden/README.md: tensors, initial values and gradients, regenerated
//! with the same integer arithmetic as golden/gen_reference_optimizers.py.

#![allow(dead_code)]

use lpmm_optim::SlotKind;
use lpmm_optim::{Optimizer, OptimizerOptions, ParamConfig, ParamId};
use safetensors::SafeTensors;

pub const FILE: &[u8] = include_bytes!("../golden/optim_trajectories.safetensors");
/// Adafactor, CAME, AdEMAMix and schedule-free AdamW (golden/gen_more_optimizers.py).
pub const MORE: &[u8] = include_bytes!("../golden/more_optimizers.safetensors");
pub const TENSORS: [(&str, &[usize]); 4] = [
    ("w1", &[64, 80]),
    ("w2", &[4396]),
    ("b", &[33]),
    ("w3", &[96, 128]),
];

pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The scenario's uniform value in [-1, 1): exact in f32.
pub fn u(tid: u64, t: u64, i: u64) -> f32 {
    let h = mix(tid
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(t.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(i));
    (h >> 40) as f32 / 8_388_608.0 - 1.0
}

pub fn init(tid: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| u(tid as u64, 0, i as u64) * 0.5).collect()
}

pub fn grad(tid: usize, t: u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| u(tid as u64, t, i as u64) * (0.01f32 * (1 + i % 7) as f32))
        .collect()
}

pub fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn load() -> SafeTensors<'static> {
    SafeTensors::deserialize(FILE).expect("golden file parses")
}

/// Runs `config` over the scenario and returns, per stored `(step, tensor)`, the largest absolute
/// and relative (to max |p_ref| of the tensor) difference from the anchor named `anchor`.
pub fn compare(anchor: &str, config: ParamConfig, last: u64) -> Vec<(u64, &'static str, f64, f64)> {
    compare_with(anchor, config, last, |_| None)
}

/// As [`compare`], with a per-tensor configuration override.
pub fn compare_with(
    anchor: &str,
    config: ParamConfig,
    last: u64,
    overrides: impl Fn(&str) -> Option<ParamConfig>,
) -> Vec<(u64, &'static str, f64, f64)> {
    compare_in(&load(), anchor, config, last, overrides).0
}

/// The largest absolute difference between `want` and `got`, and that over max |want|.
pub fn difference(want: &[f32], got: &[f32]) -> (f64, f64) {
    assert_eq!(want.len(), got.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let diff = want
        .iter()
        .zip(got)
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, f64::max);
    (diff, diff / scale)
}

/// Per stored `(step, tensor)`: the largest absolute and relative difference.
pub type Differences = Vec<(u64, &'static str, f64, f64)>;

/// [`compare_with`] against the golden file `st`; also returns the optimizer after the last
/// step and its parameters (in [`TENSORS`] order).
pub fn compare_in(
    st: &SafeTensors<'_>,
    anchor: &str,
    config: ParamConfig,
    last: u64,
    overrides: impl Fn(&str) -> Option<ParamConfig>,
) -> (Differences, Optimizer, Vec<ParamId>) {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let group = opt.add_group(config).unwrap();
    let ids: Vec<ParamId> = TENSORS
        .iter()
        .enumerate()
        .map(|(tid, (name, shape))| {
            let values = init(tid, shape.iter().product());
            match overrides(name) {
                Some(c) => opt.add_param_with(name, shape, &values, group, c).unwrap(),
                None => opt.add_param(name, shape, &values, group).unwrap(),
            }
        })
        .collect();
    let mut out = Vec::new();
    for t in 1..=last {
        for (tid, (&id, (_, shape))) in ids.iter().zip(TENSORS.iter()).enumerate() {
            opt.accumulate(id, &grad(tid, t, shape.iter().product()))
                .unwrap();
        }
        assert_eq!(opt.step(lpmm_optim::Accumulated).unwrap().updated, 4);
        for (&id, (name, shape)) in ids.iter().zip(TENSORS.iter()) {
            // Not every tensor is stored at every step (file size); the last step always is.
            let key = format!("{anchor}.step{t}.{name}");
            if st.tensor(&key).is_err() {
                continue;
            }
            let want = f32s(st, &key);
            let mut got = vec![0f32; shape.iter().product()];
            opt.read(id, SlotKind::Param, &mut got).unwrap();
            let (diff, rel) = difference(&want, &got);
            out.push((t, *name, diff, rel));
        }
    }
    for (name, _) in TENSORS {
        assert!(
            out.iter().any(|o| o.0 == last && o.1 == name),
            "{anchor}.step{last}.{name} missing"
        );
    }
    (out, opt, ids)
}
