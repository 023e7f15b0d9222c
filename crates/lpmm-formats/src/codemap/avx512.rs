//! The AVX-512 F/BW/VL kernels (16 lanes, gathers from the scalar search's tables): nearest and
//! stochastic rounding (search-free on uniform grids) and decoding of one block, the
//! register-table nearest rounding of maps of at most 16 values, uniform grids' stochastic
//! rounding (64 lanes) and decoding over runs of blocks, and the lane helpers the VBMI and
//! word-table kernels share. Entered after run-time detection of AVX-512 F/BW/VL/DQ.

use super::CodeMap;
use super::search::BUCKET_SHIFT;
use super::slices::BlockOf;

/// `x / absmax` of 16 lanes (`divisor` holds `absmax` in every lane), or zeros when `absmax` is 0
/// (those lanes are not divided).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn quotient_lanes(
    xs: &[f32],
    _absmax: f32,
    divisor: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    assert!(xs.len() >= 16, "16 lanes");
    // SAFETY: `xs` holds at least 16 values (asserted); the load is unaligned.
    let x = unsafe { _mm512_loadu_ps(xs.as_ptr()) };
    let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(divisor, _mm512_setzero_ps());
    _mm512_maskz_div_ps(nonzero, x, divisor)
}

/// [`CodeMap::stochastic`]'s last step on 16 lanes: `lo + (r < F)` with `F =
/// u32_saturating(frac * 2^32)`, `frac = (y - lo_v) / (hi_v - lo_v)` in f32, and never above `lo`
/// in the lanes of `top` (`lo` is the last code there).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn stochastic_step(
    y: std::arch::x86_64::__m512,
    lo: std::arch::x86_64::__m512i,
    lo_v: std::arch::x86_64::__m512,
    hi_v: std::arch::x86_64::__m512,
    top: std::arch::x86_64::__mmask16,
    r: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let frac = _mm512_div_ps(_mm512_sub_ps(y, lo_v), _mm512_sub_ps(hi_v, lo_v));
    // Saturating like Rust's `as u32` on [0, 2^32]: out of range gives 2^32 - 1.
    let cut = _mm512_cvttps_epu32(_mm512_mul_ps(frac, _mm512_set1_ps(4_294_967_296.0)));
    let up = _mm512_cmplt_epu32_mask(r, cut) & !top;
    _mm512_mask_add_epi32(lo, up, lo, _mm512_set1_epi32(1))
}

/// How many leading elements of `len` a kernel of 16-lane registers with per-block `scales`
/// (element `j` uses `scales[j / block]`) may process: all those that have a scale, if every 16
/// lanes share one (`block` a multiple of 16, or a single scale); `None` otherwise.
pub(super) fn lanes_for(len: usize, scales: &[f32], block: usize) -> Option<usize> {
    shared_scale_lanes(len, scales, block, 16)
}

/// [`lanes_for`] for registers of `width` lanes.
pub(super) fn shared_scale_lanes(
    len: usize,
    scales: &[f32],
    block: usize,
    width: usize,
) -> Option<usize> {
    if block == 0 || !(block.is_multiple_of(width) || scales.len() == 1) {
        return None;
    }
    Some(len.min(scales.len().saturating_mul(block)))
}

/// The quotients `x / scale` of the 64 elements `xs` (at most 64 of them are read), which start
/// at element `start` of a run whose element `j` uses `scales[j / block]` (16 lanes share one
/// scale: see `lanes_for`), as four registers of 16.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn quotients64(
    xs: &[f32],
    scales: &[f32],
    start: usize,
    block: usize,
) -> [std::arch::x86_64::__m512; 4] {
    use std::arch::x86_64::*;
    let at = BlockOf::new(block);
    std::array::from_fn(|m| {
        let a = scales[at.of(start + 16 * m)];
        quotient_lanes(&xs[16 * m..16 * m + 16], a, _mm512_set1_ps(a))
    })
}

