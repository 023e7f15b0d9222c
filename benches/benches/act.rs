//! lpmm-act's forward/backward pairs beside their uncompressed twins, in the same run: each
//! iteration is one forward pass (what the layer computes, plus what it saves for the backward)
//! followed by one backward pass, over 1M elements (256K with `LPMM_BENCH_QUICK=1`).
//!
//! The twins are plain f32 implementations written here, saving what a framework saves:
//!
//! | case (lpmm)                  | saves (B/element)   | twin                  | saves (B/element) |
//! |------------------------------|---------------------|-----------------------|-------------------|
//! | `gelu_fewbit2`               | 0.25 (2-bit code)   | `gelu_f32`            | 4 (x)             |
//! | `gelu_from_output`           | 0.125 (branch bit)  | `gelu_f32`            | 4 (x)             |
//! | `layernorm_from_output`      | 4/cols (rstd)       | `layernorm_f32`       | 4 + 4/cols (x̂, rstd) |
//! | `softmax_dropout_1bit`       | 4.125 (s, 1-bit mask) | `softmax_dropout_f32` | 5 (s, bool mask) |
//! | `compress_{2,4,8}bit`        | b/8 + 4/256 (codes, block absmax) | `compress_f32` | 4 (copy) |
//!
//! Beside the output each layer produces anyway (GELU's and LayerNorm's output is the next
//! layer's input, which that layer keeps). bench.json's schema has no field for saved bytes: the
//! sidecar's `bytes_per_param` is the traffic of one iteration counted from the formats (each
//! byte read once and each byte written once; random words and per-row scratch not counted), and
//! the saved bytes, measured from the saved objects, are printed to stderr when the bench starts.
//! The twins are `peer` cases without a preset (so that xtask does not read them as optimizer
//! peers).
//!
//! Notes on the comparison: few-bit GELU's forward computes the output with the twin's f32 GELU
//! (`Table::encode` only encodes); lpmm-act's GELU, LayerNorm and softmax compute in f64 where the
//! twins compute in f32; `Compressed` quantizes and dequantizes on rayon (all threads) while
//! every other case, twins included, runs on one thread; `compress_f32` is one copy (its backward
//! reads the saved tensor as it is).

use criterion::{
    BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group,
    criterion_main, measurement::WallTime,
};
use lpmm_act::{
    Activation, BitMask, Compressed, Grid, Table, Weight, gelu_backward_from_output, gelu_forward,
    layernorm_backward_from_output, layernorm_forward, softmax_dropout_backward,
    softmax_dropout_forward,
};
use lpmm_benches::{CaseInfo, Kind, M, data, describe, label, quick};
use lpmm_quant::{BlockSize, RandomStream};
use std::f32::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};
use std::hint::black_box;
use std::time::Duration;

/// Elements per case.
fn size() -> usize {
    if quick() { M / 4 } else { M }
}

/// Row length of LayerNorm and softmax (a hidden size / an attention row).
const COLS: usize = 1024;
/// Dropout probability.
const P: f32 = 0.1;
/// LayerNorm's epsilon.
const EPS: f32 = 1e-5;
/// Block of `Compressed`.
const BLOCK: BlockSize = BlockSize::B256;

// ---- twins: plain f32 ----

/// 1 / sqrt(2π).
const INV_SQRT_2PI: f32 = 0.5 * FRAC_2_SQRT_PI * FRAC_1_SQRT_2;

/// Exact GELU, `x Φ(x)` with erf, in f32.
fn gelu_f32(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| 0.5 * v * (1.0 + libm::erff(v * FRAC_1_SQRT_2)))
        .collect()
}

/// GELU forward saving its input: `(y, x)`.
fn gelu_f32_forward(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    (gelu_f32(x), x.to_vec())
}

