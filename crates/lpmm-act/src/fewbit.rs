//! Few-bit activations (Novikov et al. 2022, "Few-Bit Backward"): the forward pass saves a
//! `b`-bit code of the activation's input instead of the input; the backward pass multiplies the
//! incoming gradient by a piecewise-constant approximation of the derivative, one level per code.
//!
//! The boundaries and levels are lpmm's own: [`Table::solve`] finds the piecewise-constant
//! function with `2^b` pieces that minimises the weighted squared error of the derivative on a
//! grid, by dynamic programming over the grid points (exact for the grid), with `O(K·N²·log K)`
//! time and `O(N)` memory (the split point of the middle piece is found from a forward and a
//! backward pass, then each half is solved the same way: Hirschberg's technique).

use lpmm_formats::packing::{pack, packed_len, unpack};

use crate::ActError;

/// An element-wise activation with a smooth derivative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `x Φ(x)` (exact, with erf).
    Gelu,
    /// `x σ(x)`.
    Silu,
    /// `tanh x`.
    Tanh,
    /// `σ(x) = 1 / (1 + e^-x)`.
    Sigmoid,
}

impl Activation {
    /// All four.
    pub const ALL: [Activation; 4] = [
        Activation::Gelu,
        Activation::Silu,
        Activation::Tanh,
        Activation::Sigmoid,
    ];

    /// The activation's name.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::Silu => "silu",
            Activation::Tanh => "tanh",
            Activation::Sigmoid => "sigmoid",
        }
    }

    /// `f(x)`.
    pub fn value(self, x: f64) -> f64 {
        match self {
            Activation::Gelu => x * phi(x),
            Activation::Silu => x * sigmoid(x),
            Activation::Tanh => libm::tanh(x),
            Activation::Sigmoid => sigmoid(x),
        }
    }

    /// `f'(x)`.
    pub fn derivative(self, x: f64) -> f64 {
        match self {
            Activation::Gelu => phi(x) + x * density(x),
            Activation::Silu => {
                let s = sigmoid(x);
                s + x * s * (1.0 - s)
            }
            Activation::Tanh => {
                let t = libm::tanh(x);
                1.0 - t * t
            }
            Activation::Sigmoid => {
                let s = sigmoid(x);
                s * (1.0 - s)
            }
        }
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + libm::exp(-x))
}

/// The standard normal CDF.
pub(crate) fn phi(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// The standard normal density.
pub(crate) fn density(x: f64) -> f64 {
    libm::exp(-0.5 * x * x) / (2.0 * std::f64::consts::PI).sqrt()
}

/// How grid points are weighted in the derivative's error.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Weight {
    /// Every grid point alike.
    Uniform,
    /// The density of N(mean, std²): inputs distributed like pre-activations.
    Gaussian {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
}

impl Weight {
    /// N(0, 1).
    pub const STANDARD: Weight = Weight::Gaussian {
        mean: 0.0,
        std: 1.0,
    };

    fn at(self, x: f64) -> f64 {
        match self {
            Weight::Uniform => 1.0,
            Weight::Gaussian { mean, std } => density((x - mean) / std) / std,
        }
    }
}

/// The grid the solver works on: `points` equally spaced values on `[lo, hi]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grid {
    /// Left end.
    pub lo: f64,
    /// Right end.
    pub hi: f64,
    /// Number of points (at least 2).
    pub points: usize,
}

impl Default for Grid {
    /// 1,024 points on [-8, 8].
    fn default() -> Self {
        Self {
            lo: -8.0,
            hi: 8.0,
            points: 1024,
        }
    }
}

/// A piecewise-constant derivative: `levels[k]` on `[thresholds[k-1], thresholds[k])`
/// (the first piece unbounded below, the last above). The code of `x` is the number of
/// thresholds `<= x`.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Bits per code.
    pub bits: u32,
    /// `2^bits - 1` increasing boundaries.
    pub thresholds: Vec<f32>,
    /// `2^bits` derivative values.
    pub levels: Vec<f32>,
}

/// Prefix sums of w, w·d, w·d² for O(1) segment costs.
struct Prefix {
    w: Vec<f64>,
    wd: Vec<f64>,
    wdd: Vec<f64>,
}

impl Prefix {
    /// The weighted squared error of the best constant on points `i..j`, and that constant.
    fn cost(&self, i: usize, j: usize) -> (f64, f64) {
        let w = self.w[j] - self.w[i];
        let wd = self.wd[j] - self.wd[i];
        let wdd = self.wdd[j] - self.wdd[i];
        if w <= 0.0 {
            return (0.0, 0.0);
        }
        let mean = wd / w;
        ((wdd - wd * mean).max(0.0), mean)
    }
}

impl Table {
    /// The exact ReLU derivative with 1 bit, as PyTorch computes it: 1 where `x > 0`, else 0.
    pub fn relu() -> Self {
        Self::leaky_relu(0.0)
    }

    /// The exact leaky-ReLU derivative with 1 bit: 1 where `x > 0`, else `slope`.
    pub fn leaky_relu(slope: f32) -> Self {
        Table {
            bits: 1,
            // The smallest positive f32: `x >= it` exactly when `x > 0`.
            thresholds: vec![f32::from_bits(1)],
            levels: vec![slope, 1.0],
        }
    }

