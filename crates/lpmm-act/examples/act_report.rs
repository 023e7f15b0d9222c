//! The numbers docs/ACTIVATIONS.md quotes: the N(0,1)-weighted RMS derivative error of the
//! few-bit tables at 1-4 bits, the bias and variance of every compressed backward pass measured
//! over random inputs and streams, and the bytes each operator saves per element.
//!
//! `cargo run --release -p lpmm-act --example act_report`

use lpmm_act::{
    Activation, Compressed, Grid, Table, Weight, gelu_backward_from_output, gelu_forward,
    layernorm_backward_from_output, layernorm_forward,
};
use lpmm_quant::{BlockSize, RandomStream};

struct Rng(u64);

impl Rng {
    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let mut u = || {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (a, b) = (u(), u());
        (-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let grid = Grid::default();
    println!("## Few-bit derivative error (N(0,1)-weighted RMS of f'(x) - table(x))\n");
    println!("| activation | 1 bit | 2 bits | 3 bits | 4 bits |");
    println!("|---|---|---|---|---|");
    for act in Activation::ALL {
        let mut row = format!("| {} |", act.name());
        for bits in 1..=4 {
            let t = Table::solve(act, bits, Weight::STANDARD, grid)?;
            row.push_str(&format!(
                " {:.4} |",
                t.rms_error(act, Weight::STANDARD, grid, 200_000)
            ));
        }
        println!("{row}");
    }

    // Backward passes through a compressed residual: dx(compressed) - dx(exact) over N(0,1)
    // inputs, dy ~ N(0,1); bias = mean error, variance = mean squared error minus bias².
    println!("\n## Compressed backward passes: error of dx against the uncompressed operator\n");
    println!(
        "| operator | saved bytes/element | mean error (bias) | error variance | relative RMS |"
    );
    println!("|---|---|---|---|---|");
    let n = 1 << 16;
    let mut rng = Rng(17);
    let x: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    let dy: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    let exact_gelu: Vec<f64> = x
        .iter()
        .zip(&dy)
        .map(|(&v, &g)| f64::from(g) * Activation::Gelu.derivative(f64::from(v)))
        .collect();
    let stats = |got: &[f32], want: &[f64]| {
        let m = got.len() as f64;
        let errs: Vec<f64> = got
            .iter()
            .zip(want)
            .map(|(&a, &b)| f64::from(a) - b)
            .collect();
        let bias = errs.iter().sum::<f64>() / m;
        let var = errs.iter().map(|e| (e - bias).powi(2)).sum::<f64>() / m;
        let scale = (want.iter().map(|w| w * w).sum::<f64>() / m).sqrt();
        (bias, var, (var + bias * bias).sqrt() / scale)
    };
    for bits in 1..=4 {
        let t = Table::solve(Activation::Gelu, bits, Weight::STANDARD, grid)?;
        let dx = t.backward(&dy, &t.encode(&x))?;
        let (b, v, r) = stats(&dx, &exact_gelu);
        println!(
            "| few-bit GELU, {bits} bit(s) | {:.3} | {b:.2e} | {v:.2e} | {r:.4} |",
            bits as f64 / 8.0
        );
    }
    let (y, mask) = gelu_forward(&x);
    let dx = gelu_backward_from_output(&dy, &y, &mask)?;
    let (b, v, r) = stats(&dx, &exact_gelu);
    println!(
        "| GELU from output (+ 1-bit mask; the output is the next layer's saved input) | 0.125 | {b:.2e} | {v:.2e} | {r:.2e} |"
    );
    let (rows, cols) = (n / 256, 256);
    let gamma: Vec<f32> = (0..cols).map(|j| 0.5 + (j % 7) as f32 * 0.1).collect();
    let beta: Vec<f32> = (0..cols).map(|j| (j % 5) as f32 * 0.01).collect();
    let (ln_y, saved) = layernorm_forward(&x, &gamma, &beta, rows, cols, 1e-5)?;
    let (ln_dx, _, _) = layernorm_backward_from_output(&dy, &ln_y, &saved, &gamma, &beta)?;
    // Reference: the same backward from the exact x̂ (f64 from the input).
    let mut want = vec![0f64; n];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / cols as f64;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / cols as f64;
        let rs = 1.0 / (var + 1e-5).sqrt();
        let xh: Vec<f64> = row.iter().map(|&v| (f64::from(v) - mean) * rs).collect();
        let dxh: Vec<f64> = (0..cols)
            .map(|j| f64::from(dy[r * cols + j]) * f64::from(gamma[j]))
            .collect();
        let m1 = dxh.iter().sum::<f64>() / cols as f64;
        let m2 = dxh.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / cols as f64;
        for j in 0..cols {
            want[r * cols + j] = rs * (dxh[j] - m1 - xh[j] * m2);
        }
    }
    let (b, v, r) = stats(&ln_dx, &want);
    println!(
        "| LayerNorm from output (+ rstd per row) | {:.4} | {b:.2e} | {v:.2e} | {r:.2e} |",
        saved.bytes() as f64 / n as f64
    );
    // Block compression of a saved input used by a linear layer's weight gradient: the
    // backward's use of the residual is linear, so its error is the residual's error times dy.
    for bits in [2u32, 4, 8] {
        let mut errs_b = 0.0;
        let mut errs_v = 0.0;
        let mut errs_r = 0.0;
        let mut bytes = 0;
        let trials = 20;
        for t in 0..trials {
            let c = Compressed::new(&x, bits, BlockSize::B256, RandomStream::new(t, 0, 0))?;
            bytes = c.bytes();
            let back = c.decompress();
            let g: Vec<f32> = back.iter().zip(&dy).map(|(a, b)| a * b).collect();
            let w: Vec<f64> = x
                .iter()
                .zip(&dy)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .collect();
            let (bb, vv, rr) = stats(&g, &w);
            errs_b += bb;
            errs_v += vv;
            errs_r += rr;
        }
        let (b, v) = (errs_b / trials as f64, errs_v / trials as f64);
        println!(
            "| block compression, {bits} bits (B = 256, SR), x·dy | {:.4} | {b:.2e} | {v:.2e} | {:.4} |",
            bytes as f64 / n as f64,
            errs_r / trials as f64
        );
    }
    println!(
        "\n(inputs and output gradients N(0,1), {n} elements; command: cargo run --release -p lpmm-act --example act_report)"
    );
    Ok(())
}