/// GELU backward from the saved input: `dy (Φ(x) + x φ(x))`.
fn gelu_f32_backward(dy: &[f32], x: &[f32]) -> Vec<f32> {
    dy.iter()
        .zip(x)
        .map(|(&g, &v)| {
            let cdf = 0.5 * (1.0 + libm::erff(v * FRAC_1_SQRT_2));
            let pdf = (-0.5 * v * v).exp() * INV_SQRT_2PI;
            g * (cdf + v * pdf)
        })
        .collect()
}

/// What the f32 LayerNorm saves: x̂ and one rstd per row.
struct LayerNormF32Saved {
    xhat: Vec<f32>,
    rstd: Vec<f32>,
}

/// LayerNorm over rows of `cols`: `y = x̂ γ + β`, saving x̂ and rstd.
fn layernorm_f32_forward(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    cols: usize,
) -> (Vec<f32>, LayerNormF32Saved) {
    let mut y = vec![0f32; x.len()];
    let mut xhat = vec![0f32; x.len()];
    let mut rstd = Vec::with_capacity(x.len() / cols);
    for ((xr, yr), hr) in x
        .chunks_exact(cols)
        .zip(y.chunks_exact_mut(cols))
        .zip(xhat.chunks_exact_mut(cols))
    {
        let mean = xr.iter().sum::<f32>() / cols as f32;
        let var = xr.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / cols as f32;
        let rs = 1.0 / (var + EPS).sqrt();
        rstd.push(rs);
        for ((((o, h), &v), &g), &b) in yr.iter_mut().zip(hr).zip(xr).zip(gamma).zip(beta) {
            *h = (v - mean) * rs;
            *o = *h * g + b;
        }
    }
    (y, LayerNormF32Saved { xhat, rstd })
}

/// LayerNorm backward from x̂ and rstd: `(dx, dγ, dβ)`.
fn layernorm_f32_backward(
    dy: &[f32],
    saved: &LayerNormF32Saved,
    gamma: &[f32],
    cols: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dx = vec![0f32; dy.len()];
    let mut dgamma = vec![0f32; cols];
    let mut dbeta = vec![0f32; cols];
    for (((gr, hr), dr), &rs) in dy
        .chunks_exact(cols)
        .zip(saved.xhat.chunks_exact(cols))
        .zip(dx.chunks_exact_mut(cols))
        .zip(&saved.rstd)
    {
        let (mut m1, mut m2) = (0f32, 0f32);
        for ((((&d, &h), &g), dg), db) in gr
            .iter()
            .zip(hr)
            .zip(gamma)
            .zip(&mut dgamma)
            .zip(&mut dbeta)
        {
            let dxh = d * g;
            m1 += dxh;
            m2 += dxh * h;
            *dg += d * h;
            *db += d;
        }
        m1 /= cols as f32;
        m2 /= cols as f32;
        for (((o, &d), &h), &g) in dr.iter_mut().zip(gr).zip(hr).zip(gamma) {
            *o = rs * (d * g - m1 - h * m2);
        }
    }
    (dx, dgamma, dbeta)
}

/// softmax over rows of `cols`, then dropout with probability `P` drawn like lpmm-act's (keep
/// iff the element's random word is at or above `P · 2^32`): `(out, s, keep)`.
fn softmax_dropout_f32_forward(
    x: &[f32],
    cols: usize,
    stream: &RandomStream,
) -> (Vec<f32>, Vec<f32>, Vec<bool>) {
    let mut s = vec![0f32; x.len()];
    for (xr, sr) in x.chunks_exact(cols).zip(s.chunks_exact_mut(cols)) {
        let max = xr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (o, &v) in sr.iter_mut().zip(xr) {
            *o = (v - max).exp();
            sum += *o;
        }
        let inv = 1.0 / sum;
        sr.iter_mut().for_each(|o| *o *= inv);
    }
    let cut = (f64::from(P) * 4_294_967_296.0) as u64;
    let mut words = vec![0u32; x.len()];
    stream.fill(0, &mut words);
    let keep: Vec<bool> = words.iter().map(|&w| u64::from(w) >= cut).collect();
    let scale = 1.0 / (1.0 - P);
    let out = s
        .iter()
        .zip(&keep)
        .map(|(&v, &k)| if k { v * scale } else { 0.0 })
        .collect();
    (out, s, keep)
}

