//! Muon's matrix phase on the CPU: against a plain f64 reference of the algorithm (wide, tall and
//! square matrices, lent and released parameters), the same bits on every thread count, exact
//! resume, the 8-bit momentum's codes equal lpmm-quant's quantizer's, and the bad inputs (a
//! vector, an empty matrix, non-finite gradients). The anchors (torch's `Muon`, burn-optim's)
//! are in `tests/anchors_muon.rs`.
//!
//! `cargo test -p lpmm-optim --release --test muon`

use lpmm_optim::backend::MatrixShape;
use lpmm_optim::testing::Rng;
use lpmm_optim::{
    AdjustLr, Checkpoint, Muon, NonFinitePolicy, OptimError, Optimizer, OptimizerOptions,
    ParamConfig, ParamId, Parts, SlotKind, Step, Storage, presets,
};

/// torch's `Muon` step in f64 (the Newton–Schulz products in f64 too): what lpmm's f32 Muon
/// approximates. `p`, `g` and `buf` are row-major `rows × cols`.
fn reference_step(rule: &Muon, shape: [usize; 2], p: &mut [f64], buf: &mut [f64], g: &[f64]) {
    let [rows, cols] = shape;
    let mu = rule.momentum;
    for (b, &gi) in buf.iter_mut().zip(g) {
        *b += (1.0 - mu) * (gi - *b);
    }
    let u: Vec<f64> = if rule.nesterov {
        g.iter().zip(buf.iter()).map(|(&gi, &b)| gi + mu * (b - gi)).collect()
    } else {
        buf.to_vec()
    };
    let m = MatrixShape { rows, cols };
    let (mm, nn) = (m.m(), m.n());
    // The wide view.
    let at = |i: usize, j: usize| if m.transposed() { j * cols + i } else { i * cols + j };
    let mut x: Vec<f64> = (0..mm * nn).map(|k| u[at(k / nn, k % nn)]).collect();
    let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt().max(rule.eps);
    x.iter_mut().for_each(|v| *v /= norm);
    let (a, b, c) = rule.ns_coefficients;
    for _ in 0..rule.ns_steps {
        let mut gram = vec![0f64; mm * mm];
        for i in 0..mm {
            for j in 0..mm {
                gram[i * mm + j] = (0..nn).map(|k| x[i * nn + k] * x[j * nn + k]).sum();
            }
        }
        let mut poly = vec![0f64; mm * mm];
        for i in 0..mm {
            for j in 0..mm {
                let aa: f64 = (0..mm).map(|k| gram[i * mm + k] * gram[k * mm + j]).sum();
                poly[i * mm + j] = b * gram[i * mm + j] + c * aa;
            }
        }
        let mut next = vec![0f64; mm * nn];
        for i in 0..mm {
            for j in 0..nn {
                let bx: f64 = (0..mm).map(|k| poly[i * mm + k] * x[k * nn + j]).sum();
                next[i * nn + j] = a * x[i * nn + j] + bx;
            }
        }
        x = next;
    }
    let lr = rule.lr * rule.adjust_lr.ratio(rows, cols);
    for i in 0..mm {
        for j in 0..nn {
            let e = at(i, j);
            p[e] = p[e] * (1.0 - rule.lr * rule.weight_decay) - lr * x[i * nn + j];
        }
    }
}

/// The largest |a - b| over the largest |a|.
fn relative(want: &[f64], got: &[f32]) -> f64 {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let diff = want
        .iter()
        .zip(got)
        .fold(0f64, |m, (a, b)| m.max((a - f64::from(*b)).abs()));
    diff / scale
}

fn read(opt: &Optimizer, id: ParamId, slot: SlotKind, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    opt.read(id, slot, &mut out).unwrap();
    out
}

/// f32 Muon follows the f64 algorithm on a wide, a tall (transposed), a square and a one-row
/// matrix, with both learning-rate adjustments, Nesterov or not: after 10 steps the parameters
/// are within 2e-5 of the reference's largest value and the momentum within 1e-6 (f32 rounding;
/// the products' sums run over up to 300 terms).
#[test]
fn f32_muon_follows_the_algorithm_in_f64() {
    let rules = [
        Muon::new(0.02),
        Muon::new(0.05)
            .nesterov(false)
            .momentum(0.8)
            .weight_decay(0.01)
            .adjust_lr(AdjustLr::MatchRmsAdamW)
            .ns_steps(3),
        Muon::new(0.02).adjust_lr(AdjustLr::SpectralUnclamped),
    ];
    for rule in rules {
        for shape in [[24usize, 300], [300, 24], [40, 40], [1, 17]] {
            let n = shape[0] * shape[1];
            let mut rng = Rng::new(n as u64);
            let init = rng.spread(n, 0.5);
            let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
            let group = opt.add_group(ParamConfig::f32(rule)).unwrap();
            let id = opt.add_param("w", &shape, &init, group).unwrap();
            let mut p: Vec<f64> = init.iter().map(|&v| f64::from(v)).collect();
            let mut buf = vec![0f64; n];
            for _ in 0..10 {
                let g = rng.spread(n, 1.0);
                let g64: Vec<f64> = g.iter().map(|&v| f64::from(v)).collect();
                reference_step(&rule, shape, &mut p, &mut buf, &g64);
                opt.step(Step::param(id, &g)).unwrap();
            }
            let got = read(&opt, id, SlotKind::Param, n);
            let moved: Vec<f64> = p.iter().zip(&init).map(|(a, &b)| a - f64::from(b)).collect();
            let got_moved: Vec<f32> = got.iter().zip(&init).map(|(a, b)| a - b).collect();
            let (rp, rm) = (
                relative(&p, &got),
                relative(&buf, &read(&opt, id, SlotKind::State1, n)),
            );
            let rmove = relative(&moved, &got_moved);
            println!("{shape:?} {rule:?}: param {rp:.2e}, movement {rmove:.2e}, momentum {rm:.2e}");
            assert!(rp < 2e-5 && rmove < 1e-3 && rm < 1e-6, "{shape:?}");
        }
    }
}
