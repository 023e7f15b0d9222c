//! The AVX-512 VBMI kernels (64 lanes; the value and threshold tables held in registers as
//! byte planes and looked up with `vpermi2b`, only the bucket table gathered): nearest and
//! stochastic rounding and decoding over runs of blocks (uniform grids' stochastic rounding is
//! `avx512.rs`'s 64-lane kernel, which needs no byte permutes). Entered after run-time detection
//! of AVX-512 F/BW/VL and VBMI.

use super::CodeMap;
use super::avx512::{lanes_for, quotients64, stochastic_step};
use super::search::{BUCKET_SHIFT, KeyTable};
use super::slices::BlockOf;
use super::words::bucket_keys;

/// The 16 registers of a 256-entry byte-plane table (`planes`: 4 x 256 bytes, see
/// `CodeMap::planes`): `[p][q]` holds entries `64 q .. 64 q + 64` of plane `p`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn load_planes(planes: &[u8]) -> [[std::arch::x86_64::__m512i; 4]; 4] {
    use std::arch::x86_64::*;
    assert!(planes.len() >= 1024, "four planes of 256 entries");
    std::array::from_fn(|p| {
        std::array::from_fn(|q| {
            let at = 256 * p + 64 * q;
            // SAFETY: `at + 64 <= 1024 <= planes.len()` (asserted); the load is unaligned.
            unsafe { _mm512_loadu_si512(planes[at..at + 64].as_ptr().cast()) }
        })
    })
}

/// The 64 codes of four registers of 16 (each below 256) as the bytes of one, in order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn pack_codes(c: [std::arch::x86_64::__m512i; 4]) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let z = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(c[0]));
    let z = _mm512_inserti32x4::<1>(z, _mm512_cvtepi32_epi8(c[1]));
    let z = _mm512_inserti32x4::<2>(z, _mm512_cvtepi32_epi8(c[2]));
    _mm512_inserti32x4::<3>(z, _mm512_cvtepi32_epi8(c[3]))
}

/// The 64 codes of one register of bytes as four registers of 16 32-bit lanes, in order: the
/// inverse of [`pack_codes`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn unpack_codes(packed: std::arch::x86_64::__m512i) -> [std::arch::x86_64::__m512i; 4] {
    use std::arch::x86_64::*;
    [
        _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<0>(packed)),
        _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<1>(packed)),
        _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<2>(packed)),
        _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<3>(packed)),
    ]
}

/// Entries `codes[j]` (64 byte indices) of a 256-entry table of 32-bit patterns held as byte
/// planes in registers ([`load_planes`]), without gathers: each byte plane is looked up from two
/// 128-entry halves (`vpermi2b`) chosen by the code's top bit, and the four planes are
/// interleaved back into 32-bit lanes. Register `m` of the result holds entries for codes
/// `16 m .. 16 m + 16`, in order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
#[inline]
fn lookup64(
    table: &[[std::arch::x86_64::__m512i; 4]; 4],
    codes: std::arch::x86_64::__m512i,
) -> [std::arch::x86_64::__m512i; 4] {
    use std::arch::x86_64::*;
    // The unpacks below interleave within 128-bit lanes: reorder the codes first so that
    // register m holds entries 16 m .. 16 m + 15 in order (byte 16 k + 4 m + i of the reordered
    // codes is code 16 m + 4 k + i).
    let order: [u8; 64] =
        std::array::from_fn(|j| (16 * ((j % 16) / 4) + 4 * (j / 16) + j % 4) as u8);
    // SAFETY: `order` is 64 bytes; the load is unaligned.
    let order = unsafe { _mm512_loadu_si512(order.as_ptr().cast()) };
    let c = _mm512_permutexvar_epi8(order, codes);
    let upper = _mm512_movepi8_mask(c);
    let b: [__m512i; 4] = std::array::from_fn(|p| {
        let [t0, t1, t2, t3] = table[p];
        let lo = _mm512_permutex2var_epi8(t0, c, t1);
        let hi = _mm512_permutex2var_epi8(t2, c, t3);
        _mm512_mask_blend_epi8(upper, lo, hi)
    });
    let w01 = [
        _mm512_unpacklo_epi8(b[0], b[1]),
        _mm512_unpackhi_epi8(b[0], b[1]),
    ];
    let w23 = [
        _mm512_unpacklo_epi8(b[2], b[3]),
        _mm512_unpackhi_epi8(b[2], b[3]),
    ];
    [
        _mm512_unpacklo_epi16(w01[0], w23[0]),
        _mm512_unpackhi_epi16(w01[0], w23[0]),
        _mm512_unpacklo_epi16(w01[1], w23[1]),
        _mm512_unpackhi_epi16(w01[1], w23[1]),
    ]
}