/// softmax·dropout backward from the softmax and the mask: `dx = s ⊙ (ds - Σ_row ds ⊙ s)`.
fn softmax_dropout_f32_backward(dy: &[f32], s: &[f32], keep: &[bool], cols: usize) -> Vec<f32> {
    let scale = 1.0 / (1.0 - P);
    let mut dx = vec![0f32; dy.len()];
    for (((gr, sr), kr), dr) in dy
        .chunks_exact(cols)
        .zip(s.chunks_exact(cols))
        .zip(keep.chunks_exact(cols))
        .zip(dx.chunks_exact_mut(cols))
    {
        // ds first (into dx), then the row's dot product, then dx in place.
        let mut dot = 0f32;
        for (((o, &g), &v), &k) in dr.iter_mut().zip(gr).zip(sr).zip(kr) {
            *o = if k { g * scale } else { 0.0 };
            dot += *o * v;
        }
        for (o, &v) in dr.iter_mut().zip(sr) {
            *o = v * (*o - dot);
        }
    }
    dx
}

// ---- cases ----

/// The sidecar of `act/<name>/<size>`.
fn sidecar(name: &str, n: usize, bytes_per_param: f64, kind: Kind) {
    describe(&CaseInfo {
        id: &format!("act/{name}/{}", label(n)),
        params: n,
        bytes_per_param,
        kind,
        ceiling: None,
        preset: None,
    });
}

/// `max |a - b| / max |b|`.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

fn configure(group: &mut BenchmarkGroup<'_, WallTime>, n: usize) {
    group.sample_size(10);
    group.sampling_mode(SamplingMode::Flat);
    let (warm_up, measurement) =
        lpmm_benches::times((Duration::from_millis(500), Duration::from_secs(3)));
    group.warm_up_time(warm_up);
    group.measurement_time(measurement);
    group.throughput(Throughput::Elements(n as u64));
}

fn gelu(group: &mut BenchmarkGroup<'_, WallTime>, n: usize, x: &[f32], dy: &[f32]) {
    let table = Table::solve(Activation::Gelu, 2, Weight::STANDARD, Grid::default())
        .expect("2-bit GELU table");
    // Check the twin against lpmm-act's exact backward, and report what each saves.
    let (y, mask) = gelu_forward(x);
    let (_, saved_x) = gelu_f32_forward(x);
    let err = rel_err(
        &gelu_f32_backward(dy, &saved_x),
        &gelu_backward_from_output(dy, &y, &mask).expect("lengths"),
    );
    assert!(
        err < 1e-3,
        "the f32 GELU twin disagrees with lpmm-act: {err}"
    );
    let codes = table.encode(x);
    eprintln!(
        "act saved B/element: gelu_f32 {:.3}, gelu_fewbit2 {:.3}, gelu_from_output {:.3} (+ y)",
        4.0 * saved_x.len() as f64 / n as f64,
        codes.len() as f64 / n as f64,
        mask.bytes() as f64 / n as f64,
    );

    // Twin: reads x, writes y and the copy of x; reads dy and x, writes dx.
    sidecar("gelu_f32", n, 24.0, Kind::Peer);
    group.bench_function(BenchmarkId::new("gelu_f32", label(n)), |b| {
        b.iter(|| {
            let (y, saved) = gelu_f32_forward(black_box(x));
            let dx = gelu_f32_backward(black_box(dy), &saved);
            (y, dx)
        })
    });
    // Reads x, writes y and the 2-bit codes; reads dy and the codes, writes dx.
    sidecar("gelu_fewbit2", n, 16.0 + 2.0 * 0.25, Kind::Lpmm);
    group.bench_function(BenchmarkId::new("gelu_fewbit2", label(n)), |b| {
        b.iter(|| {
            let y = gelu_f32(black_box(x));
            let codes = table.encode(black_box(x));
            let dx = table.backward(black_box(dy), &codes).expect("lengths");
            (y, dx)
        })
    });
    // Reads x, writes y and the mask; reads dy, y and the mask, writes dx.
    sidecar("gelu_from_output", n, 20.0 + 2.0 / 8.0, Kind::Lpmm);
    group.bench_function(BenchmarkId::new("gelu_from_output", label(n)), |b| {
        b.iter(|| {
            let (y, mask) = gelu_forward(black_box(x));
            let dx = gelu_backward_from_output(black_box(dy), &y, &mask).expect("lengths");
            (y, dx)
        })
    });
}

