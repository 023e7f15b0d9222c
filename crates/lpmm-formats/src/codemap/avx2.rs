//! The AVX2 kernels (8 lanes, gathers from the scalar search's tables): nearest rounding and
//! decoding of one block, entered after run-time detection of AVX2 and FMA.

use super::CodeMap;
use super::search::BUCKET_SHIFT;

impl CodeMap {
    /// [`CodeMap::nearest_scaled`] 8 elements at a time with AVX2 gathers: the bucket's start
    /// code and each scan step read the same tables the scalar search reads.
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
        let one = _mm256_set1_epi32(1);
        for i in (0..whole).step_by(8) {
            // SAFETY: `i + 8 <= xs.len()`; the load is unaligned.
            let y = _mm256_div_ps(unsafe { _mm256_loadu_ps(xs.as_ptr().add(i)) }, divisor);
            let bucket = _mm256_srli_epi32::<{ BUCKET_SHIFT as i32 }>(_mm256_castps_si256(y));
            // SAFETY: buckets are < 2^16 and `start` holds 2^16 entries plus 3 bytes of padding,
            // so each 4-byte read stays inside it.
            let g = unsafe { _mm256_i32gather_epi32::<1>(self.start.as_ptr().cast(), bucket) };
            let mut c = _mm256_and_si256(g, _mm256_set1_epi32(0xFF));
            for _ in 0..self.scan {
                // SAFETY: as in `nearest`: `c` never exceeds `thresholds.len() + steps so far`,
                // and `padded` holds `scan` entries past the thresholds.
                let t = unsafe { _mm256_i32gather_ps::<4>(self.padded.as_ptr(), c) };
                let le = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(t, y));
                c = _mm256_add_epi32(c, _mm256_and_si256(le, one));
            }
            // NaN gives code 0, as in `nearest`.
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(y, y));
            let c = _mm256_andnot_si256(nan, c);
            let mut lanes = [0u32; 8];
            // SAFETY: `lanes` is 8 u32; the store is unaligned.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), c) };
            for (o, &l) in out[i..i + 8].iter_mut().zip(&lanes) {
                *o = l as u8;
            }
        }
        self.nearest_scaled_portable(&xs[whole..n], absmax, &mut out[whole..n]);
    }

    /// [`CodeMap::decode_scaled`] 8 codes at a time with AVX2 gathers of the values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn decode_scaled_avx2(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = codes.len().min(out.len());
        let whole = n - n % 8;
        let last = _mm256_set1_epi32(self.values.len() as i32 - 1);
        let s = _mm256_set1_ps(scale);
        for i in (0..whole).step_by(8) {
            let mut c8 = [0u8; 16];
            c8[..8].copy_from_slice(&codes[i..i + 8]);
            // SAFETY: `c8` is 16 bytes; the load is unaligned.
            let c8 = unsafe { _mm_loadu_si128(c8.as_ptr().cast()) };
            let c = _mm256_min_epu32(_mm256_cvtepu8_epi32(c8), last);
            // SAFETY: every index is clamped to `values.len() - 1`.
            let v = unsafe { _mm256_i32gather_ps::<4>(self.values.as_ptr(), c) };
            // SAFETY: `i + 8 <= out.len()`; the store is unaligned.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(v, s)) };
        }
        self.decode_scaled_portable(&codes[whole..n], scale, &mut out[whole..n]);
    }
}
