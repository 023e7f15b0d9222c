//! The AVX2 kernels (8 lanes; no gathers: tables are read lane by lane): nearest rounding,
//! stochastic rounding on uniform grids (search-free, lanes it cannot take rounded by the
//! scalar search) and decoding, of one block and (on uniform grids) of runs of blocks, entered
//! after run-time detection of AVX2 and FMA.

use super::CodeMap;
use super::avx512::shared_scale_lanes;
use super::search::BUCKET_SHIFT;

impl CodeMap {
    /// [`CodeMap::nearest_scaled`] 8 elements at a time: the quotients divided as a vector, then
    /// each lane's search ([`CodeMap::nearest`]) with scalar reads of the same tables. Scalar
    /// reads rather than AVX2 gathers: a gather costs at least its loads on every AVX2 part, more
    /// on Zen 2 (microcoded) and on Intel parts whose microcode mitigates GDS ("Downfall").
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn nearest_scaled_avx2(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
        use std::arch::x86_64::*;
        let n = xs.len().min(out.len());
        if absmax == 0.0 {
            // `y = 0` for every element.
            out[..n].fill(self.nearest(0.0));
            return;
        }
        let whole = n - n % 8;
        let divisor = _mm256_set1_ps(absmax);
        // With one threshold per bucket (every shipped map), `nearest` without its bounds
        // checks: a bucket (16 bits) always indexes `start`, a `u8` code always indexes the
        // first 256 entries of `padded`. NaN falls in buckets whose count is 0, and `NaN <= y`
        // is false, so NaN gives code 0 as in `nearest`.
        let tables = (self.start.get(..1 << 16), self.padded.get(..256));
        let one_step = match tables {
            (Some(s), Some(t)) if self.scan == 1 => <&[u8; 1 << 16]>::try_from(s)
                .ok()
                .zip(<&[f32; 256]>::try_from(t).ok()),
            _ => None,
        };
        let mut y = [0f32; 8];
        for i in (0..whole).step_by(8) {
            // SAFETY: `i + 8 <= xs.len()`; the load is unaligned. `y` is 8 f32; the store is
            // unaligned.
            unsafe {
                let q = _mm256_div_ps(_mm256_loadu_ps(xs.as_ptr().add(i)), divisor);
                _mm256_storeu_ps(y.as_mut_ptr(), q);
            }
            let out = &mut out[i..i + 8];
            match one_step {
                Some((start, thresholds)) => {
                    for (o, &y) in out.iter_mut().zip(&y) {
                        let c = start[(y.to_bits() >> BUCKET_SHIFT) as usize];
                        *o = c + u8::from(thresholds[usize::from(c)] <= y);
                    }
                }
                None => {
                    for (o, &y) in out.iter_mut().zip(&y) {
                        *o = self.nearest(y);
                    }
                }
            }
        }
        self.nearest_scaled_portable(&xs[whole..n], absmax, &mut out[whole..n]);
    }

