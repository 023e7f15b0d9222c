//! Rank-1 normalized 4-bit second moments in the fused step.

use lpmm_optim::Checkpoint;
use lpmm_optim::{Cpu, SlotKind, checkpoint::Canonical};
use lpmm_optim::{Hyper, MapKind, Optimizer, OptimizerOptions, ParamConfig, Storage};
use lpmm_quant::{BlockSize, QuantRounding, Rank1};

fn config() -> ParamConfig {
    ParamConfig::f32(Hyper::adamw(1e-3))
        .with_state1(Storage::FOUR_BIT_SIGNED)
        .with_state2(Storage::Rank1 {
            map: MapKind::LinearWithoutZero4,
            fallback: BlockSize::B128,
        })
}

/// A tensor of 2 pieces (1100 x 1000 > 2^20 elements) with row/column structure.
const SHAPE: [usize; 2] = [1100, 1000];

fn grad(t: usize) -> Vec<f32> {
    (0..SHAPE[0] * SHAPE[1])
        .map(|e| {
            let (i, j) = (e / SHAPE[1], e % SHAPE[1]);
            (((e * 7 + t * 13) % 101) as f32 - 50.0)
                * 1e-4
                * (1.0 + (i % 9) as f32)
                * (1.0 + (j % 4) as f32)
        })
        .collect()
}

#[test]
fn the_first_step_stores_exactly_the_rank1_quantization_of_the_new_second_moment() {
    let n = SHAPE[0] * SHAPE[1];
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(config()).unwrap();
    let id = opt.add_param("w", &SHAPE, &vec![0.1; n], g).unwrap();
    let grad = grad(1);
    opt.accumulate(id, &grad).unwrap();
    opt.step(lpmm_optim::Accumulated).unwrap();
    // v after one step from zero: fma((1 - b2) * g, g, 0 * b2).
    let w2 = (1.0f64 - 0.999) as f32;
    let v: Vec<f32> = grad.iter().map(|&g| (w2 * g).mul_add(g, 0.0)).collect();
    let map = MapKind::LinearWithoutZero4.shared();
    let q = Rank1::new(map, &SHAPE).unwrap();
    let mut codes = vec![0u8; q.codes_len()];
    let mut scales = vec![0f32; q.scales_len()];
    q.quantize(&v, &mut codes, &mut scales, QuantRounding::Nearest)
        .unwrap();
    let mut want = vec![0f32; n];
    q.dequantize(&codes, &scales, &mut want).unwrap();
    let mut got = vec![0f32; n];
    opt.read(id, SlotKind::State2, &mut got).unwrap();
    assert_eq!(got, want);
}

#[test]
fn rank1_steps_do_not_depend_on_threads_and_resume_exactly() {
    let n = SHAPE[0] * SHAPE[1];
    let init: Vec<f32> = (0..n).map(|e| ((e % 997) as f32 - 498.0) * 1e-3).collect();
    let run = |steps: std::ops::Range<usize>, opt: &mut Optimizer| {
        let id = opt.param("w").map(|p| p.id).unwrap();
        for t in steps {
            opt.accumulate(id, &grad(t)).unwrap();
            opt.step(lpmm_optim::Accumulated).unwrap();
        }
    };
    let fresh = || {
        let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
        let g = opt.add_group(config()).unwrap();
        opt.add_param("w", &SHAPE, &init, g).unwrap();
        opt
    };
    let read = |opt: &Optimizer| {
        let id = opt.param("w").map(|p| p.id).unwrap();
        let (mut p, mut v) = (vec![0f32; n], vec![0f32; n]);
        opt.read(id, SlotKind::Param, &mut p).unwrap();
        opt.read(id, SlotKind::State2, &mut v).unwrap();
        (p, v)
    };
    let mut two = fresh();
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap()
        .install(|| run(1..5, &mut two));
    let mut one = fresh();
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| run(1..5, &mut one));
    assert_eq!(read(&one), read(&two));

    let tmp = lpmm_optim::testing::temp_dir("lpmm-rank1-");
    let dir = tmp.path();
    let mut first = fresh();
    run(1..3, &mut first);
    first
        .save(dir.join("r.safetensors"), Checkpoint::new())
        .unwrap();
    let mut resumed = Canonical::read(dir.join("r.safetensors"))
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
    run(3..5, &mut resumed);
    assert_eq!(read(&resumed), read(&two));
}

#[test]
fn one_dimensional_tensors_fall_back_to_blocks() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(config()).unwrap();
    let id = opt.add_param("bias", &[5000], &[0.0; 5000], g).unwrap();
    assert!(
        matches!(opt.param(id).map(|p| p.config).unwrap().state2, Storage::Quantized { block, .. } if block == BlockSize::B128)
    );
}
