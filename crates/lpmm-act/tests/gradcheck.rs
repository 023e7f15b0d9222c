//! Gradient checks of every operator: against central finite differences of its forward (f64
//! where the operator is exact), against the uncompressed operator (the input saved), and for the
//! compressed backward passes, bias and variance measured over many random streams.

use lpmm_act::{
    Activation, BitMask, Compressed, Grid, Table, Weight, gelu_backward_from_output, gelu_forward,
    gelu_invert, layernorm_backward_from_output, layernorm_forward, softmax_dropout_backward,
    softmax_dropout_forward,
};
use lpmm_quant::{BlockSize, RandomStream};

/// xorshift in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.next() * scale) as f32).collect()
    }
}

fn max_rel(a: &[f32], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-12);
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - y).abs() / scale)
        .fold(0.0, f64::max)
}

#[test]
fn gelu_from_output_recovers_the_input_and_matches_finite_differences() {
    let mut rng = Rng(7);
    // Both branches, the region around the minimum, large magnitudes.
    let mut x = rng.vec(4000, 6.0);
    x.extend([
        -0.7518, -0.75, -0.76, -5.0, -9.0, 0.0, -0.0, 10.0, -1e-3, 1e-3,
    ]);
    let (y, mask) = gelu_forward(&x);
    let dy = rng.vec(x.len(), 1.0);
    let dx = gelu_backward_from_output(&dy, &y, &mask).unwrap();
    let h = 1e-6;
    let fd: Vec<f64> = x
        .iter()
        .zip(&dy)
        .map(|(&v, &g)| {
            let v = f64::from(v);
            f64::from(g) * (Activation::Gelu.value(v + h) - Activation::Gelu.value(v - h))
                / (2.0 * h)
        })
        .collect();
    let err = max_rel(&dx, &fd);
    assert!(err < 1e-5, "GELU from output vs finite differences: {err}");
    // The inversion itself: within f32 resolution of the stored output's preimage.
    let mut worst = 0f64;
    for (i, (&v, &out)) in x.iter().zip(&y).enumerate() {
        let back = gelu_invert(f64::from(out), mask.get(i));
        let slope = Activation::Gelu.derivative(f64::from(v)).abs();
        if slope > 1e-2 {
            // |Δx| <= |Δy| / slope, Δy the f32 rounding of the output.
            let tol = f64::from(out).abs().max(1e-30) * 2f64.powi(-23) / slope + 1e-12;
            worst = worst.max((back - f64::from(v)).abs() / tol);
        }
    }
    assert!(worst <= 2.0, "inversion error {worst} x its f32 bound");
}

#[test]
fn layernorm_from_output_matches_finite_differences_and_the_guard_works() {
    let mut rng = Rng(11);
    let (rows, cols) = (6, 37);
    let x = rng.vec(rows * cols, 3.0);
    let mut gamma = rng.vec(cols, 1.0);
    gamma[3] = 0.0; // guarded: its x̂ is saved
    gamma[7] = 1e-5;
    let beta = rng.vec(cols, 0.5);
    let eps = 1e-5f32;
    let (y, saved) = layernorm_forward(&x, &gamma, &beta, rows, cols, eps).unwrap();
    assert_eq!(saved.fallback_columns(), &[3, 7]);
    let dy = rng.vec(rows * cols, 1.0);
    let (dx, dgamma, dbeta) =
        layernorm_backward_from_output(&dy, &y, &saved, &gamma, &beta).unwrap();
    // f64 reference of L = Σ dy ⊙ LN(x), differentiated numerically.
    let ln = |x: &[f64], g: &[f64], b: &[f64]| -> f64 {
        let mut l = 0.0;
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let mean = row.iter().sum::<f64>() / cols as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
            let rs = 1.0 / (var + f64::from(eps)).sqrt();
            for j in 0..cols {
                l += f64::from(dy[r * cols + j]) * ((row[j] - mean) * rs * g[j] + b[j]);
            }
        }
        l
    };
    let xf: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let gf: Vec<f64> = gamma.iter().map(|&v| f64::from(v)).collect();
    let bf: Vec<f64> = beta.iter().map(|&v| f64::from(v)).collect();
    let h = 1e-6;
    let num = |f: &dyn Fn(usize, f64) -> f64, n: usize| -> Vec<f64> {
        (0..n).map(|i| (f(i, h) - f(i, -h)) / (2.0 * h)).collect()
    };
    let fd_x = num(
        &|i, d| {
            let mut v = xf.clone();
            v[i] += d;
            ln(&v, &gf, &bf)
        },
        xf.len(),
    );
    let fd_g = num(
        &|i, d| {
            let mut v = gf.clone();
            v[i] += d;
            ln(&xf, &v, &bf)
        },
        cols,
    );
    let fd_b = num(
        &|i, d| {
            let mut v = bf.clone();
            v[i] += d;
            ln(&xf, &gf, &v)
        },
        cols,
    );
    for (what, got, want) in [
        ("dx", &dx, &fd_x),
        ("dgamma", &dgamma, &fd_g),
        ("dbeta", &dbeta, &fd_b),
    ] {
        let e = max_rel(got, want);
        assert!(e < 1e-4, "LayerNorm {what} vs finite differences: {e}");
    }
}