fn layernorm(group: &mut BenchmarkGroup<'_, WallTime>, n: usize, x: &[f32], dy: &[f32]) {
    let (rows, cols) = (n / COLS, COLS);
    // |γ| in [0.8, 1.2]: no column falls back to saving x̂.
    let gamma: Vec<f32> = data(cols, 0.1).iter().map(|v| 1.0 + v).collect();
    let beta = data(cols, 0.05);
    let (y, saved) = layernorm_forward(x, &gamma, &beta, rows, cols, EPS).expect("shapes");
    assert!(saved.fallback_columns().is_empty());
    let (_, twin_saved) = layernorm_f32_forward(x, &gamma, &beta, cols);
    let (dx, _, _) = layernorm_backward_from_output(dy, &y, &saved, &gamma, &beta).expect("shapes");
    let err = rel_err(
        &layernorm_f32_backward(dy, &twin_saved, &gamma, cols).0,
        &dx,
    );
    assert!(
        err < 1e-3,
        "the f32 LayerNorm twin disagrees with lpmm-act: {err}"
    );
    eprintln!(
        "act saved B/element: layernorm_f32 {:.3}, layernorm_from_output {:.3} (+ y)",
        4.0 * (twin_saved.xhat.len() + twin_saved.rstd.len()) as f64 / n as f64,
        saved.bytes() as f64 / n as f64,
    );

    // Per element: the rstd written and read (8 / cols); per column: γ and β read by the
    // forward, γ (and, from the output, β) read and dγ, dβ written by the backward.
    let (per_row, per_col) = (8.0 / cols as f64, 4.0 / rows as f64);
    // Twin: reads x, writes y and x̂; reads dy and x̂, writes dx.
    sidecar(
        "layernorm_f32",
        n,
        24.0 + per_row + 5.0 * per_col,
        Kind::Peer,
    );
    group.bench_function(BenchmarkId::new("layernorm_f32", label(n)), |b| {
        b.iter(|| {
            let (y, saved) = layernorm_f32_forward(black_box(x), &gamma, &beta, cols);
            let grads = layernorm_f32_backward(black_box(dy), &saved, &gamma, cols);
            (y, grads)
        })
    });
    // Reads x, writes y; reads dy and y, writes dx.
    sidecar(
        "layernorm_from_output",
        n,
        20.0 + per_row + 6.0 * per_col,
        Kind::Lpmm,
    );
    group.bench_function(BenchmarkId::new("layernorm_from_output", label(n)), |b| {
        b.iter(|| {
            let (y, saved) =
                layernorm_forward(black_box(x), &gamma, &beta, rows, cols, EPS).expect("shapes");
            let grads = layernorm_backward_from_output(black_box(dy), &y, &saved, &gamma, &beta)
                .expect("shapes");
            (y, grads)
        })
    });
}