    /// The `2^bits`-piece approximation of `act`'s derivative with the least `weight`-weighted
    /// squared error over `grid` (1 to 8 bits).
    pub fn solve(act: Activation, bits: u32, weight: Weight, grid: Grid) -> Result<Self, ActError> {
        if !(1..=8).contains(&bits) {
            return Err(ActError::Bits(bits));
        }
        let k = 1usize << bits;
        if grid.points < k || grid.lo >= grid.hi || !grid.lo.is_finite() || !grid.hi.is_finite() {
            return Err(ActError::Grid(format!(
                "{} points on [{}, {}] for {k} pieces",
                grid.points, grid.lo, grid.hi
            )));
        }
        let n = grid.points;
        let x: Vec<f64> = (0..n)
            .map(|i| grid.lo + (grid.hi - grid.lo) * i as f64 / (n - 1) as f64)
            .collect();
        let mut p = Prefix {
            w: vec![0.0; n + 1],
            wd: vec![0.0; n + 1],
            wdd: vec![0.0; n + 1],
        };
        for (i, &xi) in x.iter().enumerate() {
            let (w, d) = (weight.at(xi), act.derivative(xi));
            p.w[i + 1] = p.w[i] + w;
            p.wd[i + 1] = p.wd[i] + w * d;
            p.wdd[i + 1] = p.wdd[i] + w * d * d;
        }
        // Segment ends (exclusive) of the optimal split of 0..n into k pieces.
        let mut ends = Vec::with_capacity(k);
        split(&p, 0, n, k, &mut ends);
        let mut thresholds = Vec::with_capacity(k - 1);
        let mut levels = Vec::with_capacity(k);
        let mut start = 0;
        for (s, &end) in ends.iter().enumerate() {
            levels.push(p.cost(start, end).1 as f32);
            if s + 1 < ends.len() {
                // The boundary halfway between the last point of this piece and the next one's
                // first.
                thresholds.push(((x[end - 1] + x[end]) / 2.0) as f32);
            }
            start = end;
        }
        Ok(Table {
            bits,
            thresholds,
            levels,
        })
    }

    /// The code of `x` (NaN: 0).
    pub fn code(&self, x: f32) -> u8 {
        self.thresholds.partition_point(|&t| t <= x) as u8
    }

    /// Forward: the packed codes of `x` (what is saved for the backward pass).
    pub fn encode(&self, x: &[f32]) -> Vec<u8> {
        let codes: Vec<u8> = x.iter().map(|&v| self.code(v)).collect();
        let mut out = vec![0u8; packed_len(x.len(), self.bits)];
        // `bits` is 1..=8 and the codes are below 2^bits: packing cannot fail.
        pack(&codes, self.bits, &mut out).expect("codes fit their width");
        out
    }

    /// Backward: `dx = dy * levels[code]` for the `dy.len()` elements whose codes are `packed`.
    pub fn backward(&self, dy: &[f32], packed: &[u8]) -> Result<Vec<f32>, ActError> {
        if packed.len() != packed_len(dy.len(), self.bits) {
            return Err(ActError::Length {
                what: "packed codes",
                expected: packed_len(dy.len(), self.bits),
                actual: packed.len(),
            });
        }
        let mut codes = vec![0u8; dy.len()];
        unpack(packed, self.bits, &mut codes).map_err(|e| ActError::Grid(e.to_string()))?;
        Ok(dy
            .iter()
            .zip(&codes)
            .map(|(&g, &c)| g * self.levels[usize::from(c).min(self.levels.len() - 1)])
            .collect())
    }

    /// The `weight`-weighted RMS error of this table against `act`'s derivative, by quadrature on
    /// `[grid.lo, grid.hi]` with `samples` points.
    pub fn rms_error(&self, act: Activation, weight: Weight, grid: Grid, samples: usize) -> f64 {
        let (mut num, mut den) = (0.0, 0.0);
        for i in 0..samples {
            let x = grid.lo + (grid.hi - grid.lo) * (i as f64 + 0.5) / samples as f64;
            let w = weight.at(x);
            let approx = f64::from(self.levels[usize::from(self.code(x as f32))]);
            let e = approx - act.derivative(x);
            num += w * e * e;
            den += w;
        }
        (num / den).sqrt()
    }
}

/// The optimal split of points `lo..hi` into `k` pieces, appended to `ends` (exclusive ends).
fn split(p: &Prefix, lo: usize, hi: usize, k: usize, ends: &mut Vec<usize>) {
    if k == 1 || hi - lo <= 1 {
        ends.push(hi);
        return;
    }
    let m = k / 2;
    let f = forward(p, lo, hi, m);
    let g = backward(p, lo, hi, k - m);
    // Split point j: m pieces on lo..j, k - m on j..hi; each piece needs a point.
    let (mut best, mut at) = (f64::INFINITY, lo + m);
    for j in lo + m..=hi - (k - m) {
        let c = f[j - lo] + g[j - lo];
        if c < best {
            best = c;
            at = j;
        }
    }
    split(p, lo, at, m, ends);
    split(p, at, hi, k - m, ends);
}