#[test]
fn softmax_dropout_matches_finite_differences_and_keeps_the_right_share() {
    let mut rng = Rng(5);
    let (rows, cols, p) = (5, 64, 0.25f32);
    let x = rng.vec(rows * cols, 4.0);
    let stream = RandomStream::new(9, 1, 0);
    let (out, s, mask) = softmax_dropout_forward(&x, rows, cols, p, &stream).unwrap();
    let dy = rng.vec(rows * cols, 1.0);
    let dx = softmax_dropout_backward(&dy, &s, &mask, rows, cols, p).unwrap();
    let f = |x: &[f64]| -> f64 {
        let mut l = 0.0;
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
            for j in 0..cols {
                let keep = if mask.get(r * cols + j) {
                    1.0 / (1.0 - f64::from(p))
                } else {
                    0.0
                };
                l += f64::from(dy[r * cols + j]) * (row[j] - m).exp() / z * keep;
            }
        }
        l
    };
    let xf: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let h = 1e-6;
    let fd: Vec<f64> = (0..xf.len())
        .map(|i| {
            let (mut a, mut b) = (xf.clone(), xf.clone());
            a[i] += h;
            b[i] -= h;
            (f(&a) - f(&b)) / (2.0 * h)
        })
        .collect();
    let e = max_rel(&dx, &fd);
    assert!(e < 1e-4, "softmax·dropout vs finite differences: {e}");
    // The output is the softmax masked and scaled; the kept share is near 1 - p.
    let kept = (0..rows * cols).filter(|&i| mask.get(i)).count() as f64 / (rows * cols) as f64;
    assert!((kept - 0.75).abs() < 0.06, "kept {kept}");
    for i in 0..rows * cols {
        let want = if mask.get(i) {
            s[i] * (1.0 / (1.0 - p))
        } else {
            0.0
        };
        assert_eq!(out[i].to_bits(), want.to_bits());
    }
    assert!(softmax_dropout_forward(&x, rows, cols, 1.0, &stream).is_err());
}

#[test]
fn few_bit_backward_is_the_table_derivative_and_its_error_is_bounded() {
    let mut rng = Rng(3);
    let x: Vec<f32> = (0..20_000).map(|_| (rng.next() * 3.0) as f32).collect();
    let dy = rng.vec(x.len(), 1.0);
    for act in Activation::ALL {
        for bits in 1..=4 {
            let t = Table::solve(act, bits, Weight::STANDARD, Grid::default()).unwrap();
            let packed = t.encode(&x);
            assert_eq!(packed.len(), (x.len() * bits as usize).div_ceil(8));
            let dx = t.backward(&dy, &packed).unwrap();
            // Exactly dy times the level of the input's piece.
            for i in 0..x.len() {
                assert_eq!(
                    dx[i].to_bits(),
                    (dy[i] * t.levels[usize::from(t.code(x[i]))]).to_bits()
                );
            }
            // Against the exact derivative (the uncompressed operator's backward): the RMS error
            // of dx / dy is the table's error on these inputs.
            let e: f64 = (x
                .iter()
                .map(|&v| {
                    let d =
                        f64::from(t.levels[usize::from(t.code(v))]) - act.derivative(f64::from(v));
                    d * d
                })
                .sum::<f64>()
                / x.len() as f64)
                .sqrt();
            let bound = [0.5, 0.25, 0.12, 0.06][bits as usize - 1];
            assert!(e < bound, "{act:?} {bits} bits: RMS derivative error {e}");
        }
    }
}