    /// [`CodeMap::stochastic_scaled`] 8 elements at a time on a uniform grid
    /// ([`CodeMap::stochastic_blocks_avx2`] with one scale); another map's elements lane by lane
    /// by [`CodeMap::stochastic`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn stochastic_scaled_avx2(
        &self,
        xs: &[f32],
        absmax: f32,
        bits: &[u32],
        out: &mut [u8],
    ) {
        let n = xs.len().min(out.len()).min(bits.len());
        let done = if n > 0 {
            self.stochastic_blocks_avx2(&xs[..n], &[absmax], n, &bits[..n], &mut out[..n])
        } else {
            0
        };
        let rest = done..n;
        self.stochastic_scaled_portable(
            &xs[rest.clone()],
            absmax,
            &bits[rest.clone()],
            &mut out[rest],
        );
    }

    /// [`CodeMap::stochastic_blocks`] on a uniform grid (`CodeMap::grid`), 8 elements at a
    /// time: the quotients of a run of at most 64 elements of a block divided as vectors (zeros
    /// where its scale is 0) into a buffer, then each group rounded from it by
    /// [`CodeMap::stochastic_grid8`] (the divisions out of the rounding's dependency chain: 1.1x
    /// faster on Zen 4 than one loop, docs/BENCHMARKS.md); a group it hands over is rounded lane
    /// by lane by [`CodeMap::stochastic`] from the same quotients. One call for a run of blocks
    /// (the constants stay in registers). Returns how many leading elements it rounded (whole
    /// groups of 8; none for another map, or blocks that are not a multiple of 8 long).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn stochastic_blocks_avx2(
        &self,
        xs: &[f32],
        scales: &[f32],
        block: usize,
        bits: &[u32],
        out: &mut [u8],
    ) -> usize {
        use std::arch::x86_64::*;
        let Some((origin, steps)) = self.grid else {
            return 0;
        };
        let Some(whole) = groups_of_8(xs.len().min(out.len()).min(bits.len()), scales, block)
        else {
            return 0;
        };
        for (k, &a) in scales.iter().enumerate() {
            let start = k * block;
            if start >= whole {
                break;
            }
            let divisor = _mm256_set1_ps(a);
            // All ones where the scale is nonzero: a scale of 0 gives quotients of +0.
            let keep = _mm256_cmp_ps::<_CMP_NEQ_UQ>(divisor, _mm256_setzero_ps());
            let end = (start + block).min(whole);
            let mut quotients = [0f32; 64];
            for run in (start..end).step_by(64) {
                // A multiple of 8: so are `whole` and, with more than one scale, `block`.
                let len = (end - run).min(64);
                for j in (0..len).step_by(8) {
                    // SAFETY: `run + j + 8 <= end <= xs.len()` and `j + 8 <= len <= 64`; the
                    // load and the store are unaligned.
                    unsafe {
                        let x = _mm256_loadu_ps(xs.as_ptr().add(run + j));
                        let y = _mm256_and_ps(_mm256_div_ps(x, divisor), keep);
                        _mm256_storeu_ps(quotients.as_mut_ptr().add(j), y);
                    }
                }
                for i in (run..run + len).step_by(8) {
                    // SAFETY: `i - run + 8 <= len <= 64`; the load is unaligned.
                    let y = unsafe { _mm256_loadu_ps(quotients.as_ptr().add(i - run)) };
                    if !self.stochastic_grid8(origin, steps, y, &bits[i..i + 8], &mut out[i..i + 8])
                    {
                        let lanes = &quotients[i - run..i - run + 8];
                        for (j, &y) in lanes.iter().enumerate() {
                            out[i + j] = self.stochastic(y, bits[i + j]);
                        }
                    }
                }
            }
        }
        whole
    }

    /// [`CodeMap::stochastic`] of 8 lanes `y` with draws `bits[..8]` into `out[..8]` on a
    /// uniform grid (`CodeMap::grid`) without a search, as `stochastic_grid16` does it on
    /// AVX-512: the lower code estimated as `floor(y * steps) + origin` (clamped to the codes),
    /// its value and the next one's computed as the grid defines them, kept only if they
    /// bracket `y` in every lane (else nothing is written and the result is false); then `lo +
    /// (r < F)` with `F = u32_saturating(frac * 2^32)`, `frac = (y - lo_v) / (hi_v - lo_v)` in
    /// f32, never above `lo` at the last code.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn stochastic_grid8(
        &self,
        origin: i32,
        steps: f32,
        y: std::arch::x86_64::__m256,
        bits: &[u32],
        out: &mut [u8],
    ) -> bool {
        use std::arch::x86_64::*;
        assert!(bits.len() >= 8 && out.len() >= 8, "8 lanes");
        let zero = _mm256_setzero_si256();
        let last = _mm256_set1_epi32(self.values.len() as i32 - 1);
        let k = _mm256_floor_ps(_mm256_mul_ps(y, _mm256_set1_ps(steps)));
        // Out-of-range products convert to i32::MIN; the clamp and the check catch them.
        let c = _mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(origin));
        let lo = _mm256_min_epi32(_mm256_max_epi32(c, zero), last);
        let hi = _mm256_min_epi32(_mm256_add_epi32(lo, _mm256_set1_epi32(1)), last);
        // The grid's values `f32(c - origin) / f32(steps)`, computed (the same bits as the value
        // table: `uniform_grid` checks every one) rather than gathered: faster here.
        let o = _mm256_set1_epi32(origin);
        let lo_v = grid_values8(_mm256_sub_epi32(lo, o), steps);
        let hi_v = grid_values8(_mm256_sub_epi32(hi, o), steps);
        let top = _mm256_cmpeq_epi32(lo, last);
        let at_or_above = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(lo_v, y));
        let below_next = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(y, hi_v));
        let ok = _mm256_and_si256(at_or_above, _mm256_or_si256(below_next, top));
        if _mm256_movemask_ps(_mm256_castsi256_ps(ok)) != 0xFF {
            return false;
        }
        let frac = _mm256_div_ps(_mm256_sub_ps(y, lo_v), _mm256_sub_ps(hi_v, lo_v));
        let cut = u32_saturating(_mm256_mul_ps(frac, _mm256_set1_ps(4_294_967_296.0)));
        // SAFETY: `bits` holds at least 8 values (asserted); the load is unaligned.
        let r = unsafe { _mm256_loadu_si256(bits.as_ptr().cast()) };
        // `r < cut` unsigned: both with the sign bit flipped, compared signed.
        let sign = _mm256_set1_epi32(i32::MIN);
        let below = _mm256_cmpgt_epi32(_mm256_xor_si256(cut, sign), _mm256_xor_si256(r, sign));
        // `up` is -1 where the code rounds up (never at the last code).
        let up = _mm256_andnot_si256(top, below);
        store_codes8(_mm256_sub_epi32(lo, up), out);
        true
    }

    /// [`CodeMap::decode_scaled`] 8 codes at a time on a uniform grid (the values computed);
    /// another map's values are read one by one (as in [`CodeMap::nearest_scaled_avx2`], not
    /// gathered).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn decode_scaled_avx2(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        let n = codes.len().min(out.len());
        if self.grid.is_none() {
            // Eight reads (loads into lanes) and one vector multiplication a group.
            let table = &*self.lookup;
            let (codes, out) = (&codes[..n], &mut out[..n]);
            for (o, c) in out.chunks_exact_mut(8).zip(codes.chunks_exact(8)) {
                for j in 0..8 {
                    o[j] = table[usize::from(c[j])] * scale;
                }
            }
            let whole = n - n % 8;
            for (o, &c) in out[whole..].iter_mut().zip(&codes[whole..]) {
                *o = table[usize::from(c)] * scale;
            }
            return;
        }
        let done = self.decode_blocks_avx2(&codes[..n], &[scale], n.max(1), &mut out[..n]);
        self.decode_scaled_portable(&codes[done..n], scale, &mut out[done..n]);
    }

    /// [`CodeMap::decode_blocks`] on a uniform grid (`CodeMap::grid`), 8 codes at a time, the
    /// values computed (the value table's bits: see `uniform_grid`). One call for a run of
    /// blocks. Returns how many leading values it wrote (whole groups of 8; none for another
    /// map, or blocks that are not a multiple of 8 long).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn decode_blocks_avx2(
        &self,
        codes: &[u8],
        scales: &[f32],
        block: usize,
        out: &mut [f32],
    ) -> usize {
        use std::arch::x86_64::*;
        let Some((o, l)) = self.grid else {
            return 0;
        };
        let Some(whole) = groups_of_8(codes.len().min(out.len()), scales, block) else {
            return 0;
        };
        let last = _mm256_set1_epi32(self.values.len() as i32 - 1);
        let origin = _mm256_set1_epi32(o);
        for (k, &scale) in scales.iter().enumerate() {
            let start = k * block;
            if start >= whole {
                break;
            }
            let s = _mm256_set1_ps(scale);
            for i in (start..(start + block).min(whole)).step_by(8) {
                // SAFETY: `i + 8 <= whole <= codes.len()`; the load reads 8 bytes.
                let c8 = unsafe { _mm_loadl_epi64(codes.as_ptr().add(i).cast()) };
                let c = _mm256_min_epu32(_mm256_cvtepu8_epi32(c8), last);
                let v = grid_values8(_mm256_sub_epi32(c, origin), l);
                // SAFETY: `i + 8 <= whole <= out.len()`; the store is unaligned.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(v, s)) };
            }
        }
        whole
    }
}

