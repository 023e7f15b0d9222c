//! The operators' CubeCL kernels: f32 values, packed bits in u32 words (bit `i % 32` of word
//! `i / 32`, which is lpmm-act's byte packing read as little-endian words).

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;

/// Packs 32 `bits`-bit codes into words `bits t .. bits t + bits` (bit `i % 32` of word `i / 32`
/// of the code stream).
#[cube]
fn pack32(codes: &Array<u32>, words: &mut [u32], t: usize, #[comptime] bits: u32) {
    let mut acc = 0u32;
    let mut filled = 0u32;
    let mut out = t * (bits as usize);
    for j in 0..32usize {
        let code = codes[j];
        acc |= code << filled;
        let total = filled + bits;
        if total >= 32 {
            words[out] = acc;
            out += 1;
            acc = 0;
            if total > 32 {
                acc = code >> (32 - filled);
            }
            filled = total - 32;
        } else {
            filled = total;
        }
    }
}

/// Few-bit codes: thread `t` packs the `bits`-bit codes of elements `32 t .. 32 t + 32` (the
/// number of `thresholds <= x`; 0 past the end) into words `bits t .. bits t + bits`.
#[cube(launch)]
pub fn few_bit_encode(
    x: &[f32],
    thresholds: &[f32],
    words: &mut [u32],
    n: u32,
    #[comptime] bits: u32,
) {
    let t = ABSOLUTE_POS;
    if t * (bits as usize) < words.len() {
        let mut codes = Array::<u32>::new(32usize);
        for j in 0..32usize {
            let i = t * 32 + j;
            let mut code = 0u32;
            if i < n as usize {
                let v = x[i];
                for k in 0..thresholds.len() {
                    if thresholds[k] <= v {
                        code += 1;
                    }
                }
            }
            codes[j] = code;
        }
        pack32(&codes, words, t, bits);
    }
}

/// The `bits`-bit code of element `i` in `words`.
#[cube]
fn code_at(words: &[u32], i: usize, #[comptime] bits: u32) -> u32 {
    let off = i * (bits as usize);
    let w = off / 32;
    let s = (off % 32) as u32;
    let mut v = words[w] >> s;
    if s + bits > 32 {
        v |= words[w + 1] << (32 - s);
    }
    v & ((1u32 << bits) - 1)
}

/// Few-bit backward: `dx = dy · levels[code]`.
#[cube(launch)]
pub fn few_bit_backward(
    dy: &[f32],
    words: &[u32],
    levels: &[f32],
    dx: &mut [f32],
    #[comptime] bits: u32,
) {
    let i = ABSOLUTE_POS;
    if i < dx.len() {
        let c = code_at(words, i, bits) as usize;
        let last = levels.len() - 1;
        let k = select(c > last, last, c);
        dx[i] = dy[i] * levels[k];
    }
}

/// Bit `i` of `words`.
#[cube]
fn bit_at(words: &[u32], i: usize) -> bool {
    (words[i / 32] >> ((i % 32) as u32)) & 1u32 == 1u32
}

/// The standard normal CDF in f32.
#[cube]
fn normal_cdf(x: f32) -> f32 {
    0.5f32 * (1.0f32 + Erf::erf(x * 0.707_106_77f32))
}

/// The standard normal density in f32.
#[cube]
fn normal_pdf(x: f32) -> f32 {
    f32::exp(-0.5f32 * x * x) * 0.398_942_3f32
}

/// GELU forward: thread `t` computes `y = x Φ(x)` for elements `32 t .. 32 t + 32` and their
/// branch bits (`x >= argmin`, `argmin` the smallest f32 at or above GELU's minimum).
#[cube(launch)]
pub fn gelu_forward(x: &[f32], y: &mut [f32], mask: &mut [u32], argmin: f32) {
    let t = ABSOLUTE_POS;
    if t < mask.len() {
        let mut word = 0u32;
        for j in 0..32u32 {
            let i = t * 32 + j as usize;
            if i < y.len() {
                let v = x[i];
                y[i] = v * normal_cdf(v);
                if v >= argmin {
                    word |= 1u32 << j;
                }
            }
        }
        mask[t] = word;
    }
}