#[test]
fn compression_is_unbiased_and_its_variance_shrinks_with_bits() {
    let mut rng = Rng(13);
    let n = 4096;
    let x = rng.vec(n, 2.0);
    let trials = 400;
    let mut last_var = f64::INFINITY;
    for bits in [2u32, 4, 8] {
        let mut sum = vec![0f64; n];
        let mut sq = vec![0f64; n];
        let mut ups = vec![0u32; n];
        for t in 0..trials {
            let c = Compressed::new(&x, bits, BlockSize::B256, RandomStream::new(t, 0, 0)).unwrap();
            for (i, v) in c.decompress().iter().enumerate() {
                let e = f64::from(*v) - f64::from(x[i]);
                sum[i] += e;
                sq[i] += e * e;
                ups[i] += u32::from(e > 0.0);
            }
        }
        // Over all elements, the average bias is within 5 of its standard errors.
        let (mut bias_sum, mut var_sum) = (0f64, 0f64);
        for i in 0..n {
            let mean = sum[i] / trials as f64;
            bias_sum += mean;
            var_sum += (sq[i] / trials as f64 - mean * mean).max(0.0);
        }
        let bias = bias_sum / n as f64;
        let var = var_sum / n as f64;
        let se = (var / (trials as f64 * n as f64)).sqrt();
        assert!(
            bias.abs() < 5.0 * se,
            "{bits} bits: mean bias {bias} vs standard error {se}"
        );
        // Per element, the number of trials that rounded up is within 6 standard deviations of
        // its expectation `trials * p`, `p` the element's fraction of the way from its lower grid
        // point (`y * L`, `y = x / absmax` in f32, `L = 2^(bits - 1) - 1`), wherever the count
        // is binomial enough for that (variance at least 10; the rest are in the mean above).
        let levels = f64::from((1u32 << (bits - 1)) - 1);
        let mut z_max = 0f64;
        for (b, block) in x.chunks(256).enumerate() {
            let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (j, &v) in block.iter().enumerate() {
                let pos = f64::from(v / absmax) * levels;
                let p = pos - pos.floor();
                let var = trials as f64 * p * (1.0 - p);
                if var >= 10.0 {
                    let k = f64::from(ups[256 * b + j]);
                    z_max = z_max.max((k - trials as f64 * p).abs() / var.sqrt());
                }
            }
        }
        assert!(
            z_max < 6.0,
            "{bits} bits: an element's count of roundings up is {z_max} standard deviations off"
        );
        assert!(
            var < last_var,
            "{bits} bits: variance {var} not below {last_var}"
        );
        last_var = var;
        eprintln!("{bits} bits: mean bias {bias:.3e}, mean variance {var:.3e}");
    }
    assert!(Compressed::new(&[f32::NAN], 4, BlockSize::B256, RandomStream::new(0, 0, 0)).is_err());
    assert!(Compressed::new(&x, 3, BlockSize::B256, RandomStream::new(0, 0, 0)).is_err());
}

#[test]
fn masks_and_lengths_are_checked() {
    let (y, mask) = gelu_forward(&[1.0, -1.0]);
    assert!(gelu_backward_from_output(&[1.0], &y, &mask).is_err());
    assert!(gelu_backward_from_output(&[1.0, 1.0], &y, &BitMask::zeros(3)).is_err());
    assert!(layernorm_forward(&[1.0; 6], &[1.0; 3], &[0.0; 2], 2, 3, 1e-5).is_err());
}