/// `search::grid_value` of 16 lanes: a uniform grid's values `f32(k) / steps` without a division
/// (the IEEE quotient's bits for `|k| <= 255` and whole `steps` in 1..=255; `uniform_grid` checks
/// them for each map's codes).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn grid_values16(
    k: std::arch::x86_64::__m512i,
    steps: f32,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let (a, b, rb) = (
        _mm512_cvtepi32_ps(k),
        _mm512_set1_ps(steps),
        _mm512_set1_ps(1.0 / steps),
    );
    let q0 = _mm512_mul_ps(a, rb);
    _mm512_fmadd_ps(_mm512_fnmadd_ps(b, q0, a), rb, q0)
}

impl CodeMap {
    /// [`CodeMap::nearest_scaled`] sixteen elements at a time: the bucket's start and each scan
    /// step are gathers from the same tables the scalar search reads, so the codes are the same.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn nearest_scaled_avx512(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
        let n = xs.len().min(out.len());
        let done = if self.values.len() <= 16 {
            self.nearest_small_avx512(&xs[..n], &[absmax], n, &mut out[..n])
        } else if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 VBMI (and the
            // AVX-512 level, whose F/BW/VL this function was entered with).
            unsafe { self.nearest_scaled_vbmi(&xs[..n], &[absmax], n, &mut out[..n]) }
        } else {
            self.nearest_scaled_words(&xs[..n], &[absmax], n, &mut out[..n])
        };
        self.nearest_scaled_gather(&xs[done..n], absmax, &mut out[done..n]);
    }

    /// [`CodeMap::nearest_scaled`] over a run of blocks for maps of at most 16 values (4 bits and
    /// narrower), 16 lanes at a time without gathers: `#{ j : threshold_j <= y }` by a
    /// branch-free binary search of four steps over the thresholds held in one register
    /// (`vpermps`; NaN pads the table, and `NaN <= y` is false, so NaN gives code 0 as in
    /// [`CodeMap::nearest`]). Returns how many leading elements it rounded (a multiple of 16;
    /// none for a larger map).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn nearest_small_avx512(
        &self,
        xs: &[f32],
        scales: &[f32],
        block: usize,
        out: &mut [u8],
    ) -> usize {
        use std::arch::x86_64::*;
        let Some(n) = lanes_for(xs.len().min(out.len()), scales, block) else {
            return 0;
        };
        if self.thresholds.len() > 15 {
            return 0;
        }
        let mut table = [f32::NAN; 16];
        table[..self.thresholds.len()].copy_from_slice(&self.thresholds);
        // SAFETY: `table` holds 16 f32; the load is unaligned.
        let table = unsafe { _mm512_loadu_ps(table.as_ptr()) };
        let whole = n - n % 16;
        let at = BlockOf::new(block);
        for i in (0..whole).step_by(16) {
            let a = scales[at.of(i)];
            let y = quotient_lanes(&xs[i..i + 16], a, _mm512_set1_ps(a));
            let mut c = _mm512_setzero_si512();
            for step in [8, 4, 2, 1] {
                let probe = _mm512_add_epi32(c, _mm512_set1_epi32(step - 1));
                let t = _mm512_permutexvar_ps(probe, table);
                let le = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(t, y);
                c = _mm512_mask_add_epi32(c, le, c, _mm512_set1_epi32(step));
            }
            // SAFETY: `i + 16 <= whole <= out.len()`; the store is unaligned.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi8(c)) };
        }
        whole
    }

    /// [`CodeMap::nearest_scaled`] sixteen elements at a time with gathers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn nearest_scaled_gather(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
        use std::arch::x86_64::*;
        let n = xs.len().min(out.len());
        let whole = n - n % 16;
        let divisor = _mm512_set1_ps(absmax);
        for i in (0..whole).step_by(16) {
            let y = quotient_lanes(&xs[i..i + 16], absmax, divisor);
            let c = self.nearest_lanes(y);
            // SAFETY: `i + 16 <= out.len()`; the store is unaligned.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi8(c)) };
        }
        self.nearest_scaled_portable(&xs[whole..n], absmax, &mut out[whole..n]);
    }

    /// [`CodeMap::nearest`] of 16 lanes: the bucket's start code and each scan step are gathers
    /// from the same tables the scalar search reads, so the codes are the same.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    pub(super) fn nearest_lanes(&self, y: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        let bucket = _mm512_srli_epi32::<{ BUCKET_SHIFT }>(_mm512_castps_si512(y));
        // SAFETY: buckets are < 2^16 and `start` holds 2^16 entries plus 3 bytes of padding,
        // so each 4-byte read stays inside it.
        let gathered = unsafe { _mm512_i32gather_epi32::<1>(bucket, self.start.as_ptr().cast()) };
        let mut c = _mm512_and_si512(gathered, _mm512_set1_epi32(0xFF));
        for _ in 0..self.scan {
            // SAFETY: as in `nearest`: `c` never exceeds `thresholds.len() + steps so far`, and
            // `padded` holds `scan` entries past the thresholds.
            let t = unsafe { _mm512_i32gather_ps::<4>(c, self.padded.as_ptr()) };
            let le = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(t, y);
            c = _mm512_mask_add_epi32(c, le, c, _mm512_set1_epi32(1));
        }
        // NaN gives code 0, as in `nearest`.
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y, y);
        _mm512_mask_mov_epi32(c, nan, _mm512_setzero_si512())
    }

    /// [`CodeMap::stochastic`] with AVX-512: 64 lanes at a time from register tables where the
    /// CPU has VBMI and the map allows it, the rest 16 lanes at a time with gathers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn stochastic_scaled_avx512(
        &self,
        xs: &[f32],
        absmax: f32,
        bits: &[u32],
        out: &mut [u8],
    ) {
        let n = xs.len().min(out.len()).min(bits.len());
        let mut done = 0;
        if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 VBMI (and the
            // AVX-512 level, whose F/BW/VL this function was entered with).
            done = unsafe {
                self.stochastic_scaled_vbmi(&xs[..n], &[absmax], n, &bits[..n], &mut out[..n])
            };
        } else if n > 0 {
            done = self.stochastic_blocks_avx512(&xs[..n], &[absmax], n, &bits[..n], &mut out[..n]);
        }
        self.stochastic_scaled_gather(&xs[done..n], absmax, &bits[done..n], &mut out[done..n]);
    }

    /// [`CodeMap::stochastic`] sixteen lanes at a time, step for step, gathering from the tables.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn stochastic_scaled_gather(
        &self,
        xs: &[f32],
        absmax: f32,
        bits: &[u32],
        out: &mut [u8],
    ) {
        use std::arch::x86_64::*;
        let n = xs.len().min(out.len()).min(bits.len());
        let whole = n - n % 16;
        let values = self.values.as_ptr();
        let zero = _mm512_setzero_si512();
        let one = _mm512_set1_epi32(1);
        let last = _mm512_set1_epi32(self.values.len() as i32 - 1);
        let divisor = _mm512_set1_ps(absmax);
        for i in (0..whole).step_by(16) {
            let y = quotient_lanes(&xs[i..i + 16], absmax, divisor);
            if let Some((origin, steps)) = self.grid
                && self.stochastic_grid16(origin, steps, y, &bits[i..i + 16], &mut out[i..i + 16])
            {
                continue;
            }
            let c = self.nearest_lanes(y);
            // SAFETY: codes from `nearest_lanes` are < values.len().
            let vc = unsafe { _mm512_i32gather_ps::<4>(c, values) };
            let below = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(vc, y);
            let under = below & _mm512_cmpeq_epi32_mask(c, zero);
            let lo = _mm512_max_epi32(_mm512_mask_sub_epi32(c, below, c, one), zero);
            let top = _mm512_cmpeq_epi32_mask(lo, last);
            let hi = _mm512_min_epi32(_mm512_add_epi32(lo, one), last);
            // `lo` or `hi` is `c` (whose value is `vc`) unless both are: one more gather, of
            // the other one, gives both values.
            let lo_is_c = _mm512_cmpeq_epi32_mask(lo, c);
            let hi_is_c = _mm512_cmpeq_epi32_mask(hi, c);
            let other = _mm512_mask_mov_epi32(lo, lo_is_c, hi);
            // SAFETY: `lo` and `hi` are clamped to 0..values.len().
            let ov = unsafe { _mm512_i32gather_ps::<4>(other, values) };
            let lo_v = _mm512_mask_mov_ps(ov, lo_is_c, vc);
            let hi_v = _mm512_mask_mov_ps(ov, hi_is_c, vc);
            // SAFETY: `i + 16 <= bits.len()`; the load is unaligned.
            let r = unsafe { _mm512_loadu_si512(bits.as_ptr().add(i).cast()) };
            let mut code = stochastic_step(y, lo, lo_v, hi_v, top, r);
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y, y);
            code = _mm512_mask_mov_epi32(code, under | nan, zero);
            // SAFETY: `i + 16 <= out.len()`; the store is unaligned.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi8(code)) };
        }
        self.stochastic_scaled_portable(&xs[whole..n], absmax, &bits[whole..n], &mut out[whole..n]);
    }

    /// [`CodeMap::stochastic`] of 16 lanes `y` with draws `bits[..16]` into `out[..16]` on a
    /// uniform grid (`CodeMap::grid`) without a search, as [`CodeMap::stochastic_grid64`] does
    /// it with VBMI: the lower code estimated as `floor(y * steps) + origin` (clamped to the
    /// codes), its value and the next one's computed as the grid defines them, kept only if
    /// they bracket `y`. Writes nothing and returns false if that check fails in any lane; the
    /// caller then searches.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    pub(super) fn stochastic_grid16(
        &self,
        origin: i32,
        steps: f32,
        y: std::arch::x86_64::__m512,
        bits: &[u32],
        out: &mut [u8],
    ) -> bool {
        use std::arch::x86_64::*;
        assert!(bits.len() >= 16 && out.len() >= 16, "16 lanes");
        let zero = _mm512_setzero_si512();
        let last = _mm512_set1_epi32(self.values.len() as i32 - 1);
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(y, _mm512_set1_ps(steps)),
        );
        // Out-of-range products convert to i32::MIN; the clamp and the check catch them.
        let c = _mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(origin));
        let lo = _mm512_min_epi32(_mm512_max_epi32(c, zero), last);
        let hi = _mm512_min_epi32(_mm512_add_epi32(lo, _mm512_set1_epi32(1)), last);
        // The grid's values `f32(c - origin) / f32(steps)`, computed (the same bits as the value
        // table: `uniform_grid` checks every one) rather than gathered: faster here.
        let o = _mm512_set1_epi32(origin);
        let lo_v = grid_values16(_mm512_sub_epi32(lo, o), steps);
        let hi_v = grid_values16(_mm512_sub_epi32(hi, o), steps);
        let top = _mm512_cmpeq_epi32_mask(lo, last);
        let at_or_above = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(lo_v, y);
        let below_next = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(y, hi_v);
        if at_or_above & (below_next | top) != 0xFFFF {
            return false;
        }
        // SAFETY: `bits` holds at least 16 values (asserted); the load is unaligned.
        let r = unsafe { _mm512_loadu_si512(bits.as_ptr().cast()) };
        let code = stochastic_step(y, lo, lo_v, hi_v, top, r);
        // SAFETY: `out` holds at least 16 bytes (asserted); the store is unaligned.
        unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(code)) };
        true
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn decode_scaled_avx512(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        let n = codes.len().min(out.len());
        let done = if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 VBMI (and the
            // AVX-512 level, whose F/BW/VL this function was entered with).
            unsafe { self.decode_scaled_vbmi(&codes[..n], &[scale], n, &mut out[..n]) }
        } else {
            self.decode_blocks_avx512(&codes[..n], &[scale], n.max(1), &mut out[..n])
        };
        self.decode_scaled_gather(&codes[done..n], scale, &mut out[done..n]);
    }

    /// [`CodeMap::decode_blocks`] at the AVX-512 level without VBMI: a uniform grid's values
    /// computed ([`CodeMap::decode_grid_runs`], faster than looked up), another map's from word
    /// tables ([`CodeMap::decode_scaled_words`]). Returns how many leading values it wrote.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn decode_blocks_avx512(
        &self,
        codes: &[u8],
        scales: &[f32],
        block: usize,
        out: &mut [f32],
    ) -> usize {
        match self.grid {
            Some(_) => self.decode_grid_runs(codes, scales, block, out),
            None => self.decode_scaled_words(codes, scales, block, out),
        }
    }

    /// [`CodeMap::decode_blocks`] on a uniform grid (`CodeMap::grid`), 16 codes at a time, the
    /// values computed (the value table's bits: see `uniform_grid`). One call for a run of
    /// blocks. Returns how many leading values it wrote (whole groups of 16; none for another
    /// map, or blocks that are not a multiple of 16 long).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn decode_grid_runs(
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
        let Some(n) = lanes_for(codes.len().min(out.len()), scales, block) else {
            return 0;
        };
        let whole = n - n % 16;
        let last = _mm512_set1_epi32(self.values.len() as i32 - 1);
        let origin = _mm512_set1_epi32(o);
        for (k, &scale) in scales.iter().enumerate() {
            let start = k * block;
            if start >= whole {
                break;
            }
            let s = _mm512_set1_ps(scale);
            for i in (start..(start + block).min(whole)).step_by(16) {
                // SAFETY: `i + 16 <= whole <= codes.len()`; the load is unaligned.
                let c8 = unsafe { _mm_loadu_si128(codes.as_ptr().add(i).cast()) };
                let c = _mm512_min_epu32(_mm512_cvtepu8_epi32(c8), last);
                let v = grid_values16(_mm512_sub_epi32(c, origin), l);
                // SAFETY: `i + 16 <= whole <= out.len()`; the store is unaligned.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(v, s)) };
            }
        }
        whole
    }

    /// [`CodeMap::decode_scaled`] 16 codes at a time, gathering the values (computing them on a
    /// uniform grid).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn decode_scaled_gather(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = codes.len().min(out.len());
        let whole = n - n % 16;
        let last = _mm512_set1_epi32(self.values.len() as i32 - 1);
        let s = _mm512_set1_ps(scale);
        for i in (0..whole).step_by(16) {
            // SAFETY: `i + 16 <= codes.len()`; the load is unaligned.
            let c8 = unsafe { _mm_loadu_si128(codes.as_ptr().add(i).cast()) };
            let c = _mm512_min_epu32(_mm512_cvtepu8_epi32(c8), last);
            let v = match self.grid {
                // A uniform grid's values, computed (the value table's bits: see `uniform_grid`).
                Some((o, l)) => grid_values16(_mm512_sub_epi32(c, _mm512_set1_epi32(o)), l),
                // SAFETY: every index is clamped to `values.len() - 1`.
                None => unsafe { _mm512_i32gather_ps::<4>(c, self.values.as_ptr()) },
            };
            // SAFETY: `i + 16 <= out.len()`; the store is unaligned.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(v, s)) };
        }
        self.decode_scaled_portable(&codes[whole..n], scale, &mut out[whole..n]);
    }

    /// [`CodeMap::stochastic_blocks`] on a uniform grid (`CodeMap::grid`), for the AVX-512 and
    /// VBMI levels (it needs no byte permutes): 64 lanes at a time without a search
    /// ([`CodeMap::stochastic_grid64`]); the rare groups it hands over are rounded lane by lane
    /// by [`CodeMap::stochastic`], from the same quotients. Returns how many leading elements it
    /// rounded (a multiple of 64; none for another map, or blocks `lanes_for` refuses: the
    /// one-block kernels take them).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn stochastic_blocks_avx512(
        &self,
        xs: &[f32],
        scales: &[f32],
        block: usize,
        bits: &[u32],
        out: &mut [u8],
    ) -> usize {
        let Some((origin, steps)) = self.grid else {
            return 0;
        };
        let Some(n) = lanes_for(xs.len().min(out.len()).min(bits.len()), scales, block) else {
            return 0;
        };
        use std::arch::x86_64::*;
        let whole = n - n % 64;
        for i in (0..whole).step_by(64) {
            let y = quotients64(&xs[i..i + 64], scales, i, block);
            // `i + 64 <= whole <= bits.len(), out.len()` (`lanes_for`).
            if !self.stochastic_grid64(origin, steps, y, &bits[i..], &mut out[i..]) {
                let mut lanes = [0f32; 64];
                for (m, y) in y.into_iter().enumerate() {
                    // SAFETY: `16 m + 16 <= 64`; the store is unaligned.
                    unsafe { _mm512_storeu_ps(lanes[16 * m..].as_mut_ptr(), y) };
                }
                for (j, &y) in lanes.iter().enumerate() {
                    out[i + j] = self.stochastic(y, bits[i + j]);
                }
            }
        }
        whole
    }

    /// [`CodeMap::stochastic`] of 64 lanes `y` with draws `bits[..64]` into `out[..64]` on a
    /// uniform grid (`CodeMap::grid`), without a search: the lower code is estimated as
    /// `floor(y * steps) + origin` (clamped to the codes) and kept only if its value is `<= y`
    /// and the next value (if any) is `> y`, which makes it the largest code whose value is
    /// `<= y`, the `lo` of [`CodeMap::stochastic`]. Writes nothing and returns false if that
    /// check fails in any lane (NaN, values off the grid's range, or a product `y * steps`
    /// rounded across an integer); the caller then searches.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    pub(super) fn stochastic_grid64(
        &self,
        origin: i32,
        steps: f32,
        y: [std::arch::x86_64::__m512; 4],
        bits: &[u32],
        out: &mut [u8],
    ) -> bool {
        use std::arch::x86_64::*;
        assert!(bits.len() >= 64 && out.len() >= 64, "64 lanes");
        let zero = _mm512_setzero_si512();
        let one = _mm512_set1_epi32(1);
        let last = _mm512_set1_epi32(self.values.len() as i32 - 1);
        let as_ps = _mm512_castsi512_ps;
        let lo: [__m512i; 4] = std::array::from_fn(|m| {
            let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(y[m], _mm512_set1_ps(steps)),
            );
            // Out-of-range products convert to i32::MIN; the clamp and the check catch them.
            let c = _mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(origin));
            _mm512_min_epi32(_mm512_max_epi32(c, zero), last)
        });
        let hi: [__m512i; 4] =
            std::array::from_fn(|m| _mm512_min_epi32(_mm512_add_epi32(lo[m], one), last));
        // The grid's values computed (`grid_values16`, the value table's bits): faster than
        // looking them up from the byte tables.
        let o = _mm512_set1_epi32(origin);
        let lo_v = lo.map(|c| _mm512_castps_si512(grid_values16(_mm512_sub_epi32(c, o), steps)));
        let hi_v = hi.map(|c| _mm512_castps_si512(grid_values16(_mm512_sub_epi32(c, o), steps)));
        let mut ok = true;
        let mut top = [0; 4];
        for m in 0..4 {
            top[m] = _mm512_cmpeq_epi32_mask(lo[m], last);
            let at_or_above = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(as_ps(lo_v[m]), y[m]);
            let below_next = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(y[m], as_ps(hi_v[m]));
            ok &= at_or_above & (below_next | top[m]) == 0xFFFF;
        }
        if !ok {
            return false;
        }
        for m in 0..4 {
            let (lo_v, hi_v) = (as_ps(lo_v[m]), as_ps(hi_v[m]));
            // SAFETY: `16 m + 16 <= 64 <= bits.len()` (asserted); the load is unaligned.
            let r = unsafe { _mm512_loadu_si512(bits.as_ptr().add(16 * m).cast()) };
            let code = stochastic_step(y[m], lo[m], lo_v, hi_v, top[m], r);
            // SAFETY: `16 m + 16 <= 64 <= out.len()` (asserted); the store is unaligned.
            unsafe {
                _mm_storeu_si128(
                    out.as_mut_ptr().add(16 * m).cast(),
                    _mm512_cvtepi32_epi8(code),
                )
            };
        }
        true
    }
}