/// GELU backward from the output: the input recovered from `y` and its branch bit by a
/// bracketed Newton iteration in f32 (bisection where a step leaves the bracket), then
/// `dx = dy · (Φ(x) + x φ(x))`.
#[cube(launch)]
pub fn gelu_backward(dy: &[f32], y: &[f32], mask: &[u32], dx: &mut [f32], argmin: f32, ymin: f32) {
    let i = ABSOLUTE_POS;
    if i < dx.len() {
        let target = y[i];
        let right = bit_at(mask, i);
        let mut x = argmin;
        if target > ymin {
            // [a, b] with f(a) <= 0 <= f(b) on the right branch (f increasing), f(a) >= 0 >= f(b)
            // on the left (f decreasing), f(x) = x Φ(x) - y.
            let mut a = argmin;
            let mut b = argmin;
            if right {
                b = f32::max(target, 0.0f32) + 3.0f32;
                x = f32::max(target, 0.0f32) + 0.5f32;
                if x >= b {
                    x = 0.5f32 * (a + b);
                }
            } else {
                a = -16.0f32;
                x = 0.5f32 * (a + b);
            }
            for _ in 0..40u32 {
                let f = x * normal_cdf(x) - target;
                let up = (f > 0.0f32) == right;
                if up {
                    b = x;
                } else {
                    a = x;
                }
                let d = normal_cdf(x) + x * normal_pdf(x);
                let newton = x - f / d;
                let lo = f32::min(a, b);
                let hi = f32::max(a, b);
                let inside = newton > lo && newton < hi;
                x = select(inside, newton, 0.5f32 * (a + b));
            }
        }
        dx[i] = dy[i] * (normal_cdf(x) + x * normal_pdf(x));
    }
}

/// LayerNorm forward, one thread per row: `y = (x - mean) · rstd · γ + β` (two passes in f32),
/// the row's rstd, and `x̂` of the first `cap` columns whose `|γ| < guard` (row-major,
/// `cap` per row).
#[cube(launch)]
pub fn layer_norm_forward(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    y: &mut [f32],
    rstd: &mut [f32],
    xhat: &mut [f32],
    cols: u32,
    eps: f32,
    guard: f32,
    cap: u32,
) {
    let r = ABSOLUTE_POS;
    if r < rstd.len() {
        let c = cols as usize;
        let base = r * c;
        let mut sum = 0.0f32;
        for j in 0..c {
            sum += x[base + j];
        }
        let mean = sum / (cols as f32);
        let mut sq = 0.0f32;
        for j in 0..c {
            let d = x[base + j] - mean;
            sq += d * d;
        }
        let rs = 1.0f32 / f32::sqrt(sq / (cols as f32) + eps);
        rstd[r] = rs;
        let mut slot = 0u32;
        for j in 0..c {
            let xh = (x[base + j] - mean) * rs;
            y[base + j] = xh * gamma[j] + beta[j];
            if f32::abs(gamma[j]) < guard {
                if slot < cap {
                    xhat[r * (cap as usize) + slot as usize] = xh;
                }
                slot += 1;
            }
        }
    }
}

/// `x̂` of element `(r, j)`: `(y - β) / γ`, or the saved value for a guarded column (`slot` its
/// rank among the guarded columns; `nan` past `cap`, which the forward pass could not save: a
/// kernel argument, as WGSL has no NaN literal).
#[cube]
#[allow(clippy::too_many_arguments)]
fn xhat_at(
    y: &[f32],
    gamma: &[f32],
    beta: &[f32],
    xhat: &[f32],
    r: usize,
    j: usize,
    cols: usize,
    slot: u32,
    guard: f32,
    cap: u32,
    nan: f32,
) -> f32 {
    let mut v = (y[r * cols + j] - beta[j]) / gamma[j];
    if f32::abs(gamma[j]) < guard {
        if slot < cap {
            v = xhat[r * (cap as usize) + slot as usize];
        } else {
            v = nan;
        }
    }
    v
}

