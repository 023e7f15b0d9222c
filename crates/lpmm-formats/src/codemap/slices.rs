//! The slice kernels: one block's codes or values (`nearest_scaled`, `stochastic_scaled`,
//! `decode_scaled`) and runs of blocks (`*_blocks`), each taking the widest SIMD kernel the CPU
//! has (`avx2.rs`, `avx512.rs`, `vbmi.rs`, picked at run time by [`crate::simd`]) or the portable
//! loop, whose bits every kernel gives.

use super::CodeMap;

/// Which scale element `j` of a run of blocks uses: `j / block`, a shift for a power of two (every
/// block size the quantizers take).
#[derive(Clone, Copy)]
pub(super) struct BlockOf {
    block: usize,
    shift: Option<u32>,
}

impl BlockOf {
    pub(super) fn new(block: usize) -> Self {
        BlockOf {
            block,
            shift: block.is_power_of_two().then(|| block.trailing_zeros()),
        }
    }

    #[inline(always)]
    pub(super) fn of(self, j: usize) -> usize {
        match self.shift {
            Some(s) => j >> s,
            None => j / self.block,
        }
    }
}

/// The blocks of `block` elements that hold elements `done..n`, each as its index and the part
/// of that range it holds: what a run-of-blocks kernel leaves to the one-block kernels after its
/// vector part. Visits only those blocks (callers pass every scale of a chunk, while a vector
/// part usually leaves none or a tail).
fn blocks_from(
    done: usize,
    n: usize,
    block: usize,
) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> {
    (done / block..n.div_ceil(block))
        .map(move |k| (k, (k * block).max(done)..((k + 1) * block).min(n)))
        .filter(|(_, r)| !r.is_empty())
}

impl CodeMap {
    /// The code nearest to each `x / absmax` (f32 division; `y = 0` for every element when
    /// `absmax` is 0), as [`CodeMap::nearest`] gives it: a block-wise quantizer's inner loop.
    /// Writes `min(xs.len(), out.len())` codes.
    pub fn nearest_scaled(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        match crate::simd::level() {
            crate::simd::Level::Avx512 | crate::simd::Level::Avx512Vbmi => {
                // SAFETY: the AVX-512 levels are in use only after run-time detection of
                // AVX-512 F/BW/VL/DQ.
                unsafe { self.nearest_scaled_avx512(xs, absmax, out) };
                return;
            }
            crate::simd::Level::Avx2 => {
                // SAFETY: `Avx2` is in use only after run-time detection of AVX2 and FMA.
                unsafe { self.nearest_scaled_avx2(xs, absmax, out) };
                return;
            }
            crate::simd::Level::Portable => {}
        }
        self.nearest_scaled_portable(xs, absmax, out);
    }

