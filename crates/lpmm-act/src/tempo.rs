//! Backward passes from the *output* (Andoorveedu et al. 2022, "Tempo"): the next layer saves an
//! operator's output anyway, so saving its input too doubles the memory for nothing.
//!
//! - GELU: the output and a 1-bit branch mask (GELU is not monotone: below its minimum at
//!   x ≈ -0.7518 each output has two preimages); the input is recovered exactly by a safeguarded
//!   Newton iteration within the branch, in f64.
//! - LayerNorm: the output `y` and one reciprocal standard deviation per row; `x̂ = (y - β) / γ`.
//!   Where `|γ_j|` is below a guard the division would lose `x̂`, so those columns' `x̂` are saved
//!   instead (exact, at 4 bytes per element of those columns).
//! - softmax·dropout: the softmax output and a 1-bit keep mask; the dropout output is recomputed
//!   from them when needed and never saved.

use lpmm_quant::RandomStream;

use crate::ActError;
use crate::fewbit::{Activation, density, phi};

/// A packed bit per element (bit `i % 8` of byte `i / 8`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitMask {
    len: usize,
    bytes: Vec<u8>,
}

impl BitMask {
    /// `len` zero bits.
    pub fn zeros(len: usize) -> Self {
        Self {
            len,
            bytes: vec![0; len.div_ceil(8)],
        }
    }

    /// Bit `i`.
    pub fn get(&self, i: usize) -> bool {
        self.bytes[i / 8] >> (i % 8) & 1 == 1
    }

    /// Sets bit `i`.
    pub fn set(&mut self, i: usize, v: bool) {
        if v {
            self.bytes[i / 8] |= 1 << (i % 8);
        } else {
            self.bytes[i / 8] &= !(1 << (i % 8));
        }
    }

    /// Number of bits.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }
}

/// Where GELU has its minimum: the root of `Φ(x) + x φ(x) = 0`.
pub const GELU_ARGMIN: f64 = -0.751_791_524_693_564_5;

fn check(what: &'static str, expected: usize, actual: usize) -> Result<(), ActError> {
    if expected == actual {
        Ok(())
    } else {
        Err(ActError::Length {
            what,
            expected,
            actual,
        })
    }
}

/// GELU forward: the outputs and the branch mask (set where `x >= GELU_ARGMIN`).
pub fn gelu_forward(x: &[f32]) -> (Vec<f32>, BitMask) {
    let mut mask = BitMask::zeros(x.len());
    let y = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            mask.set(i, f64::from(v) >= GELU_ARGMIN);
            Activation::Gelu.value(f64::from(v)) as f32
        })
        .collect();
    (y, mask)
}

/// The input of GELU on the branch `right` (`x >= GELU_ARGMIN`) whose output is `y` (f64):
/// bracketed Newton (bisection where a Newton step leaves the bracket). Outputs below the
/// minimum (rounding) give the argmin.
pub fn gelu_invert(y: f64, right: bool) -> f64 {
    let f = |x: f64| x * phi(x) - y;
    let ymin = Activation::Gelu.value(GELU_ARGMIN);
    if y <= ymin {
        return GELU_ARGMIN;
    }
    // A bracket [a, b] with f(a) <= 0 <= f(b) on the right branch (increasing), reversed on the
    // left (decreasing).
    let (mut a, mut b) = if right {
        let mut hi = y.max(1.0) + 1.0;
        while f(hi) < 0.0 {
            hi *= 2.0;
        }
        (GELU_ARGMIN, hi)
    } else {
        let mut lo = -1.0f64;
        while f(lo) < 0.0 && lo > -40.0 {
            lo *= 2.0;
        }
        if f(lo) < 0.0 {
            // y is so close to 0 that no f64 input below -40 reaches it: GELU(x) < 1e-300.
            return lo;
        }
        (lo, GELU_ARGMIN)
    };
    let mut x = if right {
        y.max(0.0) + 0.5
    } else {
        (a + b) / 2.0
    };
    for _ in 0..200 {
        let fx = f(x);
        if fx == 0.0 {
            return x;
        }
        // Keep the bracket: on the right branch f increases, on the left it decreases.
        if (fx > 0.0) == right {
            b = x;
        } else {
            a = x;
        }
        let d = phi(x) + x * density(x);
        let newton = x - fx / d;
        let next = if newton.is_finite() && newton > a.min(b) && newton < a.max(b) {
            newton
        } else {
            (a + b) / 2.0
        };
        if (next - x).abs() <= 1e-15 * x.abs().max(1e-300) {
            return next;
        }
        x = next;
    }
    x
}