/// LayerNorm backward for `dx`, one thread per row: `dx = rstd (dy γ - mean(dy γ) - x̂ mean(dy γ x̂))`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_dx(
    dy: &[f32],
    y: &[f32],
    gamma: &[f32],
    beta: &[f32],
    rstd: &[f32],
    xhat: &[f32],
    dx: &mut [f32],
    cols: u32,
    guard: f32,
    cap: u32,
    nan: f32,
) {
    let r = ABSOLUTE_POS;
    if r < rstd.len() {
        let c = cols as usize;
        let base = r * c;
        let mut m1 = 0.0f32;
        let mut m2 = 0.0f32;
        let mut slot = 0u32;
        for j in 0..c {
            let xh = xhat_at(y, gamma, beta, xhat, r, j, c, slot, guard, cap, nan);
            if f32::abs(gamma[j]) < guard {
                slot += 1;
            }
            let dxh = dy[base + j] * gamma[j];
            m1 += dxh;
            m2 += dxh * xh;
        }
        m1 /= cols as f32;
        m2 /= cols as f32;
        let rs = rstd[r];
        slot = 0u32;
        for j in 0..c {
            let xh = xhat_at(y, gamma, beta, xhat, r, j, c, slot, guard, cap, nan);
            if f32::abs(gamma[j]) < guard {
                slot += 1;
            }
            dx[base + j] = rs * (dy[base + j] * gamma[j] - m1 - xh * m2);
        }
    }
}

/// LayerNorm backward for `dγ` and `dβ`, one thread per column: sums over the rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_params(
    dy: &[f32],
    y: &[f32],
    gamma: &[f32],
    beta: &[f32],
    xhat: &[f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    rows: u32,
    guard: f32,
    cap: u32,
    nan: f32,
) {
    let j = ABSOLUTE_POS;
    let c = gamma.len();
    if j < c {
        // This column's rank among the guarded columns.
        let mut slot = 0u32;
        for k in 0..j {
            if f32::abs(gamma[k]) < guard {
                slot += 1;
            }
        }
        let mut dg = 0.0f32;
        let mut db = 0.0f32;
        for r in 0..rows as usize {
            let g = dy[r * c + j];
            dg += g * xhat_at(y, gamma, beta, xhat, r, j, c, slot, guard, cap, nan);
            db += g;
        }
        dgamma[j] = dg;
        dbeta[j] = db;
    }
}

/// One ChaCha quarter round on `s[a], s[b], s[c], s[d]`.
#[cube]
fn quarter(
    s: &mut Array<u32>,
    #[comptime] a: usize,
    #[comptime] b: usize,
    #[comptime] c: usize,
    #[comptime] d: usize,
) {
    s[a] += s[b];
    let v = s[d] ^ s[a];
    s[d] = (v << 16u32) | (v >> 16u32);
    s[c] += s[d];
    let v = s[b] ^ s[c];
    s[b] = (v << 12u32) | (v >> 20u32);
    s[a] += s[b];
    let v = s[d] ^ s[a];
    s[d] = (v << 8u32) | (v >> 24u32);
    s[c] += s[d];
    let v = s[b] ^ s[c];
    s[b] = (v << 7u32) | (v >> 25u32);
}

/// The 16 words of ChaCha8 block `counter` (high counter word 0) of `key` and stream `nonce`:
/// lpmm-quant's `RandomStream` keystream.
#[cube]
fn chacha8_block(key: &[u32], counter: u32, out: &mut Array<u32>) {
    let mut s = Array::<u32>::new(16usize);
    s[0] = 0x6170_7865u32;
    s[1] = 0x3320_646eu32;
    s[2] = 0x7962_2d32u32;
    s[3] = 0x6b20_6574u32;
    #[unroll]
    for w in 0..8usize {
        s[4 + w] = key[w];
    }
    s[12] = counter;
    s[13] = 0u32;
    s[14] = key[8];
    s[15] = key[9];
    #[unroll]
    for w in 0..16usize {
        out[w] = s[w];
    }
    for _ in 0..4u32 {
        quarter(&mut s, 0usize, 4usize, 8usize, 12usize);
        quarter(&mut s, 1usize, 5usize, 9usize, 13usize);
        quarter(&mut s, 2usize, 6usize, 10usize, 14usize);
        quarter(&mut s, 3usize, 7usize, 11usize, 15usize);
        quarter(&mut s, 0usize, 5usize, 10usize, 15usize);
        quarter(&mut s, 1usize, 6usize, 11usize, 12usize);
        quarter(&mut s, 2usize, 7usize, 8usize, 13usize);
        quarter(&mut s, 3usize, 4usize, 9usize, 14usize);
    }
    #[unroll]
    for w in 0..16usize {
        out[w] += s[w];
    }
}