    pub(super) fn nearest_scaled_portable(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = self.nearest(if absmax == 0.0 { 0.0 } else { x / absmax });
        }
    }

    /// [`CodeMap::stochastic`] of each `x / absmax` (`y = 0` for every element when `absmax` is
    /// 0) with the random bits `bits[j]` for element `j`. Writes
    /// `min(xs.len(), bits.len(), out.len())` codes.
    pub fn stochastic_scaled(&self, xs: &[f32], absmax: f32, bits: &[u32], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        match crate::simd::level() {
            crate::simd::Level::Avx512 | crate::simd::Level::Avx512Vbmi => {
                // SAFETY: the AVX-512 levels are in use only after run-time detection of
                // AVX-512 F/BW/VL/DQ.
                unsafe { self.stochastic_scaled_avx512(xs, absmax, bits, out) };
                return;
            }
            crate::simd::Level::Avx2 => {
                // SAFETY: `Avx2` is in use only after run-time detection of AVX2 and FMA.
                unsafe { self.stochastic_scaled_avx2(xs, absmax, bits, out) };
                return;
            }
            crate::simd::Level::Portable => {}
        }
        self.stochastic_scaled_portable(xs, absmax, bits, out);
    }

    pub(super) fn stochastic_scaled_portable(
        &self,
        xs: &[f32],
        absmax: f32,
        bits: &[u32],
        out: &mut [u8],
    ) {
        for ((o, &x), &b) in out.iter_mut().zip(xs).zip(bits) {
            *o = self.stochastic(if absmax == 0.0 { 0.0 } else { x / absmax }, b);
        }
    }

    /// `value(code) * scale` for each code (codes past the end decode as the last value):
    /// a block-wise dequantizer's inner loop. Writes `min(codes.len(), out.len())` values.
    pub fn decode_scaled(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        match crate::simd::level() {
            crate::simd::Level::Avx512 | crate::simd::Level::Avx512Vbmi => {
                // SAFETY: the AVX-512 levels are in use only after run-time detection of
                // AVX-512 F/BW/VL/DQ.
                unsafe { self.decode_scaled_avx512(codes, scale, out) };
                return;
            }
            crate::simd::Level::Avx2 => {
                // SAFETY: `Avx2` is in use only after run-time detection of AVX2 and FMA.
                unsafe { self.decode_scaled_avx2(codes, scale, out) };
                return;
            }
            crate::simd::Level::Portable => {}
        }
        self.decode_scaled_portable(codes, scale, out);
    }

    pub(super) fn decode_scaled_portable(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = self.value(c) * scale;
        }
    }

    /// [`CodeMap::nearest_scaled`] over a run of blocks: element `j` is divided by
    /// `absmax[j / block]`. Writes `min(xs.len(), out.len(), absmax.len() * block)` codes; the
    /// codes are those of [`CodeMap::nearest_scaled`] block by block (one call instead of one
    /// per block: the vector kernels keep their tables loaded across blocks).
    pub fn nearest_blocks(&self, xs: &[f32], absmax: &[f32], block: usize, out: &mut [u8]) {
        let block = block.max(1);
        let n = xs
            .len()
            .min(out.len())
            .min(absmax.len().saturating_mul(block));
        #[allow(unused_mut)] // assigned only on x86-64
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if self.values.len() <= 16 && crate::simd::avx512() {
            // SAFETY: `avx512()` is true only after run-time detection of AVX-512 F/BW/VL/DQ.
            done = unsafe { self.nearest_small_avx512(&xs[..n], absmax, block, &mut out[..n]) };
        } else if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 F/BW/VL (the
            // AVX-512 level) and VBMI.
            done = unsafe { self.nearest_scaled_vbmi(&xs[..n], absmax, block, &mut out[..n]) };
        } else if crate::simd::avx512() {
            // SAFETY: `avx512()` is true only after run-time detection of AVX-512 F/BW/VL/DQ.
            done = unsafe { self.nearest_scaled_words(&xs[..n], absmax, block, &mut out[..n]) };
        }
        for (k, r) in blocks_from(done, n, block) {
            self.nearest_scaled(&xs[r.clone()], absmax[k], &mut out[r]);
        }
    }

    /// [`CodeMap::stochastic_scaled`] over a run of blocks: element `j` is divided by
    /// `absmax[j / block]` and uses `bits[j]`. Writes
    /// `min(xs.len(), bits.len(), out.len(), absmax.len() * block)` codes, those of
    /// [`CodeMap::stochastic_scaled`] block by block.
    pub fn stochastic_blocks(
        &self,
        xs: &[f32],
        absmax: &[f32],
        block: usize,
        bits: &[u32],
        out: &mut [u8],
    ) {
        let block = block.max(1);
        let n = xs
            .len()
            .min(out.len())
            .min(bits.len())
            .min(absmax.len().saturating_mul(block));
        #[allow(unused_mut)] // assigned only on x86-64
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 F/BW/VL (the
            // AVX-512 level) and VBMI.
            done = unsafe {
                self.stochastic_scaled_vbmi(&xs[..n], absmax, block, &bits[..n], &mut out[..n])
            };
        } else if crate::simd::avx512() {
            // SAFETY: `avx512()` is true only after run-time detection of AVX-512 F/BW/VL/DQ.
            done = unsafe {
                self.stochastic_blocks_avx512(&xs[..n], absmax, block, &bits[..n], &mut out[..n])
            };
        } else if crate::simd::level() == crate::simd::Level::Avx2 {
            // SAFETY: `Avx2` is in use only after run-time detection of AVX2 and FMA.
            done = unsafe {
                self.stochastic_blocks_avx2(&xs[..n], absmax, block, &bits[..n], &mut out[..n])
            };
        }
        for (k, r) in blocks_from(done, n, block) {
            let (x, b) = (&xs[r.clone()], &bits[r.clone()]);
            self.stochastic_scaled(x, absmax[k], b, &mut out[r]);
        }
    }

    /// [`CodeMap::decode_scaled`] over a run of blocks: code `j` is scaled by
    /// `scales[j / block]`. Writes `min(codes.len(), out.len(), scales.len() * block)` values.
    pub fn decode_blocks(&self, codes: &[u8], scales: &[f32], block: usize, out: &mut [f32]) {
        let block = block.max(1);
        let n = codes
            .len()
            .min(out.len())
            .min(scales.len().saturating_mul(block));
        #[allow(unused_mut)] // assigned only on x86-64
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 F/BW/VL (the
            // AVX-512 level) and VBMI.
            done = unsafe { self.decode_scaled_vbmi(&codes[..n], scales, block, &mut out[..n]) };
        } else if crate::simd::avx512() {
            // SAFETY: `avx512()` is true only after run-time detection of AVX-512 F/BW/VL/DQ.
            done = unsafe { self.decode_blocks_avx512(&codes[..n], scales, block, &mut out[..n]) };
        } else if crate::simd::level() == crate::simd::Level::Avx2 {
            // SAFETY: `Avx2` is in use only after run-time detection of AVX2 and FMA.
            done = unsafe { self.decode_blocks_avx2(&codes[..n], scales, block, &mut out[..n]) };
        }
        for (k, r) in blocks_from(done, n, block) {
            self.decode_scaled(&codes[r.clone()], scales[k], &mut out[r]);
        }
    }
}
