//! The AVX-512 kernels for CPUs without VBMI (Skylake-SP, Cascade Lake): 32 lanes of 16-bit
//! words, the value, threshold and key tables held in registers as 16-bit planes and looked up
//! with `vpermi2w` (AVX-512 BW) instead of gathered: nearest rounding from the key table and
//! decoding, over runs of blocks. Entered after run-time detection of AVX-512 F/BW/VL/DQ.
//!
//! A gather costs at least a load per lane (more on Intel parts whose microcode mitigates GDS,
//! "Downfall"); a lookup from registers costs four permutes and three blends per 32 words of a
//! 256-entry plane, whatever the indices.

use super::CodeMap;
use super::avx512::{lanes_for, quotient_lanes};
use super::search::KeyTable;
use super::slices::BlockOf;

use std::arch::x86_64::{__m512, __m512i};

/// A 256-entry table of 16-bit words in registers: `[q]` holds entries `32 q .. 32 q + 32`.
type WordTable = [__m512i; 8];

/// The 8 registers of one 256-entry plane of `words` (256 u16 at `256 * plane`).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn load_words(words: &[u16], plane: usize) -> WordTable {
    use std::arch::x86_64::*;
    let plane = &words[256 * plane..256 * plane + 256];
    // SAFETY: `32 q + 32 <= 256 = plane.len()`; the loads are unaligned.
    std::array::from_fn(|q| unsafe { _mm512_loadu_si512(plane[32 * q..].as_ptr().cast()) })
}

/// Entries `index[j]` (32 words, each below 256) of a 256-entry word table: a `vpermi2w` for
/// each 64-entry quarter (the index's low six bits), the quarter chosen by bits 6 and 7.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn lookup_words(table: &WordTable, index: __m512i) -> __m512i {
    use std::arch::x86_64::*;
    let quarter: [__m512i; 4] =
        std::array::from_fn(|k| _mm512_permutex2var_epi16(table[2 * k], index, table[2 * k + 1]));
    let b6 = _mm512_test_epi16_mask(index, _mm512_set1_epi16(64));
    let b7 = _mm512_test_epi16_mask(index, _mm512_set1_epi16(128));
    let low = _mm512_mask_blend_epi16(b6, quarter[0], quarter[1]);
    let high = _mm512_mask_blend_epi16(b6, quarter[2], quarter[3]);
    _mm512_mask_blend_epi16(b7, low, high)
}

/// Entries `index[j]` (32 words, each below 256) of a 256-entry table of 32-bit patterns held as
/// its low and high halves (`halves`), as two registers of 16 lanes in order: lanes `0..16` and
/// `16..32`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn lookup32(halves: &[WordTable; 2], index: __m512i) -> [__m512i; 2] {
    use std::arch::x86_64::*;
    // The unpacks below interleave within 128-bit lanes: word 8 L + r of the reordered index
    // (L < 4, r < 8) is index 4 L + r for r < 4 and 16 + 4 L + (r - 4) from 4 up, so that the
    // low unpack holds entries 0..16 in order and the high one entries 16..32.
    let order: [u16; 32] = std::array::from_fn(|j| {
        let (l, r) = (j / 8, j % 8);
        (if r < 4 { 4 * l + r } else { 16 + 4 * l + r - 4 }) as u16
    });
    // SAFETY: `order` is 32 u16; the load is unaligned.
    let order = unsafe { _mm512_loadu_si512(order.as_ptr().cast()) };
    let index = _mm512_permutexvar_epi16(order, index);
    let low = lookup_words(&halves[0], index);
    let high = lookup_words(&halves[1], index);
    [
        _mm512_unpacklo_epi16(low, high),
        _mm512_unpackhi_epi16(low, high),
    ]
}

/// The [`KeyTable`] keys of 32 lanes `y` (two registers of 16) as 32 words in order, from the
/// table's metadata in registers (`meta`: its 64 words); `None` if a lane is not below 2 in
/// magnitude (NaN and ±Inf included), which the key table does not cover. Shared by the
/// word-table and the VBMI kernels.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn bucket_keys(meta: &[__m512i; 2], y: [__m512; 2]) -> Option<__m512i> {
    use std::arch::x86_64::*;
    // The top 16 bits of each lane (sign, exponent, 7 mantissa bits).
    let odd: [i16; 32] = std::array::from_fn(|j| 2 * j as i16 + 1);
    // SAFETY: `odd` is 32 i16; the load is unaligned.
    let odd = unsafe { _mm512_loadu_si512(odd.as_ptr().cast()) };
    let h = _mm512_permutex2var_epi16(_mm512_castps_si512(y[0]), odd, _mm512_castps_si512(y[1]));
    let magnitude = _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF));
    // |y| < 2: exponent at most 127.
    if _mm512_cmpge_epu16_mask(magnitude, _mm512_set1_epi16(0x4000)) != 0 {
        return None;
    }
    // sign << 5 | (exponent & 31), the exponent 0 for magnitudes below 2^-30.
    let index = _mm512_ternarylogic_epi32::<0xCA>(
        _mm512_set1_epi16(0x20),
        _mm512_srli_epi16::<10>(h),
        _mm512_srli_epi16::<7>(h),
    );
    let tiny = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(97 << 7));
    let sign = _mm512_and_si512(index, _mm512_set1_epi16(0x20));
    let index = _mm512_mask_mov_epi16(index, tiny, sign);
    let meta = _mm512_permutex2var_epi16(meta[0], index, meta[1]);
    let shift = _mm512_srli_epi16::<12>(meta);
    let base = _mm512_and_si512(meta, _mm512_set1_epi16(0xFFF));
    let mantissa = _mm512_and_si512(h, _mm512_set1_epi16(0x7F));
    Some(_mm512_add_epi16(base, _mm512_srlv_epi16(mantissa, shift)))
}

