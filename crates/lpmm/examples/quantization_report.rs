//! The formats and quantizers side by side, on tensors shaped like an optimizer's: for each storage
//! format, bytes per element and the error it makes; then the underflow problem that low-precision
//! parameters face, and how stochastic rounding, Kahan compensation and split f32 avoid it.
//!
//! `cargo run --release -p lpmm --example quantization_report`
//! Prints markdown and writes it to `target/lpmm-report/quantization.md`.

use lpmm::formats::{CodeMap, Fp8, Overflow, Rounding, SplitF32, bf16, float, kahan_add};
use lpmm::quant::{BlockSize, Blockwise, LinearGroup, QuantRounding, RandomStream, Rank1};
use std::fmt::Write as _;

const ROWS: usize = 1024;
const COLS: usize = 1024;
const N: usize = ROWS * COLS;

/// Gaussian values from the counter-based stream (Box-Muller), with row and column scales so the
/// tensor has the structure real weight matrices and second moments have.
fn tensor(seed: u64) -> Vec<f32> {
    let mut bits = vec![0u32; 2 * N];
    RandomStream::new(seed, 0, 0).fill(0, &mut bits);
    (0..N)
        .map(|i| {
            let u1 = (f64::from(bits[2 * i]) + 0.5) / 4_294_967_296.0;
            let u2 = f64::from(bits[2 * i + 1]) / 4_294_967_296.0;
            let g = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            let (r, c) = (i / COLS, i % COLS);
            let scale = (1.0 + (r % 17) as f64) * (1.0 + (c % 5) as f64 * 3.0) * 1e-3;
            (g * scale) as f32
        })
        .collect()
}

struct Row {
    format: String,
    bytes_per_element: f64,
    rel_rms: f64,
    max_rel: f64,
    mean_err: f64,
}

fn compare(format: &str, bytes: f64, x: &[f32], back: &[f32]) -> Row {
    let (mut se, mut sx, mut max_rel, mut sum_err) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let absmax = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    for (&a, &b) in x.iter().zip(back) {
        let e = f64::from(b) - f64::from(a);
        se += e * e;
        sx += f64::from(a) * f64::from(a);
        sum_err += e;
        max_rel = max_rel.max(e.abs() / absmax);
    }
    Row {
        format: format.to_string(),
        bytes_per_element: bytes,
        rel_rms: (se / sx).sqrt(),
        max_rel,
        mean_err: sum_err / x.len() as f64 / (sx / x.len() as f64).sqrt(),
    }
}

