//! Adafactor's factorized second moment inside Adam.

use lpmm_optim::Checkpoint;
use lpmm_optim::SlotKind;
use lpmm_optim::{Cpu, checkpoint::Canonical};
use lpmm_optim::{Hyper, OptimError, Optimizer, OptimizerOptions, ParamConfig, Storage};

const ROWS: usize = 4;
const COLS: usize = 6;

fn config() -> ParamConfig {
    ParamConfig::f32(Hyper::adamw(1e-2))
        .with_state2(Storage::Factorized)
        .with_min_quantized_size(0)
}

fn grad(t: usize) -> Vec<f32> {
    (0..ROWS * COLS)
        .map(|e| ((e * 7 + t * 3) % 11) as f32 * 0.1 - 0.5)
        .collect()
}

/// The rule written out element by element (docs/OPTIMIZERS.md): row and column means of g^2
/// averaged with beta2, v_ij = r_i c_j / mean(r), then AdamW with that v.
fn reference(steps: usize) -> Vec<f32> {
    let (lr, wd, b1, b2, eps) = (1e-2f64, 0.01f64, 0.9f64, 0.999f64, 1e-8f64);
    let mut p = vec![0.5f32; ROWS * COLS];
    let mut m = [0f32; ROWS * COLS];
    let (mut r, mut c) = (vec![0f32; ROWS], vec![0f32; COLS]);
    let (w1, b2f, w2) = ((1.0 - b1) as f32, b2 as f32, (1.0 - b2) as f32);
    for t in 1..=steps {
        let g = grad(t);
        let (mut rs, mut cs) = (vec![0f64; ROWS], vec![0f64; COLS]);
        for (e, &x) in g.iter().enumerate() {
            rs[e / COLS] += f64::from(x) * f64::from(x);
            cs[e % COLS] += f64::from(x) * f64::from(x);
        }
        for i in 0..ROWS {
            r[i] = w2.mul_add((rs[i] / COLS as f64) as f32, r[i] * b2f);
        }
        for j in 0..COLS {
            c[j] = w2.mul_add((cs[j] / ROWS as f64) as f32, c[j] * b2f);
        }
        let mean_r = (r.iter().map(|&x| f64::from(x)).sum::<f64>() / ROWS as f64) as f32;
        let bc2 = (1.0 - b2.powf(t as f64)).sqrt() as f32;
        let neg_step = (-(lr / (1.0 - b1.powf(t as f64)))) as f32;
        for e in 0..ROWS * COLS {
            let v = r[e / COLS] * c[e % COLS] / mean_r;
            let decayed = p[e] * (1.0 - lr * wd) as f32;
            m[e] = (g[e] - m[e]).mul_add(w1, m[e]);
            let denom = v.sqrt() / bc2 + eps as f32;
            p[e] = decayed + neg_step * m[e] / denom;
        }
    }
    p
}

fn run(opt: &mut Optimizer, steps: std::ops::Range<usize>) {
    let id = opt.param("w").map(|p| p.id).unwrap();
    for t in steps {
        opt.accumulate(id, &grad(t)).unwrap();
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
}

fn fresh() -> Optimizer {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(config()).unwrap();
    opt.add_param("w", &[ROWS, COLS], &[0.5; ROWS * COLS], g)
        .unwrap();
    opt
}

fn params(opt: &Optimizer) -> Vec<f32> {
    let mut p = vec![0f32; ROWS * COLS];
    opt.read(opt.param("w").unwrap().id, SlotKind::Param, &mut p)
        .unwrap();
    p
}

#[test]
fn the_step_equals_the_written_out_rule() {
    let mut opt = fresh();
    run(&mut opt, 1..6);
    assert_eq!(params(&opt), reference(5));
}

#[test]
fn it_stores_rows_plus_columns_not_the_whole_tensor() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(config()).unwrap();
    opt.add_param("w", &[256, 512], &vec![0.0; 256 * 512], g)
        .unwrap();
    let state2 = opt.memory_report().params[0].bytes[3];
    // Per row or column: the average (f32) and the exact sum's scratch (the largest exponent,
    // u32, and the 64-bit fixed-point sum): 16 bytes; and mean(r), 4 bytes.
    assert_eq!(state2, 16 * (256 + 512) + 4);
    // 12,292 bytes against 524,288 for a full f32 second moment: 2.3%.
    assert!(state2 * 40 < 4 * 256 * 512);
}

#[test]
fn it_resumes_exactly_from_a_checkpoint() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-factored-");
    let dir = tmp.path();
    let mut straight = fresh();
    run(&mut straight, 1..7);
    let mut first = fresh();
    run(&mut first, 1..4);
    first
        .save(dir.join("f.safetensors"), Checkpoint::new())
        .unwrap();
    let mut resumed = Canonical::read(dir.join("f.safetensors"))
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
    run(&mut resumed, 4..7);
    assert_eq!(params(&resumed), params(&straight));
}

#[test]
fn only_adam_matrices_factorize() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let sgd = ParamConfig::f32(Hyper::sgd(0.1, 0.9)).with_state2(Storage::Factorized);
    assert!(matches!(
        opt.add_group(sgd),
        Err(OptimError::StorageNotAllowed { .. })
    ));
    let g = opt.add_group(config()).unwrap();
    let bias = opt.add_param("bias", &[100], &[0.0; 100], g).unwrap();
    assert_eq!(
        opt.param(bias).map(|p| p.config).unwrap().state2,
        Storage::F32,
        "1-D tensors keep a full state"
    );
}

/// Issue 46 on the CPU: a step that would move factorized statistics to rebuild +Inf keeps them
/// and reports the parameter (the conformance check every backend runs, against the CPU itself:
/// its assertions on the reports and the kept statistics).
#[test]
fn a_step_never_rebuilds_an_infinite_second_moment() {
    lpmm_optim::testing::factorized_overflow_is_bit_exact(&lpmm_optim::Cpu);
}
