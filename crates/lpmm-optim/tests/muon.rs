//! Muon's matrix phase on the CPU: against torch 2.15's `torch.optim.Muon` over 100 steps
//! (golden/muon.safetensors, made by golden/gen_muon.py) and a plain f64 reference of the
//! algorithm (wide, tall, square matrices), the same bits on every thread count, exact resume,
//! the 8-bit momentum's codes equal lpmm-quant's quantizer's, and the bad inputs (a vector, an
//! empty matrix, non-finite gradients and momentum) and the hybrid's routing.
//!
//! `cargo test -p lpmm-optim --release --test muon -- --nocapture` prints the measured figures.

mod common;

use common::{difference, f32s, grad, init};
use lpmm_optim::backend::MatrixShape;
use lpmm_optim::testing::Rng;
use lpmm_optim::{
    AdjustLr, Checkpoint, Hybrid, MapKind, Muon, NonFinitePolicy, OptimError, Optimizer,
    OptimizerOptions, ParamConfig, ParamId, Parts, Route, SlotKind, Step, presets,
};
use lpmm_quant::{BlockSize, Blockwise, QuantRounding};

/// torch's `Muon` step in f64 (the Newton–Schulz products in f64 too): what lpmm's f32 Muon
/// approximates. `p`, `g` and `buf` are row-major `rows × cols`.
fn reference_step(rule: &Muon, shape: [usize; 2], p: &mut [f64], buf: &mut [f64], g: &[f64]) {
    let [rows, cols] = shape;
    let mu = rule.momentum;
    for (b, &gi) in buf.iter_mut().zip(g) {
        *b += (1.0 - mu) * (gi - *b);
    }
    let u: Vec<f64> = if rule.nesterov {
        g.iter()
            .zip(buf.iter())
            .map(|(&gi, &b)| gi + mu * (b - gi))
            .collect()
    } else {
        buf.to_vec()
    };
    let m = MatrixShape { rows, cols };
    let (mm, nn) = (m.m(), m.n());
    // The wide view.
    let at = |i: usize, j: usize| {
        if m.transposed() {
            j * cols + i
        } else {
            i * cols + j
        }
    };
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
            let moved: Vec<f64> = p
                .iter()
                .zip(&init)
                .map(|(a, &b)| a - f64::from(b))
                .collect();
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

/// golden/gen_muon.py's matrices: (tensor id, name, shape).
const GOLDEN: [(usize, &str, [usize; 2]); 4] = [
    (10, "w", [40, 96]),
    (11, "t", [120, 36]),
    (12, "s", [48, 48]),
    (13, "x", [64, 200]),
];

/// The largest difference from torch's `Muon` that lpmm's f32 Muon is held to, over 100 steps of
/// the golden scenario, relative to the tensor's largest |value| (about 0.5): torch runs the
/// Newton–Schulz iterations in bf16 (its `_zeropower_via_newtonschulz` casts the update to
/// bfloat16), lpmm in f32, and the bf16 rounding of the orthogonalised update is what the bound
/// covers. docs/OPTIMIZERS.md ("Muon") states it.
pub const TORCH_BOUND: f64 = 1e-2;

/// Against the same torch function with float32 in place of bfloat16 (the algorithm lpmm
/// runs): the products' f32 summation order (MKL's against `gemm`'s) is the only difference.
pub const TORCH_F32_BOUND: f64 = 1e-4;

fn golden() -> safetensors::SafeTensors<'static> {
    const FILE: &[u8] = include_bytes!("golden/muon.safetensors");
    safetensors::SafeTensors::deserialize(FILE).expect("golden file parses")
}

/// Runs lpmm's f32 Muon with `rule` over golden/gen_muon.py's scenario for 100 steps (gradients
/// given, as torch's `p.grad`), checking the stored parameter snapshots of `{anchor}.{ns}`
/// within `bound`; returns the largest relative difference and the optimizer.
fn follow(anchor: &str, ns: &str, rule: Muon, bound: f64) -> (f64, Optimizer, Vec<ParamId>) {
    let st = golden();
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let group = opt.add_group(ParamConfig::f32(rule)).unwrap();
    let ids: Vec<ParamId> = GOLDEN
        .iter()
        .map(|&(tid, name, shape)| {
            opt.add_param(name, &shape, &init(tid, shape[0] * shape[1]), group)
                .unwrap()
        })
        .collect();
    let mut worst = 0f64;
    for t in 1..=100u64 {
        let grads: Vec<Vec<f32>> = GOLDEN
            .iter()
            .map(|&(tid, _, shape)| grad(tid, t, shape[0] * shape[1]))
            .collect();
        for (&id, g) in ids.iter().zip(&grads) {
            opt.step(Step::param(id, g)).unwrap();
        }
        for (&id, &(_, name, shape)) in ids.iter().zip(&GOLDEN) {
            let key = format!("{anchor}.{ns}.step{t}.{name}");
            if st.tensor(&key).is_err() {
                continue;
            }
            let got = read(&opt, id, SlotKind::Param, shape[0] * shape[1]);
            let (abs, rel) = difference(&f32s(&st, &key), &got);
            println!("{anchor} ({ns} NS) step {t:3} {name}: max abs {abs:.3e}, rel {rel:.3e}");
            assert!(rel <= bound, "{key}: {rel:.3e} > {bound:.0e}");
            worst = worst.max(rel);
        }
    }
    (worst, opt, ids)
}