/// `out[j - lo]`: the least cost of `m` pieces on `lo..j` (infinite where impossible).
// Index loops: `row`, `next` and the prefix sums are addressed by the same point index.
#[allow(clippy::needless_range_loop)]
fn forward(p: &Prefix, lo: usize, hi: usize, m: usize) -> Vec<f64> {
    let n = hi - lo;
    let mut row: Vec<f64> = (0..=n)
        .map(|j| {
            if j == 0 {
                f64::INFINITY
            } else {
                p.cost(lo, lo + j).0
            }
        })
        .collect();
    for pieces in 2..=m {
        let mut next = vec![f64::INFINITY; n + 1];
        for j in pieces..=n {
            let mut best = f64::INFINITY;
            for i in pieces - 1..j {
                let c = row[i] + p.cost(lo + i, lo + j).0;
                if c < best {
                    best = c;
                }
            }
            next[j] = best;
        }
        row = next;
    }
    row
}

/// `out[j - lo]`: the least cost of `m` pieces on `j..hi` (infinite where impossible).
#[allow(clippy::needless_range_loop)]
fn backward(p: &Prefix, lo: usize, hi: usize, m: usize) -> Vec<f64> {
    let n = hi - lo;
    let mut row: Vec<f64> = (0..=n)
        .map(|j| {
            if j == n {
                f64::INFINITY
            } else {
                p.cost(lo + j, hi).0
            }
        })
        .collect();
    for pieces in 2..=m {
        let mut next = vec![f64::INFINITY; n + 1];
        for j in 0..=n.saturating_sub(pieces) {
            let mut best = f64::INFINITY;
            for i in j + 1..=n - (pieces - 1) {
                let c = p.cost(lo + j, lo + i).0 + row[i];
                if c < best {
                    best = c;
                }
            }
            next[j] = best;
        }
        row = next;
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cost of a split, for comparing with brute force.
    fn total(p: &Prefix, ends: &[usize]) -> f64 {
        let mut start = 0;
        ends.iter()
            .map(|&e| {
                let c = p.cost(start, e).0;
                start = e;
                c
            })
            .sum()
    }

    #[test]
    fn the_split_is_optimal_against_brute_force() {
        // 12 points, 4 pieces: every placement of 3 cuts.
        let d = [0.0, 0.1, 0.5, 0.4, 0.9, 1.0, 1.1, 0.7, 0.2, 0.3, 0.3, 1.4];
        let w = [1.0, 2.0, 1.0, 0.5, 1.0, 3.0, 1.0, 1.0, 0.2, 1.0, 1.0, 1.0];
        let mut p = Prefix {
            w: vec![0.0; 13],
            wd: vec![0.0; 13],
            wdd: vec![0.0; 13],
        };
        for i in 0..12 {
            p.w[i + 1] = p.w[i] + w[i];
            p.wd[i + 1] = p.wd[i] + w[i] * d[i];
            p.wdd[i + 1] = p.wdd[i] + w[i] * d[i] * d[i];
        }
        let mut ends = Vec::new();
        split(&p, 0, 12, 4, &mut ends);
        let got = total(&p, &ends);
        let mut best = f64::INFINITY;
        for a in 1..12 {
            for b in a + 1..12 {
                for c in b + 1..12 {
                    best = best.min(total(&p, &[a, b, c, 12]));
                }
            }
        }
        assert!((got - best).abs() < 1e-12, "{got} vs brute force {best}");
        assert_eq!(ends.len(), 4);
    }

    #[test]
    fn more_bits_never_fit_worse_and_relu_is_exact() {
        for act in Activation::ALL {
            let mut last = f64::INFINITY;
            for bits in 1..=4 {
                let t = Table::solve(act, bits, Weight::STANDARD, Grid::default()).unwrap();
                assert_eq!(t.levels.len(), 1 << bits);
                assert!(t.thresholds.windows(2).all(|w| w[0] < w[1]));
                let e = t.rms_error(act, Weight::STANDARD, Grid::default(), 20_000);
                assert!(e <= last + 1e-9, "{act:?} {bits} bits: {e} > {last}");
                last = e;
            }
        }
        let relu = Table::relu();
        let x = [-3.0f32, -0.0, 0.0, 1e-30, 2.0, -1e-30];
        let dx = relu.backward(&[1.0; 6], &relu.encode(&x)).unwrap();
        assert_eq!(dx, vec![0.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(Table::solve(Activation::Gelu, 0, Weight::Uniform, Grid::default()).is_err());
        assert!(Table::solve(Activation::Gelu, 9, Weight::Uniform, Grid::default()).is_err());
        let tiny = Grid {
            lo: 0.0,
            hi: 1.0,
            points: 3,
        };
        assert!(Table::solve(Activation::Gelu, 2, Weight::Uniform, tiny).is_err());
        let t = Table::relu();
        assert!(t.backward(&[1.0; 9], &[0u8]).is_err());
    }
}