/// Dropout keep mask: thread `t` draws the words of elements `32 t .. 32 t + 32` (ChaCha8 blocks
/// `2 t` and `2 t + 1`; `key` is the stream's 8 key words then its 2 nonce words) and sets bit
/// `j` where word `32 t + j` is at or above `cut` (0 past `n`).
#[cube(launch)]
pub fn dropout_mask(key: &[u32], mask: &mut [u32], n: u32, cut: u32) {
    let t = ABSOLUTE_POS;
    if t < mask.len() {
        let mut block = Array::<u32>::new(16usize);
        let mut word = 0u32;
        for half in 0..2u32 {
            chacha8_block(key, (t as u32) * 2 + half, &mut block);
            #[unroll]
            for w in 0..16usize {
                let i = t * 32 + (half as usize) * 16 + w;
                if i < n as usize && block[w] >= cut {
                    word |= 1u32 << ((half * 16) + w as u32);
                }
            }
        }
        mask[t] = word;
    }
}

/// softmax over each row (one thread per row, f32), then dropout with the keep mask:
/// `s = softmax(x)`, `out = keep ? s · scale : 0`.
#[cube(launch)]
pub fn softmax_dropout_forward(
    x: &[f32],
    mask: &[u32],
    out: &mut [f32],
    s: &mut [f32],
    cols: u32,
    scale: f32,
) {
    let r = ABSOLUTE_POS;
    let c = cols as usize;
    if r * c < out.len() {
        let base = r * c;
        let mut max = x[base];
        for j in 1..c {
            max = f32::max(max, x[base + j]);
        }
        let mut sum = 0.0f32;
        for j in 0..c {
            let e = f32::exp(x[base + j] - max);
            s[base + j] = e;
            sum += e;
        }
        for j in 0..c {
            let v = s[base + j] / sum;
            s[base + j] = v;
            out[base + j] = select(bit_at(mask, base + j), v * scale, 0.0f32);
        }
    }
}

/// softmax·dropout backward, one thread per row: `ds = keep ? dy · scale : 0`,
/// `dx = s (ds - Σ ds s)`.
#[cube(launch)]
pub fn softmax_dropout_backward(
    dy: &[f32],
    s: &[f32],
    mask: &[u32],
    dx: &mut [f32],
    cols: u32,
    scale: f32,
) {
    let r = ABSOLUTE_POS;
    let c = cols as usize;
    if r * c < dx.len() {
        let base = r * c;
        let mut dot = 0.0f32;
        for j in 0..c {
            let ds = select(bit_at(mask, base + j), dy[base + j] * scale, 0.0f32);
            dot += ds * s[base + j];
        }
        for j in 0..c {
            let ds = select(bit_at(mask, base + j), dy[base + j] * scale, 0.0f32);
            dx[base + j] = s[base + j] * (ds - dot);
        }
    }
}

/// The dropout output from the softmax and the keep mask: `keep ? s · scale : 0`.
#[cube(launch)]
pub fn dropout_apply(s: &[f32], mask: &[u32], out: &mut [f32], scale: f32) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        out[i] = select(bit_at(mask, i), s[i] * scale, 0.0f32);
    }
}