/// GELU backward from the output: `dx = dy * GELU'(x)` with `x` recovered from `y` and the mask.
pub fn gelu_backward_from_output(
    dy: &[f32],
    y: &[f32],
    mask: &BitMask,
) -> Result<Vec<f32>, ActError> {
    check("outputs", dy.len(), y.len())?;
    check("mask bits", dy.len(), mask.len())?;
    Ok(dy
        .iter()
        .zip(y)
        .enumerate()
        .map(|(i, (&g, &v))| {
            let x = gelu_invert(f64::from(v), mask.get(i));
            (f64::from(g) * Activation::Gelu.derivative(x)) as f32
        })
        .collect())
}

/// What LayerNorm's backward keeps besides its output.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerNormSaved {
    rows: usize,
    cols: usize,
    /// 1 / sqrt(var + eps) per row.
    rstd: Vec<f32>,
    /// Columns whose `|γ|` is below the guard, with their `x̂` (row-major over those columns).
    fallback: Vec<usize>,
    xhat: Vec<f32>,
}

impl LayerNormSaved {
    /// Bytes held (beside the output, which the next layer keeps).
    pub fn bytes(&self) -> usize {
        4 * (self.rstd.len() + self.xhat.len()) + 8 * self.fallback.len()
    }

    /// The columns whose `x̂` had to be saved.
    pub fn fallback_columns(&self) -> &[usize] {
        &self.fallback
    }
}

/// `|γ|` below this saves `x̂` for the column instead of recovering it from the output.
pub const GAMMA_GUARD: f32 = 1e-3;

/// LayerNorm over the last dimension of a `rows x cols` input: `y = x̂ γ + β`.
pub fn layernorm_forward(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<(Vec<f32>, LayerNormSaved), ActError> {
    check("input", rows * cols, x.len())?;
    check("gamma", cols, gamma.len())?;
    check("beta", cols, beta.len())?;
    let fallback: Vec<usize> = (0..cols)
        .filter(|&j| gamma[j].abs() < GAMMA_GUARD)
        .collect();
    let mut y = vec![0f32; x.len()];
    let mut rstd = Vec::with_capacity(rows);
    let mut xhat_saved = Vec::with_capacity(rows * fallback.len());
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / cols as f64;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / cols as f64;
        let rs = (1.0 / (var + f64::from(eps)).sqrt()) as f32;
        rstd.push(rs);
        for j in 0..cols {
            let xh = ((f64::from(row[j]) - mean) * f64::from(rs)) as f32;
            y[r * cols + j] = xh * gamma[j] + beta[j];
        }
        for &j in &fallback {
            xhat_saved.push(((f64::from(row[j]) - mean) * f64::from(rs)) as f32);
        }
    }
    Ok((
        y,
        LayerNormSaved {
            rows,
            cols,
            rstd,
            fallback,
            xhat: xhat_saved,
        },
    ))
}