fn softmax_dropout(group: &mut BenchmarkGroup<'_, WallTime>, n: usize, x: &[f32], dy: &[f32]) {
    let (rows, cols) = (n / COLS, COLS);
    let stream = RandomStream::new(1, 2, 3);
    // Same stream, same mask: the twin's gradient must match lpmm-act's.
    let (_, s, mask) = softmax_dropout_forward(x, rows, cols, P, &stream).expect("shapes");
    let (_, twin_s, keep) = softmax_dropout_f32_forward(x, cols, &stream);
    assert!(keep.iter().enumerate().all(|(i, &k)| k == mask.get(i)));
    let dx = softmax_dropout_backward(dy, &s, &mask, rows, cols, P).expect("shapes");
    let err = rel_err(&softmax_dropout_f32_backward(dy, &twin_s, &keep, cols), &dx);
    assert!(
        err < 1e-3,
        "the f32 softmax·dropout twin disagrees with lpmm-act: {err}"
    );
    eprintln!(
        "act saved B/element: softmax_dropout_f32 {:.3}, softmax_dropout_1bit {:.3}",
        (4 * twin_s.len() + keep.len()) as f64 / n as f64,
        (4 * s.len() + mask.bytes()) as f64 / n as f64,
    );

    // Twin: reads x, writes out, s and the bool mask; reads dy, s and the mask, writes dx.
    sidecar("softmax_dropout_f32", n, 4.0 * 6.0 + 2.0, Kind::Peer);
    group.bench_function(BenchmarkId::new("softmax_dropout_f32", label(n)), |b| {
        b.iter(|| {
            let (out, s, keep) = softmax_dropout_f32_forward(black_box(x), cols, &stream);
            let dx = softmax_dropout_f32_backward(black_box(dy), &s, &keep, cols);
            (out, dx)
        })
    });
    // Reads x, writes out, s and the 1-bit mask; reads dy, s and the mask, writes dx.
    sidecar("softmax_dropout_1bit", n, 4.0 * 6.0 + 2.0 / 8.0, Kind::Lpmm);
    group.bench_function(BenchmarkId::new("softmax_dropout_1bit", label(n)), |b| {
        b.iter(|| {
            let (out, s, mask): (Vec<f32>, Vec<f32>, BitMask) =
                softmax_dropout_forward(black_box(x), rows, cols, P, &stream).expect("shapes");
            let dx =
                softmax_dropout_backward(black_box(dy), &s, &mask, rows, cols, P).expect("shapes");
            (out, dx)
        })
    });
}

fn compress(group: &mut BenchmarkGroup<'_, WallTime>, n: usize, x: &[f32]) {
    let stream = RandomStream::new(4, 5, 6);
    let saved: Vec<String> = [2u32, 4, 8]
        .iter()
        .map(|&bits| {
            let c = Compressed::new(x, bits, BLOCK, stream).expect("finite input");
            format!("compress_{bits}bit {:.3}", c.bytes() as f64 / n as f64)
        })
        .collect();
    eprintln!(
        "act saved B/element: compress_f32 4.000, {}",
        saved.join(", ")
    );

    // Twin: one copy (reads x, writes the copy); the backward reads the saved tensor as it is.
    sidecar("compress_f32", n, 8.0, Kind::Peer);
    group.bench_function(BenchmarkId::new("compress_f32", label(n)), |b| {
        b.iter(|| black_box(x).to_vec())
    });
    for bits in [2u32, 4, 8] {
        // Reads x, writes codes and scales; reads them, writes the f32 tensor.
        let name = format!("compress_{bits}bit");
        let stored = f64::from(bits) / 8.0 + 4.0 / BLOCK.get() as f64;
        sidecar(&name, n, 8.0 + 2.0 * stored, Kind::Lpmm);
        group.bench_function(BenchmarkId::new(&name, label(n)), |b| {
            b.iter(|| {
                Compressed::new(black_box(x), bits, BLOCK, stream)
                    .expect("finite input")
                    .decompress()
            })
        });
    }
}

fn act(c: &mut Criterion) {
    let n = size();
    // Normal-ish with unit variance (a sum of four uniforms has variance 1/3).
    let both = data(2 * n, 3f32.sqrt());
    let (x, dy) = both.split_at(n);
    let mut group = c.benchmark_group("act");
    configure(&mut group, n);
    gelu(&mut group, n, x, dy);
    layernorm(&mut group, n, x, dy);
    softmax_dropout(&mut group, n, x, dy);
    compress(&mut group, n, x);
    group.finish();
}

criterion_group!(benches, act);
criterion_main!(benches);