/// How many leading elements of `len` an 8-lane run-of-blocks kernel (element `j` scaled by
/// `scales[j / block]`) takes: the whole groups of 8 among those with a scale, if no group
/// straddles two blocks; `None` otherwise.
fn groups_of_8(len: usize, scales: &[f32], block: usize) -> Option<usize> {
    shared_scale_lanes(len, scales, block, 8).map(|n| n - n % 8)
}

/// `search::grid_value` of 8 lanes: a uniform grid's values `f32(k) / steps` without a division
/// (the IEEE quotient's bits for `|k| <= 255` and whole `steps` in 1..=255; `uniform_grid` checks
/// them for each map's codes).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn grid_values8(k: std::arch::x86_64::__m256i, steps: f32) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let (a, b, rb) = (
        _mm256_cvtepi32_ps(k),
        _mm256_set1_ps(steps),
        _mm256_set1_ps(1.0 / steps),
    );
    let q0 = _mm256_mul_ps(a, rb);
    _mm256_fmadd_ps(_mm256_fnmadd_ps(b, q0, a), rb, q0)
}

/// `x as u32` (Rust's saturating conversion) of 8 lanes in `[0, 2^32]`: `vcvttps2dq` below 2^31,
/// `x - 2^31` (exact there) converted with the top bit set from 2^31, all ones at 2^32 (AVX2 has
/// no unsigned conversion).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn u32_saturating(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let two31 = _mm256_set1_ps(2_147_483_648.0);
    let high = _mm256_cmp_ps::<_CMP_GE_OQ>(x, two31);
    let low_part = _mm256_cvttps_epi32(x);
    let high_part = _mm256_xor_si256(
        _mm256_cvttps_epi32(_mm256_sub_ps(x, two31)),
        _mm256_set1_epi32(i32::MIN),
    );
    let v = _mm256_blendv_epi8(low_part, high_part, _mm256_castps_si256(high));
    let full = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(4_294_967_296.0));
    _mm256_or_si256(v, _mm256_castps_si256(full))
}

/// Stores 8 codes (32-bit lanes, each below 256) as the bytes `out[..8]`, in order: two
/// saturating packs (exact for codes) and one 8-byte store.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn store_codes8(codes: std::arch::x86_64::__m256i, out: &mut [u8]) {
    use std::arch::x86_64::*;
    assert!(out.len() >= 8, "8 codes");
    // Within each 128-bit half: 4 codes as u16, then as bytes (each half repeats its 4).
    let words = _mm256_packus_epi32(codes, codes);
    let bytes = _mm256_packus_epi16(words, words);
    let both = _mm_unpacklo_epi32(
        _mm256_castsi256_si128(bytes),
        _mm256_extracti128_si256::<1>(bytes),
    );
    // SAFETY: `out` holds at least 8 bytes (asserted); the store is unaligned.
    unsafe { _mm_storel_epi64(out.as_mut_ptr().cast(), both) };
}