/// The golden configurations, as lpmm's rule.
fn golden_rules() -> [(&'static str, Muon); 3] {
    [
        ("muon_default", Muon::new(0.02)),
        (
            "muon_plain_rms",
            Muon::new(0.02)
                .momentum(0.9)
                .nesterov(false)
                .weight_decay(0.01)
                .adjust_lr(AdjustLr::MatchRmsAdamW)
                .ns_steps(3),
        ),
        (
            "muon_spectral",
            Muon::new(0.01).adjust_lr(AdjustLr::SpectralUnclamped),
        ),
    ]
}

/// lpmm's f32 Muon against torch 2.15's `torch.optim.Muon` over 100 steps, for the three golden
/// configurations (defaults; no Nesterov, momentum 0.9, Moonshot's adjustment and 3 iterations;
/// Bernstein's adjustment): the momentum bit for bit (torch's `lerp` is lpmm's op sequence), the
/// parameters within [`TORCH_BOUND`] of torch as shipped (bf16 Newton–Schulz) and within
/// [`TORCH_F32_BOUND`] of torch with the iterations in f32.
#[test]
fn f32_muon_follows_torch() {
    let st = golden();
    for (anchor, rule) in golden_rules() {
        for (ns, bound) in [("bf16", TORCH_BOUND), ("f32", TORCH_F32_BOUND)] {
            let (worst, opt, ids) = follow(anchor, ns, rule, bound);
            println!("{anchor} ({ns} NS): worst {worst:.3e} (bound {bound:.0e})");
            let want = f32s(&st, &format!("{anchor}.{ns}.momentum.t"));
            let got = read(&opt, ids[1], SlotKind::State1, want.len());
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{anchor}: the momentum of t is not torch's bit for bit"
            );
        }
    }
}

/// A training run of 8-bit Muon with bf16 parameters on a wide, a tall and a large matrix (five
/// of the CPU's pieces of 2^16 elements: the gather and the fused pass cut it), stepped from
/// accumulated gradients: every slot's bits after `steps` steps.
fn train_bits(steps: usize) -> Vec<Vec<u8>> {
    let mut opt = Optimizer::new(OptimizerOptions::default().with_seed(3)).unwrap();
    let group = opt.add_group(presets::muon_8bit_bf16_sr(0.02)).unwrap();
    let mut rng = Rng::new(9);
    let shapes = [[64usize, 700], [700, 64], [513, 520]];
    let ids: Vec<(ParamId, usize)> = shapes
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let n = s[0] * s[1];
            let id = opt
                .add_param(&format!("w{k}"), s, &rng.spread(n, 0.5), group)
                .unwrap();
            (id, n)
        })
        .collect();
    for _ in 0..steps {
        for &(id, n) in &ids {
            opt.accumulate(id, &rng.spread(n, 1.0)).unwrap();
        }
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
    let parts = Parts::of(&opt);
    let mut bits = Vec::new();
    for &(id, _) in &ids {
        for slot in SlotKind::ALL {
            let slot = parts.export_slot(id, slot, None).unwrap();
            bits.extend(slot.regions.iter().map(|r| r.bytes.clone()));
        }
    }
    bits
}

/// The matrix phase gives the same bits on 1, 2, 3 and 7 threads (`gemm` splits each product's
/// output, never a sum: tests the parallel path on the large matrix), as does every other part
/// of the step.
#[test]
fn the_same_bits_on_every_thread_count() {
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| train_bits(3))
    };
    let one = run(1);
    for threads in [2, 3, 7] {
        assert!(run(threads) == one, "{threads} threads differ from 1");
    }
}

