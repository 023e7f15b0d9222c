//! The model, gradients and reference shared by the sharded tests (threads) and the program
//! they run under `mpirun`: deterministic data every rank can compute for every rank.

#![allow(dead_code)]

use lpmm_dist::{ParamDef, UNIT, slots};
use lpmm_optim::{
    Hyper, MapKind, Optimizer, OptimizerOptions, ParamConfig, ParamId, Storage, StoreRounding,
    checkpoint::Canonical, presets,
};
use rand_core::{Rng as _, SeedableRng};
use rand_xoshiro::SplitMix64;

/// SplitMix64 (`rand_xoshiro`): the same numbers everywhere.
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64::seed_from_u64(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Values over several orders of magnitude, with exact zeros.
    pub fn spread(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                let e = (self.next_u64() % 7) as i32 - 5;
                if self.next_u64().is_multiple_of(61) {
                    0.0
                } else {
                    u * scale * 10f32.powi(e)
                }
            })
            .collect()
    }
}

/// A model: a vector over several shards, a matrix (rank-1 / factorized states need 2-D), small
/// tensors below the minimum quantized size, one just over a unit.
pub fn model() -> Vec<ParamDef> {
    vec![
        ParamDef::new("emb", &[5 * UNIT + 123], 0),
        ParamDef::new("w", &[96, 128], 0),
        ParamDef::new("b", &[100], 0),
        ParamDef::new("u", &[UNIT + 1], 0),
        ParamDef::new("s", &[7], 0),
    ]
}

pub fn numels() -> Vec<usize> {
    model().iter().map(|d| d.shape.iter().product()).collect()
}

pub fn init() -> Vec<Vec<f32>> {
    let mut rng = Rng::new(42);
    numels().iter().map(|&n| rng.spread(n, 0.5)).collect()
}

/// Rank `r`'s gradients at `step`. With `exact`, multiples of 2^-20 below 2^6 in magnitude: sums
/// of up to 4 of them are exact in f32, so the total does not depend on the world size.
pub fn grads(world: usize, r: usize, step: usize, exact: bool) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(1000 * step as u64 + 10 * world as u64 + r as u64);
    numels()
        .iter()
        .map(|&n| {
            if exact {
                (0..n)
                    .map(|_| {
                        ((rng.next_u64() % (1 << 20)) as f32 - (1 << 19) as f32) / (1 << 20) as f32
                    })
                    .collect()
            } else {
                rng.spread(n, 1.0)
            }
        })
        .collect()
}

/// Exact gradients split over `world` ranks so that the total is the same for every world size:
/// the world-size-1 total, cut into `world` exact parts.
pub fn split_grads(world: usize, r: usize, step: usize) -> Vec<Vec<f32>> {
    let total = grads(1, 0, step, true);
    total
        .iter()
        .map(|g| {
            g.iter()
                .map(|&x| {
                    // Rank 0 takes the value minus the others' quarters; all parts exact.
                    let q = (x * 4.0).trunc() / 16.0;
                    if r == 0 {
                        x - q * (world - 1) as f32
                    } else {
                        q
                    }
                })
                .collect()
        })
        .collect()
}

pub fn reference(options: OptimizerOptions, config: ParamConfig) -> (Optimizer, Vec<ParamId>) {
    let mut opt = Optimizer::new(options).unwrap();
    opt.add_group(config).unwrap();
    let ids = model()
        .iter()
        .zip(init())
        .map(|(d, v)| opt.add_param(&d.name, &d.shape, &v, 0).unwrap())
        .collect();
    (opt, ids)
}

pub fn same_canonical(a: &Canonical, b: &Canonical, what: &str) {
    assert_eq!(a.global_steps, b.global_steps, "{what}: steps");
    assert_eq!(a.params.len(), b.params.len());
    for (p, q) in a.params.iter().zip(&b.params) {
        assert_eq!(p.name, q.name);
        assert_eq!(p.shape, q.shape, "{what}: {}", p.name);
        assert_eq!(
            (p.steps, p.accumulations, p.pending),
            (q.steps, q.accumulations, q.pending)
        );
        for (k, (x, y)) in p.slots.iter().zip(&q.slots).enumerate() {
            assert!(
                slots::encode(x) == slots::encode(y),
                "{what}: {} slot {k} differs",
                p.name
            );
        }
    }
}

pub fn configs() -> Vec<(&'static str, ParamConfig)> {
    let bf_sr = Storage::Bf16(StoreRounding::Stochastic);
    vec![
        (
            "adamw 8-bit bf16 sr",
            presets::adamw_8bit_bf16_sr(1e-3).build(),
        ),
        ("adamw 4-bit split", presets::adamw_4bit_split(1e-3).build()),
        ("lpmm sgdm", presets::lpmm_sgdm(0.05, 0.9).build()),
        ("adamw f32", presets::adamw_f32(1e-3).build()),
        (
            "lion kahan, bf16-sr grads",
            ParamConfig::f32(Hyper::lion(1e-4))
                .with_param(Storage::Bf16Kahan)
                .with_grad(bf_sr)
                .with_state1(bf_sr)
                .with_state2(bf_sr)
                .with_min_quantized_size(4096),
        ),
        (
            "sgd nesterov, quantized grads and params",
            ParamConfig::f32(Hyper::Sgd(lpmm_optim::Sgd {
                lr: 0.05,
                momentum: 0.9,
                dampening: 0.0,
                nesterov: true,
                weight_decay: 1e-2,
            }))
            .with_param(Storage::LINEAR8_GROUP64_SR)
            .with_grad(Storage::LINEAR8_GROUP64_SR)
            .with_state1(Storage::DYNAMIC8_SIGNED)
            .with_state2(Storage::DYNAMIC8_UNSIGNED)
            .with_min_quantized_size(4096),
        ),
        (
            "adam 4-bit with rank-1 second moment",
            presets::adamw_4bit_split(1e-3)
                .with_state2(Storage::Rank1 {
                    map: MapKind::LinearWithoutZero4,
                    fallback: lpmm_quant::BlockSize::B128,
                })
                .build(),
        ),
        (
            "adam factorized second moment",
            presets::adamw_8bit_bf16(1e-3)
                .with_state2(Storage::Factorized)
                .build(),
        ),
        // The rules added with the third state: Adafactor and CAME (tensor-wide sums and
        // factorized states: each tensor whole on one rank), AdEMAMix (state 3 cut with the
        // tensor) and schedule-free AdamW (host state kept per shard).
        (
            "adafactor lpmm",
            presets::adafactor_lpmm().weight_decay(0.01).build(),
        ),
        ("came 8-bit", presets::came_8bit(2e-4).build()),
        (
            "ademamix 8-bit, warmups",
            presets::ademamix_8bit(1e-3)
                .warmup(Some(3), Some(3))
                .build(),
        ),
        (
            "schedule-free 8-bit, bf16-sr params",
            presets::schedule_free_adamw_8bit(2.5e-3)
                .warmup_steps(2)
                .with_param(bf_sr)
                .build(),
        ),
    ]
}