/// A [`KeyTable`] in registers as word tables: the bucket metadata (64 words, two registers)
/// and the bucket counts as 256 words of two counts each (zeros past the table).
struct KeyWords {
    meta: [__m512i; 2],
    starts: WordTable,
}

impl KeyWords {
    #[target_feature(enable = "avx512f,avx512bw")]
    fn load(keys: &KeyTable) -> KeyWords {
        use std::arch::x86_64::*;
        // SAFETY: `meta` holds 64 u16, two registers of 32; the loads are unaligned.
        let meta = std::array::from_fn(|h| unsafe {
            _mm512_loadu_si512(keys.meta[32 * h..32 * h + 32].as_ptr().cast())
        });
        // Bytes `2 w` and `2 w + 1` of the counts are word `w` (little-endian).
        let starts = std::array::from_fn(|q| match keys.starts.get(64 * q..64 * q + 64) {
            // SAFETY: 64 bytes at `64 q`; the load is unaligned.
            Some(b) => unsafe { _mm512_loadu_si512(b.as_ptr().cast()) },
            None => _mm512_setzero_si512(),
        });
        KeyWords { meta, starts }
    }

    /// [`CodeMap::nearest`] of 32 lanes `y` (two registers of 16) as 32 words in order, as
    /// `KeyLanes::nearest` computes it with byte tables (see [`KeyTable`]); `None` if a lane is
    /// not below 2 in magnitude (NaN and ±Inf included).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn nearest(&self, thresholds: &[WordTable; 2], y: [__m512; 2]) -> Option<__m512i> {
        use std::arch::x86_64::*;
        let key = bucket_keys(&self.meta, y)?;
        // Count `key` is byte `key & 1` of word `key >> 1`.
        let pair = lookup_words(&self.starts, _mm512_srli_epi16::<1>(key));
        let odd_byte = _mm512_slli_epi16::<3>(_mm512_and_si512(key, _mm512_set1_epi16(1)));
        let start = _mm512_and_si512(_mm512_srlv_epi16(pair, odd_byte), _mm512_set1_epi16(0xFF));
        let t = lookup32(thresholds, start);
        let le = [0, 1]
            .map(|m| _mm512_cmp_ps_mask::<_CMP_LE_OQ>(_mm512_castsi512_ps(t[m]), y[m]) as u32);
        let le = le[0] | le[1] << 16;
        Some(_mm512_mask_add_epi16(
            start,
            le,
            start,
            _mm512_set1_epi16(1),
        ))
    }
}

impl CodeMap {
    /// [`CodeMap::decode_scaled`] over a run of blocks, 32 codes at a time without gathers
    /// ([`lookup32`] of the values' 16-bit halves). Returns how many leading codes it decoded (a
    /// multiple of 32); the caller decodes the rest.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn decode_scaled_words(
        &self,
        codes: &[u8],
        scales: &[f32],
        block: usize,
        out: &mut [f32],
    ) -> usize {
        use std::arch::x86_64::*;
        let Some(n) = lanes_for(codes.len().min(out.len()), scales, block) else {
            return 0;
        };
        let whole = n - n % 32;
        let table = [load_words(&self.words, 0), load_words(&self.words, 1)];
        let at = BlockOf::new(block);
        for i in (0..whole).step_by(32) {
            // SAFETY: `i + 32 <= codes.len()`; the load is unaligned.
            let c = unsafe { _mm256_loadu_si256(codes.as_ptr().add(i).cast()) };
            for (m, v) in lookup32(&table, _mm512_cvtepu8_epi16(c))
                .into_iter()
                .enumerate()
            {
                let s = _mm512_set1_ps(scales[at.of(i + 16 * m)]);
                let v = _mm512_mul_ps(_mm512_castsi512_ps(v), s);
                // SAFETY: `i + 16 m + 16 <= out.len()`; the store is unaligned.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i + 16 * m), v) };
            }
        }
        whole
    }

    /// [`CodeMap::nearest_scaled`] over a run of blocks, 32 elements at a time from the key
    /// table and the thresholds' 16-bit halves in registers ([`KeyWords::nearest`]); a group
    /// with a lane the key table does not cover (a magnitude of 2 or more, NaN) takes the
    /// gathers. Returns how many leading elements it rounded (a multiple of 32; none for a map
    /// without a key table).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn nearest_scaled_words(
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
        let Some(keys) = &self.keys else {
            return 0;
        };
        // A key table exists only where the thresholds fit 256 entries (`CodeMap::from_values`).
        let words = &self.threshold_words;
        let thresholds = [load_words(words, 0), load_words(words, 1)];
        let keys = KeyWords::load(keys);
        let whole = n - n % 32;
        let at = BlockOf::new(block);
        for i in (0..whole).step_by(32) {
            let y: [__m512; 2] = std::array::from_fn(|m| {
                let a = scales[at.of(i + 16 * m)];
                quotient_lanes(&xs[i + 16 * m..], a, _mm512_set1_ps(a))
            });
            match keys.nearest(&thresholds, y) {
                Some(c) => {
                    // SAFETY: `i + 32 <= out.len()`; the store is unaligned.
                    unsafe {
                        _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), _mm512_cvtepi16_epi8(c))
                    };
                }
                None => {
                    for (m, y) in y.into_iter().enumerate() {
                        let c = _mm512_cvtepi32_epi8(self.nearest_lanes(y));
                        // SAFETY: `i + 16 m + 16 <= out.len()`; the store is unaligned.
                        unsafe { _mm_storeu_si128(out.as_mut_ptr().add(i + 16 * m).cast(), c) };
                    }
                }
            }
        }
        whole
    }
}