fn blockwise(
    name: &str,
    map: &CodeMap,
    block: usize,
    x: &[f32],
    rounding: QuantRounding,
    sign_fix: bool,
) -> Row {
    let q =
        Blockwise::new(map, BlockSize::new(block).expect("valid block")).with_sign_fix(sign_fix);
    let mut codes = vec![0u8; q.codes_len(x.len())];
    let mut absmax = vec![0f32; q.scales_len(x.len())];
    q.quantize(x, &mut codes, &mut absmax, rounding)
        .expect("finite input");
    let mut back = vec![0f32; x.len()];
    q.dequantize(&codes, &absmax, &mut back)
        .expect("lengths match");
    let bytes = (codes.len() + 4 * absmax.len()) as f64 / x.len() as f64;
    compare(name, bytes, x, &back)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let x = tensor(1);
    let squares: Vec<f32> = x.iter().map(|v| v * v).collect();
    let sr = QuantRounding::Stochastic {
        stream: RandomStream::new(7, 0, 0),
        offset: 0,
    };
    let dynamic8 = CodeMap::dynamic(true, 8)?;
    let dynamic8u = CodeMap::dynamic(false, 8)?;
    let de4 = CodeMap::dynamic(true, 4)?;
    let no_zero4 = CodeMap::linear_without_zero(4)?;
    let nf4 = CodeMap::normal_float(4)?;

    let mut rows = Vec::new();
    let map_floats = |name: &str, bytes: f64, f: &dyn Fn(usize, f32) -> f32| {
        let back: Vec<f32> = x.iter().enumerate().map(|(i, &v)| f(i, v)).collect();
        compare(name, bytes, &x, &back)
    };
    let mut bits = vec![0u32; N];
    RandomStream::new(7, 1, 0).fill(0, &mut bits);
    rows.push(map_floats("bf16, nearest", 2.0, &|_, v| {
        float::bf16_nearest(v).to_f32()
    }));
    rows.push(map_floats("bf16, stochastic", 2.0, &|i, v| {
        float::bf16_stochastic(v, bits[i]).to_f32()
    }));
    rows.push(map_floats("f16, nearest", 2.0, &|_, v| {
        float::f16_nearest(v).to_f32()
    }));
    // fp8 with one per-tensor scale (absmax / max finite), as torch's scaled fp8 casts use.
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    for fmt in Fp8::ALL {
        let scale = amax / fmt.max_finite();
        rows.push(map_floats(
            &format!("{fmt:?}, per-tensor scale, nearest"),
            1.0,
            &|_, v| {
                fmt.decode(fmt.encode(v / scale, Rounding::NearestEven, Overflow::Saturate)) * scale
            },
        ));
    }
    rows.push(blockwise(
        "8-bit dynamic signed, block 256 (bitsandbytes m)",
        &dynamic8,
        256,
        &x,
        QuantRounding::Nearest,
        true,
    ));
    rows.push(blockwise(
        "8-bit dynamic signed, block 256, stochastic",
        &dynamic8,
        256,
        &x,
        sr,
        false,
    ));
    rows.push(blockwise(
        "4-bit dynamic-exponent signed, block 128 (lpmm m)",
        &de4,
        128,
        &x,
        QuantRounding::Nearest,
        false,
    ));
    rows.push(blockwise(
        "NF4, block 64",
        &nf4,
        64,
        &x,
        QuantRounding::Nearest,
        false,
    ));
    let group = LinearGroup::lpmm_parameter();
    rows.push(blockwise(
        "8-bit linear, group 64, stochastic (LPMM parameter)",
        group.quantizer().map(),
        64,
        &x,
        sr,
        false,
    ));
    let mut table = String::new();
    writeln!(
        table,
        "## Signed tensor (1024 x 1024 Gaussian with row/column scales)\n"
    )?;
    write_rows(&mut table, &rows)?;

    let mut rows = vec![
        blockwise(
            "8-bit dynamic unsigned, block 256 (bitsandbytes v)",
            &dynamic8u,
            256,
            &squares,
            QuantRounding::Nearest,
            false,
        ),
        blockwise(
            "4-bit linear without zero, block 128",
            &no_zero4,
            128,
            &squares,
            QuantRounding::Nearest,
            false,
        ),
    ];
    let r1 = Rank1::new(&no_zero4, &[ROWS, COLS])?;
    let mut codes = vec![0u8; r1.codes_len()];
    let mut scales = vec![0f32; r1.scales_len()];
    r1.quantize(&squares, &mut codes, &mut scales, QuantRounding::Nearest)?;
    let mut back = vec![0f32; N];
    r1.dequantize(&codes, &scales, &mut back)?;
    let bytes = (codes.len() + 4 * scales.len()) as f64 / N as f64;
    rows.push(compare(
        "4-bit linear without zero, rank-1 (lpmm v)",
        bytes,
        &squares,
        &back,
    ));
    writeln!(
        table,
        "\n## Second-moment-like tensor (the squares of the above)\n"
    )?;
    write_rows(&mut table, &rows)?;

    writeln!(
        table,
        "\n## Underflow: 10,000 updates of +1e-4 to a parameter of 1.0 (bf16 ulp 7.8e-3)\n"
    )?;
    writeln!(
        table,
        "| storage | bytes | final value | error vs exact 2.0 |\n|---|---|---|---|"
    )?;
    let steps = 10_000u32;
    let delta = 1e-4f32;
    let exact = 1.0 + f64::from(steps) * f64::from(delta);
    let mut nearest = bf16::from_f32(1.0);
    let mut stochastic = bf16::from_f32(1.0);
    let (mut kahan, mut comp) = (bf16::from_f32(1.0), bf16::ZERO);
    let mut split = SplitF32::from_f32(1.0);
    let mut f32_param = 1.0f32;
    let stream = RandomStream::new(3, 0, 0);
    for s in 0..steps {
        nearest = float::bf16_nearest(nearest.to_f32() + delta);
        stochastic = float::bf16_stochastic(stochastic.to_f32() + delta, stream.bits(u64::from(s)));
        kahan_add(&mut kahan, &mut comp, delta);
        split = SplitF32::from_f32(split.to_f32() + delta);
        f32_param += delta;
    }
    for (name, bytes, v) in [
        ("f32", 4, f64::from(f32_param)),
        ("bf16, round to nearest", 2, f64::from(nearest.to_f32())),
        (
            "bf16, stochastic rounding",
            2,
            f64::from(stochastic.to_f32()),
        ),
        (
            "bf16 + bf16 Kahan compensation",
            4,
            f64::from(kahan.to_f32()) + f64::from(comp.to_f32()),
        ),
        (
            "split f32 (bf16 + 16-bit remainder)",
            4,
            f64::from(split.to_f32()),
        ),
    ] {
        writeln!(table, "| {name} | {bytes} | {v:.6} | {:+.2e} |", v - exact)?;
    }

    println!("{table}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/lpmm-report");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("quantization.md"), &table)?;
    println!("(written to target/lpmm-report/quantization.md)");
    Ok(())
}

fn write_rows(table: &mut String, rows: &[Row]) -> std::fmt::Result {
    writeln!(
        table,
        "| format | bytes/element | relative RMS error | max error / absmax | mean error / RMS |"
    )?;
    writeln!(table, "|---|---|---|---|---|")?;
    for r in rows {
        writeln!(
            table,
            "| {} | {:.4} | {:.3e} | {:.3e} | {:+.1e} |",
            r.format, r.bytes_per_element, r.rel_rms, r.max_rel, r.mean_err
        )?;
    }
    Ok(())
}