/// Saved after 3 steps and loaded into a fresh optimizer, 8-bit Muon resumes bit for bit: 3 more
/// steps give the bits of 6 uninterrupted ones.
#[test]
fn a_checkpoint_resumes_exactly() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-muon-");
    let path = tmp.path().join("muon.safetensors");
    let shapes = [[64usize, 96], [96, 64]];
    let fresh = || {
        let mut opt = Optimizer::new(OptimizerOptions::default().with_seed(1)).unwrap();
        let g = opt.add_group(presets::muon_8bit_bf16_sr(0.02)).unwrap();
        let mut rng = Rng::new(4);
        let ids: Vec<ParamId> = shapes
            .iter()
            .enumerate()
            .map(|(k, s)| {
                opt.add_param(&format!("w{k}"), s, &rng.spread(s[0] * s[1], 0.5), g)
                    .unwrap()
            })
            .collect();
        (opt, ids)
    };
    let step = |opt: &mut Optimizer, ids: &[ParamId], t: usize| {
        for (k, &id) in ids.iter().enumerate() {
            let n = shapes[k][0] * shapes[k][1];
            opt.step(Step::param(
                id,
                &Rng::new((t * 10 + k) as u64).spread(n, 1.0),
            ))
            .unwrap();
        }
    };
    let snapshot = |opt: &Optimizer, ids: &[ParamId]| -> Vec<Vec<u8>> {
        let parts = Parts::of(opt);
        ids.iter()
            .flat_map(|&id| {
                SlotKind::ALL.map(|slot| {
                    let slot = parts.export_slot(id, slot, None).unwrap();
                    slot.regions.iter().flat_map(|r| r.bytes.clone()).collect()
                })
            })
            .collect()
    };
    let (mut straight, ids) = fresh();
    (0..6).for_each(|t| step(&mut straight, &ids, t));
    let (mut first, _) = fresh();
    (0..3).for_each(|t| step(&mut first, &ids, t));
    first.save(&path, Checkpoint::default()).unwrap();
    let (mut resumed, _) = fresh();
    resumed.load(&path, Checkpoint::default()).unwrap();
    (3..6).for_each(|t| step(&mut resumed, &ids, t));
    assert!(snapshot(&resumed, &ids) == snapshot(&straight, &ids));
}

/// 8-bit Muon's momentum codes are lpmm-quant's block-wise quantizer's (bitsandbytes' signed
/// dynamic map, blocks of 256, nearest) of the momentum f32 Muon holds after the same steps: the
/// matrix phase reads the momentum, it does not change how it is stored.
#[test]
fn eight_bit_momentum_codes_are_the_quantizers() {
    let shape = [48usize, 64];
    let n = shape[0] * shape[1];
    let mut rng = Rng::new(21);
    let init = rng.spread(n, 0.5);
    let g = rng.spread(n, 1.0);
    let one_step = |config: ParamConfig| {
        let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
        let group = opt.add_group(config.with_min_quantized_size(0)).unwrap();
        let id = opt.add_param("w", &shape, &init, group).unwrap();
        opt.step(Step::param(id, &g)).unwrap();
        (opt, id)
    };
    // From a zero momentum, one step stores lerp(0, g, 1 - mu): exact in f32 and 8 bits alike.
    let (f32_opt, f32_id) = one_step(presets::muon_f32(0.02).into());
    let momentum = read(&f32_opt, f32_id, SlotKind::State1, n);
    let (q_opt, q_id) = one_step(presets::muon_8bit(0.02).into());
    let stored = Parts::of(&q_opt)
        .export_slot(q_id, SlotKind::State1, None)
        .unwrap();
    let quantizer = Blockwise::new(MapKind::DynamicSigned8.shared(), BlockSize::B256);
    let (mut codes, mut absmax) = (vec![0u8; n], vec![0f32; n.div_ceil(256)]);
    quantizer
        .quantize(&momentum, &mut codes, &mut absmax, QuantRounding::Nearest)
        .unwrap();
    assert_eq!(stored.regions[0].bytes, codes, "the momentum's codes");
    let absmax_bytes: Vec<u8> = absmax.iter().flat_map(|a| a.to_le_bytes()).collect();
    assert_eq!(stored.regions[1].bytes, absmax_bytes, "the blocks' absmax");
}