/// A [`KeyTable`] in registers: the bucket metadata as two 32-entry word tables, the bucket
/// counts as up to four 128-entry halves of byte tables (zeros past the table).
struct KeyLanes {
    meta: [std::arch::x86_64::__m512i; 2],
    starts: [[std::arch::x86_64::__m512i; 2]; 4],
}

impl KeyLanes {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    fn load(keys: &KeyTable) -> KeyLanes {
        use std::arch::x86_64::*;
        // SAFETY: `meta` holds 64 u16, two registers of 32; the loads are unaligned.
        let meta = std::array::from_fn(|h| unsafe {
            _mm512_loadu_si512(keys.meta[32 * h..32 * h + 32].as_ptr().cast())
        });
        let starts = std::array::from_fn(|q| {
            std::array::from_fn(|h| {
                let at = 128 * q + 64 * h;
                match keys.starts.get(at..at + 64) {
                    // SAFETY: 64 bytes at `at`; the load is unaligned.
                    Some(b) => unsafe { _mm512_loadu_si512(b.as_ptr().cast()) },
                    None => _mm512_setzero_si512(),
                }
            })
        });
        KeyLanes { meta, starts }
    }

    /// [`CodeMap::nearest`] of 64 lanes `y` (four registers of 16) as 64 bytes in order, from the
    /// key table and the threshold planes; `None` if a lane is not below 2 in magnitude (NaN and
    /// ±Inf included), which the key table does not cover.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    #[inline]
    fn nearest(
        &self,
        thresholds: &[[std::arch::x86_64::__m512i; 4]; 4],
        y: [std::arch::x86_64::__m512; 4],
    ) -> Option<std::arch::x86_64::__m512i> {
        use std::arch::x86_64::*;
        let keys = [
            bucket_keys(&self.meta, [y[0], y[1]])?,
            bucket_keys(&self.meta, [y[2], y[3]])?,
        ];
        // The keys' low bytes (table index) and their bits from 7 up (which half).
        let even: [u8; 64] = std::array::from_fn(|j| 2 * j as u8);
        // SAFETY: `even` is 64 bytes; the load is unaligned.
        let even = unsafe { _mm512_loadu_si512(even.as_ptr().cast()) };
        let low = _mm512_permutex2var_epi8(keys[0], even, keys[1]);
        let high = _mm512_permutex2var_epi8(
            _mm512_srli_epi16::<7>(keys[0]),
            even,
            _mm512_srli_epi16::<7>(keys[1]),
        );
        let half = self
            .starts
            .map(|[a, b]| _mm512_permutex2var_epi8(a, low, b));
        let odd_half = _mm512_test_epi8_mask(high, _mm512_set1_epi8(1));
        let upper = _mm512_test_epi8_mask(high, _mm512_set1_epi8(2));
        let start = _mm512_mask_blend_epi8(
            upper,
            _mm512_mask_blend_epi8(odd_half, half[0], half[1]),
            _mm512_mask_blend_epi8(odd_half, half[2], half[3]),
        );
        let t = lookup64(thresholds, start);
        let le = [0, 1, 2, 3]
            .map(|m| _mm512_cmp_ps_mask::<_CMP_LE_OQ>(_mm512_castsi512_ps(t[m]), y[m]) as u64);
        let le = le[0] | le[1] << 16 | le[2] << 32 | le[3] << 48;
        Some(_mm512_mask_add_epi8(start, le, start, _mm512_set1_epi8(1)))
    }
}
impl CodeMap {
    /// [`CodeMap::decode_scaled`] 64 codes at a time without gathers ([`lookup64`]). Returns
    /// how many leading codes it decoded (a multiple of 64); the caller decodes the rest.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    pub(super) fn decode_scaled_vbmi(
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
        let whole = n - n % 64;
        let table = load_planes(&self.planes);
        let at = BlockOf::new(block);
        for i in (0..whole).step_by(64) {
            // SAFETY: `i + 64 <= codes.len()`; the load is unaligned.
            let c = unsafe { _mm512_loadu_si512(codes.as_ptr().add(i).cast()) };
            for (m, d) in lookup64(&table, c).into_iter().enumerate() {
                let s = _mm512_set1_ps(scales[at.of(i + 16 * m)]);
                let v = _mm512_mul_ps(_mm512_castsi512_ps(d), s);
                // SAFETY: `i + 16 m + 16 <= out.len()`; the store is unaligned.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i + 16 * m), v) };
            }
        }
        whole
    }

    /// [`CodeMap::nearest`] of 64 lanes (four registers), as `nearest_lanes` computes it with
    /// `scan == 1`: the bucket's start code (gathered from the 64 KiB table), then one threshold
    /// step with the threshold from register tables ([`lookup64`]); NaN gives code 0.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    #[inline]
    fn nearest_vbmi(
        &self,
        thresholds: &[[std::arch::x86_64::__m512i; 4]; 4],
        y: [std::arch::x86_64::__m512; 4],
    ) -> [std::arch::x86_64::__m512i; 4] {
        use std::arch::x86_64::*;
        let start: [__m512i; 4] = std::array::from_fn(|m| {
            let bucket = _mm512_srli_epi32::<{ BUCKET_SHIFT }>(_mm512_castps_si512(y[m]));
            // SAFETY: buckets are < 2^16 and `start` holds 2^16 entries plus 3 bytes of padding,
            // so each 4-byte read stays inside it.
            let g = unsafe { _mm512_i32gather_epi32::<1>(bucket, self.start.as_ptr().cast()) };
            _mm512_and_si512(g, _mm512_set1_epi32(0xFF))
        });
        let t = lookup64(thresholds, pack_codes(start));
        std::array::from_fn(|m| {
            let le = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(_mm512_castsi512_ps(t[m]), y[m]);
            let c = _mm512_mask_add_epi32(start[m], le, start[m], _mm512_set1_epi32(1));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y[m], y[m]);
            _mm512_mask_mov_epi32(c, nan, _mm512_setzero_si512())
        })
    }

    /// [`CodeMap::nearest_scaled`] 64 elements at a time ([`CodeMap::nearest_vbmi`]). Returns
    /// how many leading elements it rounded (a multiple of 64; none unless every bucket holds
    /// at most one threshold).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    pub(super) fn nearest_scaled_vbmi(
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
        if self.scan != 1 || self.threshold_planes.is_empty() {
            return 0;
        }
        let whole = n - n % 64;
        let thresholds = load_planes(&self.threshold_planes);
        let keys = self.keys.as_ref().map(|k| KeyLanes::load(k));
        for i in (0..whole).step_by(64) {
            let y = quotients64(&xs[i..i + 64], scales, i, block);
            if let Some(keys) = &keys
                && let Some(c) = keys.nearest(&thresholds, y)
            {
                // SAFETY: `i + 64 <= out.len()`; the store is unaligned.
                unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(i).cast(), c) };
                continue;
            }
            for (m, c) in self.nearest_vbmi(&thresholds, y).into_iter().enumerate() {
                // SAFETY: `i + 16 m + 16 <= out.len()`; the store is unaligned.
                unsafe {
                    _mm_storeu_si128(
                        out.as_mut_ptr().add(i + 16 * m).cast(),
                        _mm512_cvtepi32_epi8(c),
                    )
                };
            }
        }
        whole
    }

    /// [`CodeMap::stochastic`] 64 lanes at a time, step for step as in
    /// [`CodeMap::stochastic_scaled_gather`], with the threshold and the two value lookups from
    /// register tables ([`lookup64`]); only the bucket table (64 KiB) is gathered. Returns how
    /// many leading elements it rounded (a multiple of 64; none unless every bucket holds at
    /// most one threshold).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    pub(super) fn stochastic_scaled_vbmi(
        &self,
        xs: &[f32],
        scales: &[f32],
        block: usize,
        bits: &[u32],
        out: &mut [u8],
    ) -> usize {
        use std::arch::x86_64::*;
        if self.grid.is_some() {
            return self.stochastic_blocks_avx512(xs, scales, block, bits, out);
        }
        let Some(n) = lanes_for(xs.len().min(out.len()).min(bits.len()), scales, block) else {
            return 0;
        };
        if self.scan != 1 || self.threshold_planes.is_empty() {
            return 0;
        }
        let whole = n - n % 64;
        let values = load_planes(&self.planes);
        let thresholds = load_planes(&self.threshold_planes);
        let zero = _mm512_setzero_si512();
        let one = _mm512_set1_epi32(1);
        let last = _mm512_set1_epi32(self.values.len() as i32 - 1);
        let as_ps = _mm512_castsi512_ps;
        let keys = self.keys.as_ref().map(|k| KeyLanes::load(k));
        for i in (0..whole).step_by(64) {
            let y = quotients64(&xs[i..i + 64], scales, i, block);
            let nan: [__mmask16; 4] =
                std::array::from_fn(|m| _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y[m], y[m]));
            // The nearest code from the key table in registers where it covers every lane (the
            // same codes: `KeyLanes::nearest`), else from the gathered bucket table.
            let (c, packed) = match keys.as_ref().and_then(|k| k.nearest(&thresholds, y)) {
                Some(packed) => (unpack_codes(packed), packed),
                None => {
                    let c = self.nearest_vbmi(&thresholds, y);
                    (c, pack_codes(c))
                }
            };
            let vc = lookup64(&values, packed);
            let mut lo = [zero; 4];
            let mut hi = [zero; 4];
            let mut other = [zero; 4];
            let mut under = [0; 4];
            for m in 0..4 {
                let below = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(as_ps(vc[m]), y[m]);
                under[m] = below & _mm512_cmpeq_epi32_mask(c[m], zero);
                lo[m] = _mm512_max_epi32(_mm512_mask_sub_epi32(c[m], below, c[m], one), zero);
                hi[m] = _mm512_min_epi32(_mm512_add_epi32(lo[m], one), last);
                let lo_is_c = _mm512_cmpeq_epi32_mask(lo[m], c[m]);
                other[m] = _mm512_mask_mov_epi32(lo[m], lo_is_c, hi[m]);
            }
            let ov = lookup64(&values, pack_codes(other));
            for m in 0..4 {
                let lo_v = _mm512_mask_mov_ps(
                    as_ps(ov[m]),
                    _mm512_cmpeq_epi32_mask(lo[m], c[m]),
                    as_ps(vc[m]),
                );
                let hi_v = _mm512_mask_mov_ps(
                    as_ps(ov[m]),
                    _mm512_cmpeq_epi32_mask(hi[m], c[m]),
                    as_ps(vc[m]),
                );
                let top = _mm512_cmpeq_epi32_mask(lo[m], last);
                // SAFETY: `i + 16 m + 16 <= bits.len()`; the load is unaligned.
                let r = unsafe { _mm512_loadu_si512(bits.as_ptr().add(i + 16 * m).cast()) };
                let code = stochastic_step(y[m], lo[m], lo_v, hi_v, top, r);
                let code = _mm512_mask_mov_epi32(code, under[m] | nan[m], zero);
                // SAFETY: `i + 16 m + 16 <= out.len()`; the store is unaligned.
                unsafe {
                    _mm_storeu_si128(
                        out.as_mut_ptr().add(i + 16 * m).cast(),
                        _mm512_cvtepi32_epi8(code),
                    )
                };
            }
        }
        whole
    }
}