/// LayerNorm's gradients: `(dx, dγ, dβ)`.
pub type LayerNormGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// LayerNorm backward from the output: `(dx, dγ, dβ)`.
pub fn layernorm_backward_from_output(
    dy: &[f32],
    y: &[f32],
    saved: &LayerNormSaved,
    gamma: &[f32],
    beta: &[f32],
) -> Result<LayerNormGrads, ActError> {
    let (rows, cols) = (saved.rows, saved.cols);
    check("output gradient", rows * cols, dy.len())?;
    check("output", rows * cols, y.len())?;
    check("gamma", cols, gamma.len())?;
    check("beta", cols, beta.len())?;
    let mut dx = vec![0f32; dy.len()];
    let mut dgamma = vec![0f64; cols];
    let mut dbeta = vec![0f64; cols];
    let nf = saved.fallback.len();
    let mut xhat = vec![0f64; cols];
    for r in 0..rows {
        let base = r * cols;
        let mut f = 0;
        for j in 0..cols {
            xhat[j] = if f < nf && saved.fallback[f] == j {
                f += 1;
                f64::from(saved.xhat[r * nf + f - 1])
            } else {
                (f64::from(y[base + j]) - f64::from(beta[j])) / f64::from(gamma[j])
            };
        }
        let (mut m1, mut m2) = (0.0f64, 0.0f64);
        for j in 0..cols {
            let g = f64::from(dy[base + j]);
            let dxh = g * f64::from(gamma[j]);
            m1 += dxh;
            m2 += dxh * xhat[j];
            dgamma[j] += g * xhat[j];
            dbeta[j] += g;
        }
        m1 /= cols as f64;
        m2 /= cols as f64;
        let rs = f64::from(saved.rstd[r]);
        for j in 0..cols {
            let dxh = f64::from(dy[base + j]) * f64::from(gamma[j]);
            dx[base + j] = (rs * (dxh - m1 - xhat[j] * m2)) as f32;
        }
    }
    Ok((
        dx,
        dgamma.into_iter().map(|v| v as f32).collect(),
        dbeta.into_iter().map(|v| v as f32).collect(),
    ))
}

/// softmax over the last dimension of a `rows x cols` input, then dropout with drop probability
/// `p` (kept values scaled by `1 / (1 - p)`): returns the output, the softmax (what backward
/// keeps) and the keep mask, drawn from `stream` (element `i` keeps iff its random word is at or
/// above `p · 2^32`).
pub fn softmax_dropout_forward(
    x: &[f32],
    rows: usize,
    cols: usize,
    p: f32,
    stream: &RandomStream,
) -> Result<(Vec<f32>, Vec<f32>, BitMask), ActError> {
    check("input", rows * cols, x.len())?;
    if !(0.0..1.0).contains(&p) {
        return Err(ActError::Probability(p));
    }
    let mut s = vec![0f32; x.len()];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for (o, &v) in s[r * cols..(r + 1) * cols].iter_mut().zip(row) {
            let e = (f64::from(v) - f64::from(max)).exp();
            *o = e as f32;
            sum += e;
        }
        for o in &mut s[r * cols..(r + 1) * cols] {
            *o = (f64::from(*o) / sum) as f32;
        }
    }
    let cut = (f64::from(p) * 4_294_967_296.0) as u64;
    let mut words = vec![0u32; x.len()];
    stream.fill(0, &mut words);
    let mut mask = BitMask::zeros(x.len());
    let scale = 1.0 / (1.0 - p);
    let out = s
        .iter()
        .zip(&words)
        .enumerate()
        .map(|(i, (&v, &w))| {
            let keep = u64::from(w) >= cut;
            mask.set(i, keep);
            if keep { v * scale } else { 0.0 }
        })
        .collect();
    Ok((out, s, mask))
}

/// softmax·dropout backward from the softmax output and the keep mask:
/// `ds = dy · mask / (1 - p)`, `dx = s ⊙ (ds - Σ_row ds ⊙ s)`.
pub fn softmax_dropout_backward(
    dy: &[f32],
    s: &[f32],
    mask: &BitMask,
    rows: usize,
    cols: usize,
    p: f32,
) -> Result<Vec<f32>, ActError> {
    check("output gradient", rows * cols, dy.len())?;
    check("softmax", rows * cols, s.len())?;
    check("mask bits", rows * cols, mask.len())?;
    let scale = f64::from(1.0 / (1.0 - p));
    let mut dx = vec![0f32; dy.len()];
    for r in 0..rows {
        let base = r * cols;
        let ds: Vec<f64> = (0..cols)
            .map(|j| {
                if mask.get(base + j) {
                    f64::from(dy[base + j]) * scale
                } else {
                    0.0
                }
            })
            .collect();
        let dot: f64 = (0..cols).map(|j| ds[j] * f64::from(s[base + j])).sum();
        for j in 0..cols {
            dx[base + j] = (f64::from(s[base + j]) * (ds[j] - dot)) as f32;
        }
    }
    Ok(dx)
}