/// What a careless user sends Muon: a vector (Muon alone refuses it, naming the rule and the
/// hybrid; the hybrid routes it to AdamW), an empty matrix (refused), a NaN gradient (the step
/// skipped by default, nothing changed; under `SkipElements` that element left as it was and
/// the parameter reported), and a gradient whose momentum overflows f32 (the elements left as
/// they were, reported as non-finite input).
#[test]
fn bad_inputs_get_typed_errors_or_the_documented_handling() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let muon = opt.add_group(presets::muon_8bit_bf16_sr(0.02)).unwrap();
    let e = opt.add_param("bias", &[17], &[0.0; 17], muon).unwrap_err();
    assert!(
        matches!(&e, OptimError::NotAMatrix { param, rule: "muon", shape } if param == "bias" && shape == &[17]),
        "{e:?}"
    );
    assert!(e.to_string().contains("Hybrid"), "{e}");
    let e = opt.add_param("empty", &[0, 8], &[], muon).unwrap_err();
    assert!(matches!(e, OptimError::Shape { .. }), "{e:?}");
    let e = opt
        .add_param("cube", &[2, 3, 4], &[0.0; 24], muon)
        .unwrap_err();
    assert!(matches!(e, OptimError::NotAMatrix { .. }), "{e:?}");

    // The hybrid: matrices to Muon, a vector and the embedding to AdamW, a route overrides.
    let hybrid = presets::muon_adamw_8bit_bf16_sr(0.02, 3e-4).route("head.weight", Route::Others);
    assert_eq!(hybrid.route_of("layers.0.w", &[8, 8]), Route::Matrices);
    assert_eq!(hybrid.route_of("layers.0.b", &[8]), Route::Others);
    assert_eq!(hybrid.route_of("embed.weight", &[100, 8]), Route::Others);
    assert_eq!(hybrid.route_of("head.weight", &[8, 100]), Route::Others);
    let forced = Hybrid::new(presets::muon_f32(0.02), presets::adamw_f32(1e-3))
        .route("bias", Route::Matrices);
    let mut o = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = o.add_group(forced.config_for("bias", &[17])).unwrap();
    assert!(matches!(
        o.add_param("bias", &[17], &[0.0; 17], g),
        Err(OptimError::NotAMatrix { .. })
    ));

    let shape = [16usize, 24];
    let n = shape[0] * shape[1];
    let mut rng = Rng::new(5);
    let init = rng.spread(n, 0.5);
    for policy in [NonFinitePolicy::SkipStep, NonFinitePolicy::SkipElements] {
        let mut opt = Optimizer::new(OptimizerOptions::default().with_non_finite(policy)).unwrap();
        let group = opt.add_group(presets::muon_f32(0.02)).unwrap();
        let id = opt.add_param("w", &shape, &init, group).unwrap();
        opt.step(Step::param(id, &rng.spread(n, 1.0))).unwrap();
        let (p0, m0) = (
            read(&opt, id, SlotKind::Param, n),
            read(&opt, id, SlotKind::State1, n),
        );
        let mut bad = rng.spread(n, 1.0);
        bad[7] = f32::NAN;
        let report = opt.step(Step::param(id, &bad)).unwrap();
        let (p1, m1) = (
            read(&opt, id, SlotKind::Param, n),
            read(&opt, id, SlotKind::State1, n),
        );
        assert_eq!(report.non_finite, vec![id], "{policy:?}");
        match policy {
            NonFinitePolicy::SkipStep => {
                assert!(report.skipped);
                assert_eq!((p1.clone(), m1.clone()), (p0.clone(), m0.clone()));
            }
            _ => {
                assert!(!report.skipped);
                assert_eq!(p1[7].to_bits(), p0[7].to_bits(), "the NaN element is left");
                assert_eq!(m1[7].to_bits(), m0[7].to_bits());
                assert!(p1.iter().zip(&p0).filter(|(a, b)| a != b).count() > n / 2);
            }
        }
        assert!(p1.iter().chain(&m1).all(|v| v.is_finite()));
    }

    // A momentum that overflows: -MAX then +MAX gives lerp(m, g, 0.05) = m + 0.05 (g - m) with
    // g - m beyond f32.
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let group = opt.add_group(presets::muon_f32(0.02)).unwrap();
    let id = opt.add_param("w", &[4, 4], &[0.25; 16], group).unwrap();
    opt.step(Step::param(id, &[-f32::MAX; 16])).unwrap();
    let before = (
        read(&opt, id, SlotKind::Param, 16),
        read(&opt, id, SlotKind::State1, 16),
    );
    let report = opt.step(Step::param(id, &[f32::MAX; 16])).unwrap();
    let after = (
        read(&opt, id, SlotKind::Param, 16),
        read(&opt, id, SlotKind::State1, 16),
    );
    assert_eq!(
        report.non_finite,
        vec![id],
        "reported like non-finite input"
    );
    assert_eq!(after, before, "every element overflowed: none moved");
}