/// Block absmax for compression: thread `b` writes `max |x|` over elements
/// `b · block .. (b + 1) · block` (the last block may be partial), or `nan` (a kernel argument:
/// WGSL has no NaN literal) where the block holds a non-finite value, which then decompresses to
/// NaN: the host kernel refuses such input, the device cannot without a host read, and a block of
/// NaN must not decompress to zeros.
#[cube(launch)]
pub fn block_absmax(x: &[f32], absmax: &mut [f32], block: u32, nan: f32) {
    let b = ABSOLUTE_POS;
    if b < absmax.len() {
        let start = b * (block as usize);
        let end = select(
            start + (block as usize) > x.len(),
            x.len(),
            start + (block as usize),
        );
        let mut m = 0.0f32;
        let mut finite = true;
        for i in start..end {
            let a = f32::abs(x[i]);
            // False for NaN and infinity alike (a GPU's max may drop a NaN operand).
            finite = finite && a <= f32::MAX;
            m = f32::max(m, a);
        }
        absmax[b] = select(finite, m, nan);
    }
}

/// Stochastic block-wise compression on the linear map's sorted values `values` (`k / side`,
/// `k = -side..=side`; lpmm-quant's
/// `Blockwise` with `QuantRounding::Stochastic`, lpmm-formats' `CodeMap::stochastic`): thread `t`
/// rounds elements `32 t .. 32 t + 32` with the draws of ChaCha8 block `t` (element `i`'s draw is
/// the low half of word `i / 2` for even `i`, the high half for odd `i`, in the high half of a
/// u32), and packs their `bits`-bit codes into words `bits t .. bits t + bits`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn compress(
    x: &[f32],
    absmax: &[f32],
    values: &[f32],
    key: &[u32],
    words: &mut [u32],
    n: u32,
    block: u32,
    side: u32,
    #[comptime] bits: u32,
) {
    let t = ABSOLUTE_POS;
    if t * (bits as usize) < words.len() {
        let mut draws = Array::<u32>::new(16usize);
        chacha8_block(key, t as u32, &mut draws);
        let last = values.len() - 1;
        let mut codes = Array::<u32>::new(32usize);
        for j in 0..32usize {
            let i = t * 32 + j;
            let mut code = 0u32;
            if i < n as usize {
                let a = absmax[i / (block as usize)];
                let y = select(a == 0.0f32, 0.0f32, x[i] / a);
                // The largest code whose value is at or below y (y >= -1, the first value): the
                // linear map's values are k / L (k = -L..=L, code k + L), so floor((y + 1) L) is
                // that code to within one, settled by comparing with the values themselves. (A
                // NaN y, from a block with a non-finite value, gives code 0; its absmax is NaN.)
                let guess = f32::floor((y + 1.0f32) * f32::cast_from(side));
                let mut lo = 0usize;
                if guess > 0.0f32 {
                    lo = u32::cast_from(f32::min(guess, f32::cast_from(last as u32))) as usize;
                }
                for _ in 0..2u32 {
                    if lo > 0 && values[lo] > y {
                        lo -= 1;
                    }
                }
                for _ in 0..2u32 {
                    if lo < last && values[lo + 1] <= y {
                        lo += 1;
                    }
                }
                code = lo as u32;
                if lo < last {
                    // Up with probability frac: lpmm-formats' `CodeMap::stochastic`.
                    let word = draws[j / 2];
                    let draw = select(j % 2 == 0, word << 16u32, (word >> 16u32) << 16u32);
                    let frac = (y - values[lo]) / (values[lo + 1] - values[lo]);
                    let scaled = frac * 4_294_967_296.0f32;
                    let mut cut = 0xFFFF_FFFFu32;
                    if scaled < 4_294_967_296.0f32 {
                        cut = u32::cast_from(scaled);
                    }
                    if draw < cut {
                        code += 1;
                    }
                }
            }
            codes[j] = code;
        }
        pack32(&codes, words, t, bits);
    }
}

/// Decompression: `values[code] · absmax[i / block]`.
#[cube(launch)]
pub fn decompress(
    words: &[u32],
    absmax: &[f32],
    values: &[f32],
    out: &mut [f32],
    block: u32,
    #[comptime] bits: u32,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let c = code_at(words, i, bits) as usize;
        let last = values.len() - 1;
        let k = select(c > last, last, c);
        out[i] = values[k] * absmax[i / (block as usize)];
    }
}
