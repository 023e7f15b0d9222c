//! Code maps: sorted tables of at most 2^bits values in [-1, 1] that a code indexes. A block-wise
//! quantizer stores `code` and a scale; the value is `map[code] * scale`.
//!
//! Every map here is built by code, reproducing the anchors' constructions (bitsandbytes'
//! `create_dynamic_map`, `create_normal_map`, lpmm's linear maps) including the f32 arithmetic
//! they do, so the 8-bit dynamic maps equal bitsandbytes' bit for bit (tested against
//! `shared/spec/dynamic-map-8bit.tsv`).

use crate::error::FormatError;
use crate::float::Rounding;

/// A sorted table of code values with its precomputed decision thresholds.
#[derive(Clone)]
pub struct CodeMap {
    bits: u32,
    values: Box<[f32]>,
    /// `thresholds[j]` is the smallest f32 whose nearest code is above `j`; see [`CodeMap::nearest`].
    thresholds: Box<[f32]>,
    /// A search accelerator: `start[bucket(y)]` is a lower bound of `nearest(y)`, exact for the
    /// lowest value of the bucket, so `nearest` only scans the few thresholds inside the bucket.
    start: Box<[u8]>,
    /// The most thresholds any bucket holds: `nearest` takes this many branch-free steps.
    scan: usize,
    /// `thresholds` followed by `scan` NaNs, so the steps never leave the table (`NaN <= y` is
    /// false for every `y`).
    padded: Box<[f32]>,
    /// The values' bytes as four planes of 256 entries (byte `p` of entry `c` at `256 p + c`;
    /// entries past the end repeat the last value, as [`CodeMap::value`] reads them): the
    /// AVX-512 VBMI decoder looks values up from registers instead of gathering them.
    planes: Box<[u8]>,
    /// `padded` as four byte planes of 256 entries (entries past it are NaN), when it fits
    /// (every map whose buckets hold at most one threshold): the VBMI stochastic rounding
    /// looks thresholds up from registers. Empty otherwise.
    threshold_planes: Box<[u8]>,
    /// `Some((o, l))` when the map is a uniform grid: `values[c] == f32(c - o) / f32(l)` (one
    /// f32 division) for every code, as [`CodeMap::linear_signed`] (`o = l`) and
    /// [`CodeMap::linear_unsigned`] (`o = 0`) build them. The VBMI stochastic rounding then
    /// estimates the lower code as `floor(y * l) + o`, checks it against the two values around
    /// it and searches only the 64 lanes where the estimate is off.
    grid: Option<(i32, f32)>,
    /// The search accelerator of the VBMI nearest kernel, when the map allows one: see
    /// [`KeyTable`].
    keys: Option<KeyTable>,
}

/// A small bucket table the VBMI nearest kernel reads from registers instead of gathering from
/// the 64 KiB `CodeMap::start` table. Buckets have a resolution per binade: the bucket of an f32
/// `y` with `|y| < 2` and top 16 bits `h` (sign, exponent `e`, 7 mantissa bits `m`) is
///
/// ```text
/// key = base[s, b] + (m >> shift[s, b])      s = sign, b = e - 96 (0 for e <= 96)
/// ```
///
/// so binade `b` of sign `s` holds `2^(7 - shift)` buckets (one for every exponent up to 96, the
/// magnitudes below 2^-30), each as fine as it must be to hold at most one threshold.
/// `starts[key]` is the number of thresholds at or below the bucket's lowest value, so
/// `nearest(y) = starts[key] + (thresholds[starts[key]] <= y)`, as with `CodeMap::start`. Built
/// only when at most [`KeyTable::MAX`] buckets do it (every shipped 8-bit map: 304 to 452).
#[derive(Clone)]
struct KeyTable {
    /// `base | shift << 12` by `s << 5 | b`.
    meta: [u16; 64],
    /// The bucket counts, padded with zeros to a multiple of 128 entries.
    starts: Box<[u8]>,
}

impl KeyTable {
    /// The most buckets: four 128-entry halves of byte-permute tables.
    const MAX: usize = 512;

    /// The key table of `thresholds`, if at most [`KeyTable::MAX`] buckets of at most one
    /// threshold each cover every `|y| < 2`.
    fn new(thresholds: &[f32]) -> Option<KeyTable> {
        let count = |y: f32| thresholds.partition_point(|&t| t <= y);
        // The lowest and highest value of bucket `k` of binade `b` of sign `s` cut into `2^w`
        // buckets (binade 0: every exponent up to 96, one bucket).
        let bucket = |s: u32, b: u32, w: u32, k: u32| {
            let (lo, hi) = if b == 0 {
                (0, (97 << 23) - 1)
            } else {
                let (e, shift) = ((96 + b) << 23, 23 - w);
                (e | (k << shift), e | (((k + 1) << shift) - 1))
            };
            let (a, z) = (f32::from_bits(s << 31 | lo), f32::from_bits(s << 31 | hi));
            if s == 0 { (a, z) } else { (z, a) }
        };
        let mut meta = [0u16; 64];
        let mut starts = Vec::new();
        for s in 0..2u32 {
            for b in 0..32u32 {
                // The fewest mantissa bits that leave at most one threshold in every bucket.
                let widths = if b == 0 { 0..=0 } else { 0..=7 };
                let w = widths.into_iter().find(|&w| {
                    (0..1u32 << w).all(|k| {
                        let (lo, hi) = bucket(s, b, w, k);
                        count(hi) - count(lo) <= 1
                    })
                })?;
                meta[(s << 5 | b) as usize] =
                    u16::try_from(starts.len()).ok()? | ((7 - w) as u16) << 12;
                for k in 0..1u32 << w {
                    starts.push(u8::try_from(count(bucket(s, b, w, k).0)).ok()?);
                }
            }
        }
        if starts.len() > Self::MAX {
            return None;
        }
        starts.resize(starts.len().div_ceil(128) * 128, 0);
        Some(KeyTable {
            meta,
            starts: starts.into(),
        })
    }
}

/// Four byte planes of 256 entries of `table` (`f32` bit patterns; entries past the end read
/// `fill`): byte `p` of entry `c` at `256 p + c`.
fn byte_planes(table: &[f32], fill: f32) -> Box<[u8]> {
    (0..4)
        .flat_map(|p| {
            (0..256).map(move |c: usize| {
                let v = table.get(c).copied().unwrap_or(fill);
                (v.to_bits() >> (8 * p)) as u8
            })
        })
        .collect()
}

/// `Some((o, l))` if `values[c] == f32(c - o) / f32(l)` for every code `c`, with `l` the
/// number of steps from the origin code `o` (the code of 0) to the last (see `CodeMap::grid`).
fn uniform_grid(values: &[f32]) -> Option<(i32, f32)> {
    let origin = values.iter().position(|&v| v == 0.0)?;
    let steps = values.len() - 1 - origin;
    if steps == 0 {
        return None;
    }
    let (o, l) = (i32::try_from(origin).ok()?, steps as f32);
    let on_grid = values
        .iter()
        .enumerate()
        .all(|(c, &v)| v.to_bits() == ((c as i32 - o) as f32 / l).to_bits());
    on_grid.then_some((o, l))
}

/// Buckets are the top `1 + 8 + BUCKET_MANTISSA_BITS` bits of an f32: sign, exponent and the
/// first mantissa bits (2^16 one-byte entries, 64 KiB): fine enough that every bucket of the
/// shipped maps holds at most one threshold, so a search is one table read and one comparison.
const BUCKET_MANTISSA_BITS: u32 = 7;
const BUCKET_SHIFT: u32 = 23 - BUCKET_MANTISSA_BITS;

#[inline]
fn bucket(y: f32) -> usize {
    (y.to_bits() >> BUCKET_SHIFT) as usize
}

/// The lowest and highest non-NaN f32 whose bit patterns fall in `bucket` (None for NaN-only
/// buckets). Positive patterns grow with the value, negative ones shrink.
fn bucket_range(bucket: usize) -> Option<(f32, f32)> {
    let base = (bucket as u32) << BUCKET_SHIFT;
    let top = base | ((1 << BUCKET_SHIFT) - 1);
    let (lo, hi) = if base >> 31 == 0 {
        (base, top)
    } else {
        (top, base)
    };
    let (lo, hi) = (f32::from_bits(lo), f32::from_bits(hi));
    match (lo.is_nan(), hi.is_nan()) {
        (false, false) => Some((lo, hi)),
        (false, true) => Some((lo, f32::INFINITY)),
        (true, false) => Some((f32::NEG_INFINITY, hi)),
        (true, true) => None,
    }
}

/// `x / absmax` of 16 lanes (`divisor` holds `absmax` in every lane), or zeros when `absmax` is 0
/// (those lanes are not divided).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn quotient_lanes(
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

/// Which scale element `j` of a run of blocks uses: `j / block`, a shift for a power of two (every
/// block size the quantizers take).
#[derive(Clone, Copy)]
struct BlockOf {
    block: usize,
    shift: Option<u32>,
}

impl BlockOf {
    fn new(block: usize) -> Self {
        BlockOf {
            block,
            shift: block.is_power_of_two().then(|| block.trailing_zeros()),
        }
    }

    #[inline(always)]
    fn of(self, j: usize) -> usize {
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

/// The quotients `x / scale` of the 64 elements `xs` (at most 64 of them are read), which start
/// at element `start` of a run whose element `j` uses `scales[j / block]` (16 lanes share one
/// scale: see `lanes_for`), as four registers of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn quotients64(
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

/// [`CodeMap::stochastic`]'s last step on 16 lanes: `lo + (r < F)` with `F =
/// u32_saturating(frac * 2^32)`, `frac = (y - lo_v) / (hi_v - lo_v)` in f32, and never above `lo`
/// in the lanes of `top` (`lo` is the last code there).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn stochastic_step(
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

/// How many leading elements of `len` a 64-lane kernel with per-block `scales` (element `j` uses
/// `scales[j / block]`) may process: all those that have a scale, if every 16 lanes share one
/// (`block` a multiple of 16, or a single scale); `None` otherwise.
#[cfg(target_arch = "x86_64")]
fn lanes_for(len: usize, scales: &[f32], block: usize) -> Option<usize> {
    if block == 0 || !(block.is_multiple_of(16) || scales.len() == 1) {
        return None;
    }
    Some(len.min(scales.len().saturating_mul(block)))
}

/// The 16 registers of a 256-entry byte-plane table (`planes`: 4 x 256 bytes, see
/// `CodeMap::planes`): `[p][q]` holds entries `64 q .. 64 q + 64` of plane `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn load_planes(planes: &[u8]) -> [[std::arch::x86_64::__m512i; 4]; 4] {
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
struct KeyLanes {
    meta: [std::arch::x86_64::__m512i; 2],
    starts: [[std::arch::x86_64::__m512i; 2]; 4],
}

#[cfg(target_arch = "x86_64")]
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
        let bits = y.map(|y| _mm512_castps_si512(y));
        // The top 16 bits of each lane (sign, exponent, 7 mantissa bits), 32 lanes a register.
        let odd: [i16; 32] = std::array::from_fn(|j| 2 * j as i16 + 1);
        // SAFETY: `odd` is 32 i16; the load is unaligned.
        let odd = unsafe { _mm512_loadu_si512(odd.as_ptr().cast()) };
        let h = [
            _mm512_permutex2var_epi16(bits[0], odd, bits[1]),
            _mm512_permutex2var_epi16(bits[2], odd, bits[3]),
        ];
        let magnitude = h.map(|h| _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF)));
        // |y| < 2: exponent at most 127.
        let outside = _mm512_cmpge_epu16_mask(magnitude[0], _mm512_set1_epi16(0x4000))
            | _mm512_cmpge_epu16_mask(magnitude[1], _mm512_set1_epi16(0x4000));
        if outside != 0 {
            return None;
        }
        let keys: [__m512i; 2] = std::array::from_fn(|r| {
            // sign << 5 | (exponent & 31), the exponent 0 for magnitudes below 2^-30.
            let index = _mm512_ternarylogic_epi32::<0xCA>(
                _mm512_set1_epi16(0x20),
                _mm512_srli_epi16::<10>(h[r]),
                _mm512_srli_epi16::<7>(h[r]),
            );
            let tiny = _mm512_cmplt_epu16_mask(magnitude[r], _mm512_set1_epi16(97 << 7));
            let sign = _mm512_and_si512(index, _mm512_set1_epi16(0x20));
            let index = _mm512_mask_mov_epi16(index, tiny, sign);
            let meta = _mm512_permutex2var_epi16(self.meta[0], index, self.meta[1]);
            let shift = _mm512_srli_epi16::<12>(meta);
            let base = _mm512_and_si512(meta, _mm512_set1_epi16(0xFFF));
            let mantissa = _mm512_and_si512(h[r], _mm512_set1_epi16(0x7F));
            _mm512_add_epi16(base, _mm512_srlv_epi16(mantissa, shift))
        });
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

/// Two maps are equal when they have the same width and the same value bit patterns (everything
/// else derives from those).
impl PartialEq for CodeMap {
    fn eq(&self, other: &Self) -> bool {
        self.bits == other.bits
            && self.values.len() == other.values.len()
            && self
                .values
                .iter()
                .zip(other.values.iter())
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

impl std::fmt::Debug for CodeMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The thresholds and the search table derive from the values.
        f.debug_struct("CodeMap")
            .field("bits", &self.bits)
            .field("values", &self.values)
            .finish()
    }
}

fn check_bits(bits: u32) -> Result<(), FormatError> {
    if (1..=8).contains(&bits) {
        Ok(())
    } else {
        Err(FormatError::BitWidth { bits })
    }
}

impl CodeMap {
    /// A map from explicit values (e.g. `qmap1` read from a bitsandbytes checkpoint).
    ///
    /// Errors unless `bits` is 1..=8 and `values` holds 2..=2^bits finite, strictly increasing
    /// values in [-1, 1].
    pub fn from_values(bits: u32, values: &[f32]) -> Result<Self, FormatError> {
        check_bits(bits)?;
        if values.len() < 2 || values.len() > 1 << bits {
            return Err(FormatError::CodeMapLength {
                bits,
                len: values.len(),
            });
        }
        for (index, &value) in values.iter().enumerate() {
            if !(-1.0..=1.0).contains(&value) {
                return Err(FormatError::CodeMapOutOfRange { index, value });
            }
            if index > 0 && value <= values[index - 1] {
                return Err(FormatError::CodeMapUnsorted { index, value });
            }
            // The f64 midpoint of two f32 is exact when both are zero-free and their exponents
            // differ by at most 28 (53 - 24 - 1 bits of headroom), or when one of them is zero.
            if index > 0 {
                let prev = values[index - 1];
                let exponent = |v: f32| (v.to_bits() >> 23 & 0xFF).max(1) as i32;
                if prev != 0.0 && value != 0.0 && (exponent(prev) - exponent(value)).abs() > 28 {
                    return Err(FormatError::CodeMapSpread { index });
                }
            }
        }
        let thresholds: Box<[f32]> = values.windows(2).map(|w| threshold(w[0], w[1])).collect();
        let count = |y: f32| thresholds.partition_point(|&t| t <= y);
        let mut scan = 0;
        let start = (0..1usize << (32 - BUCKET_SHIFT))
            .map(|b| match bucket_range(b) {
                Some((lo, hi)) => {
                    scan = scan.max(count(hi) - count(lo));
                    count(lo) as u8
                }
                None => 0, // NaN only: nearest() handles NaN before the table
            })
            // Three bytes of padding: the AVX-512 kernel gathers 4 bytes at each entry.
            .chain([0; 3])
            .collect();
        let padded: Box<[f32]> = thresholds
            .iter()
            .copied()
            .chain(std::iter::repeat_n(f32::NAN, scan))
            .collect();
        let last = values[values.len() - 1];
        let planes = byte_planes(values, last);
        let threshold_planes = if padded.len() <= 256 {
            byte_planes(&padded, f32::NAN)
        } else {
            Box::default()
        };
        // The key table serves the VBMI nearest kernel, which also reads `threshold_planes`.
        let keys = if scan == 1 && !threshold_planes.is_empty() {
            KeyTable::new(&thresholds)
        } else {
            None
        };
        Ok(Self {
            bits,
            keys,
            grid: uniform_grid(values),
            values: values.into(),
            thresholds,
            start,
            scan,
            padded,
            planes,
            threshold_planes,
        })
    }

    /// The width of a code in bits.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// The code values, sorted ascending.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The decision thresholds: `thresholds()[j]` is the smallest f32 `y` whose nearest code is
    /// `j + 1` or above. A GPU kernel can upload this table and reproduce [`CodeMap::nearest`]
    /// with f32 comparisons only.
    pub fn thresholds(&self) -> &[f32] {
        &self.thresholds
    }

    /// The number of codes.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Always false: a map holds at least two values.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The value of `code`; codes past the end decode as the last value.
    #[inline]
    pub fn value(&self, code: u8) -> f32 {
        self.values[usize::from(code).min(self.values.len() - 1)]
    }

    /// The code nearest to `y` in exact arithmetic. Ties (y exactly half-way between two codes)
    /// go to the code of lower magnitude, and to the lower code if both magnitudes are equal.
    /// Values below the first code give code 0, above the last the last code; NaN gives code 0.
    #[inline]
    pub fn nearest(&self, y: f32) -> u8 {
        if y.is_nan() {
            return 0;
        }
        // Exactly `thresholds.partition_point(|t| t <= y)`: start from the count at the bucket's
        // lowest value and step over the thresholds between it and `y`.
        let mut c = usize::from(self.start[bucket(y)]);
        for _ in 0..self.scan {
            c += usize::from(self.padded[c] <= y);
        }
        c as u8
    }

    /// The search accelerator [`CodeMap::nearest`] starts from, for kernels that search the same
    /// way: entry `y.to_bits() >> CodeMap::BUCKET_SHIFT` is the number of thresholds at or below
    /// the lowest value whose bits fall in that bucket (2^16 entries), and at most
    /// [`CodeMap::bucket_scan`] thresholds lie inside any one bucket. So `nearest(y)` is that
    /// entry plus one for each of the next `bucket_scan()` thresholds that is `<= y` (NaN: 0).
    pub fn bucket_starts(&self) -> &[u8] {
        &self.start[..1 << (32 - BUCKET_SHIFT)]
    }

    /// The most thresholds any bucket of [`CodeMap::bucket_starts`] holds.
    pub fn bucket_scan(&self) -> usize {
        self.scan
    }

    /// How far an f32's bits are shifted right to give its bucket ([`CodeMap::bucket_starts`]).
    pub const BUCKET_SHIFT: u32 = BUCKET_SHIFT;

    /// Stochastic rounding of `y` between its neighbours `lo <= y < hi`: `hi` iff
    /// `bits < floor(frac * 2^32)` with `frac = (y - lo) / (hi - lo)` evaluated in f32. Values at
    /// or outside the ends clamp to the end codes; NaN gives code 0.
    #[inline]
    pub fn stochastic(&self, y: f32, bits: u32) -> u8 {
        if y.is_nan() {
            return 0;
        }
        // The nearest code is one of the two neighbours; the lower one is `lo`. Branch-free in the
        // common case: which neighbour is nearest is a coin toss for the branch predictor.
        let c = usize::from(self.nearest(y));
        let below = usize::from(self.values[c] > y);
        if below > c {
            return 0; // below the first value
        }
        let lo = c - below;
        if lo + 1 == self.values.len() {
            return lo as u8;
        }
        let (lo_v, hi_v) = (self.values[lo], self.values[lo + 1]);
        let frac = (y - lo_v) / (hi_v - lo_v);
        // `as` saturates: frac in [0, 1] -> [0, 2^32 - 1].
        let cut = (frac * 4_294_967_296.0) as u32;
        (lo + usize::from(bits < cut)) as u8
    }

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

    /// [`CodeMap::nearest_scaled`] 8 elements at a time with AVX2 gathers: the bucket's start
    /// code and each scan step read the same tables the scalar search reads.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn nearest_scaled_avx2(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
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

    fn nearest_scaled_portable(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = self.nearest(if absmax == 0.0 { 0.0 } else { x / absmax });
        }
    }

    /// [`CodeMap::nearest_scaled`] sixteen elements at a time: the bucket's start and each scan
    /// step are gathers from the same tables the scalar search reads, so the codes are the same.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn nearest_scaled_avx512(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
        let n = xs.len().min(out.len());
        let mut done = 0;
        if self.values.len() <= 16 {
            done = self.nearest_small_avx512(&xs[..n], &[absmax], n, &mut out[..n]);
        } else if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 VBMI (and the
            // AVX-512 level, whose F/BW/VL this function was entered with).
            done = unsafe { self.nearest_scaled_vbmi(&xs[..n], &[absmax], n, &mut out[..n]) };
        }
        self.nearest_scaled_gather(&xs[done..n], absmax, &mut out[done..n]);
    }

    /// [`CodeMap::nearest_scaled`] over a run of blocks for maps of at most 16 values (4 bits and
    /// narrower), 16 lanes at a time without gathers: `#{ j : threshold_j <= y }` by a
    /// branch-free binary search of four steps over the thresholds held in one register
    /// (`vpermps`; NaN pads the table, and `NaN <= y` is false, so NaN gives code 0 as in
    /// [`CodeMap::nearest`]). Returns how many leading elements it rounded (a multiple of 16;
    /// none for a larger map).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn nearest_small_avx512(
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
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn nearest_scaled_gather(&self, xs: &[f32], absmax: f32, out: &mut [u8]) {
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
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    fn nearest_lanes(&self, y: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
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

    /// [`CodeMap::stochastic`] of each `x / absmax` (`y = 0` for every element when `absmax` is
    /// 0) with the random bits `bits[j]` for element `j`. Writes
    /// `min(xs.len(), bits.len(), out.len())` codes.
    pub fn stochastic_scaled(&self, xs: &[f32], absmax: f32, bits: &[u32], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::avx512() {
            // SAFETY: `avx512()` is true only after run-time detection of AVX-512 F/BW/VL/DQ.
            unsafe { self.stochastic_scaled_avx512(xs, absmax, bits, out) };
            return;
        }
        self.stochastic_scaled_portable(xs, absmax, bits, out);
    }

    fn stochastic_scaled_portable(&self, xs: &[f32], absmax: f32, bits: &[u32], out: &mut [u8]) {
        for ((o, &x), &b) in out.iter_mut().zip(xs).zip(bits) {
            *o = self.stochastic(if absmax == 0.0 { 0.0 } else { x / absmax }, b);
        }
    }

    /// [`CodeMap::stochastic`] with AVX-512: 64 lanes at a time from register tables where the
    /// CPU has VBMI and the map allows it, the rest 16 lanes at a time with gathers.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn stochastic_scaled_avx512(&self, xs: &[f32], absmax: f32, bits: &[u32], out: &mut [u8]) {
        let n = xs.len().min(out.len()).min(bits.len());
        let mut done = 0;
        if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 VBMI (and the
            // AVX-512 level, whose F/BW/VL this function was entered with).
            done = unsafe {
                self.stochastic_scaled_vbmi(&xs[..n], &[absmax], n, &bits[..n], &mut out[..n])
            };
        }
        self.stochastic_scaled_gather(&xs[done..n], absmax, &bits[done..n], &mut out[done..n]);
    }

    /// [`CodeMap::stochastic`] sixteen lanes at a time, step for step, gathering from the tables.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn stochastic_scaled_gather(&self, xs: &[f32], absmax: f32, bits: &[u32], out: &mut [u8]) {
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

    /// [`CodeMap::decode_scaled`] 8 codes at a time with AVX2 gathers of the values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn decode_scaled_avx2(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
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

    fn decode_scaled_portable(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = self.value(c) * scale;
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn decode_scaled_avx512(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        let n = codes.len().min(out.len());
        let mut done = 0;
        if crate::simd::vbmi() {
            // SAFETY: `vbmi()` is true only after run-time detection of AVX-512 VBMI (and the
            // AVX-512 level, whose F/BW/VL this function was entered with).
            done = unsafe { self.decode_scaled_vbmi(&codes[..n], &[scale], n, &mut out[..n]) };
        }
        self.decode_scaled_gather(&codes[done..n], scale, &mut out[done..n]);
    }

    /// [`CodeMap::decode_scaled`] 16 codes at a time, gathering the values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn decode_scaled_gather(&self, codes: &[u8], scale: f32, out: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = codes.len().min(out.len());
        let whole = n - n % 16;
        let last = _mm512_set1_epi32(self.values.len() as i32 - 1);
        let s = _mm512_set1_ps(scale);
        for i in (0..whole).step_by(16) {
            // SAFETY: `i + 16 <= codes.len()`; the load is unaligned.
            let c8 = unsafe { _mm_loadu_si128(codes.as_ptr().add(i).cast()) };
            let c = _mm512_min_epu32(_mm512_cvtepu8_epi32(c8), last);
            // SAFETY: every index is clamped to `values.len() - 1`.
            let v = unsafe { _mm512_i32gather_ps::<4>(c, self.values.as_ptr()) };
            // SAFETY: `i + 16 <= out.len()`; the store is unaligned.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(v, s)) };
        }
        self.decode_scaled_portable(&codes[whole..n], scale, &mut out[whole..n]);
    }

    /// [`CodeMap::decode_scaled`] 64 codes at a time without gathers ([`lookup64`]). Returns
    /// how many leading codes it decoded (a multiple of 64); the caller decodes the rest.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    fn decode_scaled_vbmi(
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
    #[cfg(target_arch = "x86_64")]
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
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    fn nearest_scaled_vbmi(
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
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    fn stochastic_scaled_vbmi(
        &self,
        xs: &[f32],
        scales: &[f32],
        block: usize,
        bits: &[u32],
        out: &mut [u8],
    ) -> usize {
        use std::arch::x86_64::*;
        let Some(n) = lanes_for(xs.len().min(out.len()).min(bits.len()), scales, block) else {
            return 0;
        };
        if let Some((origin, steps)) = self.grid {
            return self.stochastic_grid_vbmi(&xs[..n], scales, block, bits, out, origin, steps);
        }
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

    /// [`CodeMap::stochastic_scaled_vbmi`] on a uniform grid (`CodeMap::grid`): 64 lanes at a
    /// time without a search ([`CodeMap::stochastic_grid64`]); the rare groups it hands over
    /// are rounded lane by lane by [`CodeMap::stochastic`], from the same quotients. Only the
    /// value table is held in registers. Returns how many leading elements it rounded (a
    /// multiple of 64); `xs` holds at most what `lanes_for` allows.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    #[allow(clippy::too_many_arguments)]
    fn stochastic_grid_vbmi(
        &self,
        xs: &[f32],
        scales: &[f32],
        block: usize,
        bits: &[u32],
        out: &mut [u8],
        origin: i32,
        steps: f32,
    ) -> usize {
        use std::arch::x86_64::*;
        let whole = xs.len() - xs.len() % 64;
        let values = load_planes(&self.planes);
        for i in (0..whole).step_by(64) {
            let y = quotients64(&xs[i..i + 64], scales, i, block);
            // `i + 64 <= whole <= bits.len(), out.len()` (the caller's `lanes_for`).
            if !self.stochastic_grid64(&values, origin, steps, y, &bits[i..], &mut out[i..]) {
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
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    #[inline]
    fn stochastic_grid64(
        &self,
        values: &[[std::arch::x86_64::__m512i; 4]; 4],
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
        let lo_v = lookup64(values, pack_codes(lo));
        let hi_v = lookup64(values, pack_codes(hi));
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
        }
        for (k, r) in blocks_from(done, n, block) {
            self.decode_scaled(&codes[r.clone()], scales[k], &mut out[r]);
        }
    }

    /// Rounds `y` to a code with the given rounding.
    #[inline]
    pub fn encode(&self, y: f32, rounding: Rounding) -> u8 {
        match rounding {
            Rounding::NearestEven => self.nearest(y),
            Rounding::Stochastic(bits) => self.stochastic(y, bits),
        }
    }

    /// bitsandbytes' dynamic (tree) map, `create_dynamic_map(signed, total_bits - 1, total_bits)`:
    /// the 8-bit signed map is bitsandbytes' first-moment map, the unsigned one its second-moment
    /// map, and `dynamic(true, 4)` the signed dynamic-exponent 4-bit map of lpmm and torchao.
    pub fn dynamic(signed: bool, total_bits: u32) -> Result<Self, FormatError> {
        check_bits(total_bits)?;
        Self::dynamic_with_exponent_bits(signed, total_bits - 1, total_bits)
    }

    /// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits, total_bits)`.
    ///
    /// For each decade `i < max_exponent_bits` the map holds the midpoints of an f32
    /// `linspace(0.1, 1, k + 1)` scaled by `10^(i - max_exponent_bits + 1)`, with
    /// `k = 2^(i + total_bits - 1 - max_exponent_bits)` (twice that, unsigned), negated copies if
    /// signed, then `2^(total_bits - 1 - max_exponent_bits) - 1` linear fraction items at the last
    /// decade's scale, then 0 and 1. Unsigned maps need `max_exponent_bits = total_bits - 1`
    /// (otherwise bitsandbytes' construction does not give 2^bits values).
    pub fn dynamic_with_exponent_bits(
        signed: bool,
        max_exponent_bits: u32,
        total_bits: u32,
    ) -> Result<Self, FormatError> {
        check_bits(total_bits)?;
        let non_sign_bits = total_bits - 1;
        let valid = max_exponent_bits <= non_sign_bits
            && (signed || max_exponent_bits == non_sign_bits)
            && (max_exponent_bits > 0 || non_sign_bits == 0);
        if !valid {
            return Err(FormatError::NoMapAtWidth {
                what: "dynamic",
                bits: total_bits,
            });
        }
        let mut data: Vec<f32> = Vec::with_capacity(1 << total_bits);
        let mut push_decade = |items: usize, decade: i32| {
            let points = torch_linspace_f32(0.1, 1.0, items + 1);
            // torch multiplies an f32 tensor by a Python float scalar in f32.
            // `10 ** decade` is a correctly rounded f64 in Python; parsing gives the same value.
            let scale = format!("1e{decade}").parse::<f64>().unwrap_or(1.0) as f32;
            let means: Vec<f32> = points.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
            data.extend(means.iter().map(|m| scale * m));
            if signed {
                data.extend(means.iter().map(|m| -scale * m));
            }
        };
        let first_decade = 1 - max_exponent_bits as i32;
        for i in 0..max_exponent_bits {
            let exponent = i + non_sign_bits - max_exponent_bits + u32::from(!signed);
            push_decade(1 << exponent, first_decade + i as i32);
        }
        let additional = (1usize << (non_sign_bits - max_exponent_bits)) - 1;
        if additional > 0 {
            push_decade(additional, 0);
        }
        data.push(0.0);
        data.push(1.0);
        data.sort_by(f32::total_cmp);
        Self::from_values(total_bits, &data)
    }

    /// The symmetric linear map `k / L`, `k = -L..=L`, `L = 2^(bits-1) - 1` (2^bits - 1 codes,
    /// zero included): the LPMM parameter format at 8 bits (int8 in [-127, 127], code = k + 127).
    pub fn linear_signed(bits: u32) -> Result<Self, FormatError> {
        check_bits(bits)?;
        if bits < 2 {
            return Err(FormatError::NoMapAtWidth {
                what: "linear signed",
                bits,
            });
        }
        let l = (1i32 << (bits - 1)) - 1;
        let values: Vec<f32> = (-l..=l).map(|k| k as f32 / l as f32).collect();
        Self::from_values(bits, &values)
    }

    /// The linear map `k / (2^bits - 1)`, `k = 0..2^bits`.
    pub fn linear_unsigned(bits: u32) -> Result<Self, FormatError> {
        check_bits(bits)?;
        let l = (1u32 << bits) - 1;
        let values: Vec<f32> = (0..=l).map(|k| k as f32 / l as f32).collect();
        Self::from_values(bits, &values)
    }

    /// The linear map without zero, `(i + 1) / 2^bits`, `i = 0..2^bits`: lpmm's 4-bit
    /// second-moment map (a second moment never decodes to 0, so `1/sqrt(v)` stays finite).
    pub fn linear_without_zero(bits: u32) -> Result<Self, FormatError> {
        check_bits(bits)?;
        let n = 1u32 << bits;
        let values: Vec<f32> = (1..=n).map(|k| k as f32 / n as f32).collect();
        Self::from_values(bits, &values)
    }

    /// The NormalFloat map (QLoRA's NF4 at 4 bits), bitsandbytes' `create_normal_map`
    /// generalised: `2^(bits-1)` positive values `ppf(linspace(offset, 0.5, 2^(bits-1) + 1))`
    /// (last point dropped), `2^(bits-1) - 1` negative ones `-ppf(linspace(offset, 0.5,
    /// 2^(bits-1)))` (last dropped), and 0, divided by the largest in f32. The offset is the mean
    /// of `1 - 1/(2(2^bits - 1))` and `1 - 1/2^(bits+1)`, rounded to 7 decimals (bitsandbytes'
    /// literal `0.9677083` at 4 bits).
    pub fn normal_float(bits: u32) -> Result<Self, FormatError> {
        check_bits(bits)?;
        let n = f64::from(1u32 << bits);
        let offset =
            ((1.0 - 1.0 / (2.0 * (n - 1.0)) + 1.0 - 1.0 / (2.0 * n)) / 2.0 * 1e7).round() / 1e7;
        let half = 1usize << (bits - 1);
        let ppf = |p: f32| -> f32 {
            // Normal quantile via the inverse complementary error function, in f64, rounded
            // to f32 once (scipy's `ndtri` float32 loop does the same).
            (-std::f64::consts::SQRT_2 * statrs::function::erf::erfc_inv(2.0 * f64::from(p))) as f32
        };
        let positive = torch_linspace_f32(offset, 0.5, half + 1);
        let negative = torch_linspace_f32(offset, 0.5, half);
        let mut values: Vec<f32> = positive[..half].iter().map(|&p| ppf(p)).collect();
        values.extend(negative[..half - 1].iter().map(|&p| -ppf(p)));
        values.push(0.0);
        values.sort_by(f32::total_cmp);
        let max = values[values.len() - 1];
        values.iter_mut().for_each(|v| *v /= max);
        Self::from_values(bits, &values)
    }
}

/// The smallest f32 that rounds to `hi` rather than `lo` (both f32, `lo < hi`) under the tie rule
/// of [`CodeMap::nearest`]. The midpoint is exact in f64: [`CodeMap::from_values`] refuses
/// neighbours whose exponents differ by more than 28.
fn threshold(lo: f32, hi: f32) -> f32 {
    let mid = (f64::from(lo) + f64::from(hi)) / 2.0;
    let tie_goes_up = hi.abs() < lo.abs();
    // The smallest f32 >= mid, or > mid.
    let mut t = mid as f32; // round to nearest
    if f64::from(t) < mid {
        t = t.next_up();
    } else if f64::from(t) > mid {
        let below = t.next_down();
        if f64::from(below) >= mid {
            t = below;
        }
    }
    if f64::from(t) == mid && !tie_goes_up {
        t = t.next_up();
    }
    t
}

/// `torch.linspace(start, end, steps, dtype=torch.float32)` as torch 2.15's CPU kernel computes
/// it (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp, AVX2/AVX-512 build): `step = (end -
/// start) / (steps - 1)` in f32; element `i < steps / 2` is `fma(step, i, start)`, the others
/// `fma(-step, steps - 1 - i, end)`, each with a single rounding (the compiler contracts the
/// multiply-add). Checked against torch's output and against all 512 values of the reference table.
fn torch_linspace_f32(start: f64, end: f64, steps: usize) -> Vec<f32> {
    let (start, end) = (start as f32, end as f32);
    if steps == 1 {
        return vec![start];
    }
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| {
            if i < halfway {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((steps - 1 - i) as f32, end)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_maps_need_one_comparison_after_the_table() {
        for m in [
            CodeMap::dynamic(true, 8).unwrap(),
            CodeMap::dynamic(false, 8).unwrap(),
            CodeMap::dynamic(true, 4).unwrap(),
            CodeMap::dynamic(false, 4).unwrap(),
            CodeMap::linear_signed(8).unwrap(),
            CodeMap::normal_float(4).unwrap(),
        ] {
            assert_eq!(m.scan, 1, "{m:?}");
        }
    }

    #[test]
    fn spec_examples() {
        let m = CodeMap::dynamic(true, 8).unwrap();
        assert_eq!(m.values()[0], -0.992_968_75);
        assert_eq!(m.values()[127], 0.0);
        assert_eq!(m.values()[255], 1.0);
        let u = CodeMap::dynamic(false, 8).unwrap();
        assert_eq!(u.values()[0], 0.0);
        let de4: Vec<f32> = CodeMap::dynamic(true, 4).unwrap().values().to_vec();
        let want = [
            -0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0, 0.0055, 0.0325,
            0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0,
        ];
        for (a, b) in de4.iter().zip(want) {
            assert!((a - b).abs() < 1e-7, "{a} vs {b}");
        }
    }

    #[test]
    fn thresholds_follow_the_tie_rule() {
        // 0.25 is exactly half-way between 0 and 0.5: it goes to 0 (lower magnitude).
        let m = CodeMap::from_values(2, &[-0.5, 0.0, 0.5, 1.0]).unwrap();
        assert_eq!(m.nearest(0.25), 1);
        assert_eq!(m.nearest(0.25f32.next_up()), 2);
        assert_eq!(m.nearest(-0.25), 1);
        assert_eq!(m.nearest((-0.25f32).next_down()), 0);
        assert_eq!(m.nearest(0.75), 2);
        assert_eq!(m.nearest(-2.0), 0);
        assert_eq!(m.nearest(2.0), 3);
        assert_eq!(m.nearest(f32::NAN), 0);
        // Equal magnitudes: the lower code.
        let sym = CodeMap::from_values(1, &[-0.5, 0.5]).unwrap();
        assert_eq!(sym.nearest(0.0), 0);
        assert_eq!(sym.nearest(1e-30), 1);
    }

    #[test]
    fn nearest_agrees_with_brute_force_on_every_map() {
        let maps = [
            CodeMap::dynamic(true, 8).unwrap(),
            CodeMap::dynamic(false, 8).unwrap(),
            CodeMap::normal_float(4).unwrap(),
            CodeMap::linear_signed(8).unwrap(),
            CodeMap::linear_without_zero(4).unwrap(),
        ];
        for m in &maps {
            for k in 0..200_000u32 {
                let y = (k as f32 / 100_000.0 - 1.0) * 1.01 + (k % 7) as f32 * 1e-9;
                let c = m.nearest(y) as usize;
                let d = (f64::from(y) - f64::from(m.values()[c])).abs();
                for (j, &v) in m.values().iter().enumerate() {
                    let dj = (f64::from(y) - f64::from(v)).abs();
                    assert!(d <= dj, "{y}: code {c} at {d}, but {j} at {dj}");
                }
            }
        }
    }

    /// The AVX-512 kernels give the portable kernels' bits: every map, every threshold and its
    /// neighbours, a sweep over bit patterns (NaN, ±Inf, subnormals, values outside [-1, 1]),
    /// several scales including 0, lengths that leave a tail.
    #[test]
    fn vector_kernels_equal_the_portable_ones() {
        let maps = [
            CodeMap::dynamic(true, 8).unwrap(),
            CodeMap::dynamic(false, 8).unwrap(),
            CodeMap::dynamic(true, 4).unwrap(),
            CodeMap::normal_float(4).unwrap(),
            CodeMap::linear_signed(8).unwrap(),
            CodeMap::linear_unsigned(3).unwrap(),
            CodeMap::linear_without_zero(4).unwrap(),
            CodeMap::from_values(2, &[-1.0, -1e-8, 1e-8, 1.0]).unwrap(),
            CodeMap::from_values(8, &[-1.0, 0.5]).unwrap(),
        ];
        #[cfg(target_arch = "x86_64")]
        let vector = crate::simd::detected() >= crate::simd::Level::Avx512;
        #[cfg(not(target_arch = "x86_64"))]
        let vector = false;
        if !vector {
            eprintln!("no AVX-512 on this CPU: only the portable kernels ran");
        }
        for m in &maps {
            let mut xs: Vec<f32> = m
                .thresholds()
                .iter()
                .chain(m.values())
                .flat_map(|&t| [t.next_down(), t, t.next_up()])
                .collect();
            xs.extend((0..=u32::MAX).step_by(65_537).map(f32::from_bits));
            xs.extend([f32::NAN, f32::INFINITY, -0.0, 1e-45, -1e-45, 1.0, -1.0, 1.5]);
            xs.push(0.25); // a tail of 3 lanes past the last whole vector
            xs.push(-0.75);
            xs.push(0.125);
            let bits: Vec<u32> = (0..xs.len() as u32)
                .map(|k| k.wrapping_mul(0x9E37_79B9) ^ (k >> 3))
                .chain([0, u32::MAX, 1 << 31])
                .collect();
            let codes: Vec<u8> = (0..xs.len()).map(|k| (k * 37 % 256) as u8).collect();
            for absmax in [1.0f32, 0.0, 2.5, 1e-30, 3e38] {
                let (mut a, mut b) = (vec![0u8; xs.len()], vec![0u8; xs.len()]);
                m.nearest_scaled_portable(&xs, absmax, &mut a);
                for (j, (&x, &c)) in xs.iter().zip(&a).enumerate().take(64) {
                    let y = if absmax == 0.0 { 0.0 } else { x / absmax };
                    assert_eq!(c, m.nearest(y), "element {j}");
                }
                let (mut sa, mut sb) = (vec![0u8; xs.len()], vec![0u8; xs.len()]);
                m.stochastic_scaled_portable(&xs, absmax, &bits, &mut sa);
                let (mut da, mut db) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
                m.decode_scaled_portable(&codes, absmax, &mut da);
                #[cfg(target_arch = "x86_64")]
                if crate::simd::detected() >= crate::simd::Level::Avx2 {
                    let (mut c2, mut d2) = (vec![0u8; xs.len()], vec![0f32; xs.len()]);
                    // SAFETY: AVX2 and FMA were detected on this CPU.
                    unsafe {
                        m.nearest_scaled_avx2(&xs, absmax, &mut c2);
                        m.decode_scaled_avx2(&codes, absmax, &mut d2);
                    }
                    assert_eq!(a, c2, "AVX2 nearest, {m:?}, absmax {absmax}");
                    let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits_of(&da), bits_of(&d2), "AVX2 decode, absmax {absmax}");
                }
                #[cfg(target_arch = "x86_64")]
                if vector {
                    // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                    unsafe {
                        m.nearest_scaled_avx512(&xs, absmax, &mut b);
                        m.stochastic_scaled_avx512(&xs, absmax, &bits, &mut sb);
                        m.decode_scaled_avx512(&codes, absmax, &mut db);
                    }
                    assert_eq!(a, b, "nearest, {m:?}, absmax {absmax}");
                    assert_eq!(sa, sb, "stochastic, {m:?}, absmax {absmax}");
                    let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits_of(&da), bits_of(&db), "decode, absmax {absmax}");
                    // Both AVX-512 decoders on their own: gathers, and byte tables (VBMI).
                    // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                    unsafe { m.decode_scaled_gather(&codes, absmax, &mut db) };
                    assert_eq!(bits_of(&da), bits_of(&db), "gather decode, absmax {absmax}");
                    // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                    unsafe { m.nearest_scaled_gather(&xs, absmax, &mut b) };
                    assert_eq!(a, b, "gather nearest, {m:?}, absmax {absmax}");
                    b.fill(0xAA);
                    // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                    let done = unsafe { m.nearest_small_avx512(&xs, &[absmax], xs.len(), &mut b) };
                    let small = m.values.len() <= 16;
                    assert_eq!(done, if small { xs.len() / 16 * 16 } else { 0 });
                    assert_eq!(a[..done], b[..done], "register-table nearest, {m:?}");
                    // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                    unsafe { m.stochastic_scaled_gather(&xs, absmax, &bits, &mut sb) };
                    assert_eq!(sa, sb, "gather stochastic, {m:?}, absmax {absmax}");
                    if std::is_x86_feature_detected!("avx512vbmi") {
                        sb.fill(0xAA);
                        // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                        let done = unsafe {
                            m.stochastic_scaled_vbmi(&xs, &[absmax], xs.len(), &bits, &mut sb)
                        };
                        let runs = m.scan == 1 || m.grid.is_some();
                        assert_eq!(done, if runs { xs.len() / 64 * 64 } else { 0 });
                        assert_eq!(sa[..done], sb[..done], "VBMI stochastic, {m:?}");
                        b.fill(0xAA);
                        // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                        let done =
                            unsafe { m.nearest_scaled_vbmi(&xs, &[absmax], xs.len(), &mut b) };
                        assert_eq!(done, if m.scan == 1 { xs.len() / 64 * 64 } else { 0 });
                        assert_eq!(a[..done], b[..done], "VBMI nearest, {m:?}");
                        db.fill(f32::NAN);
                        // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                        let done = unsafe {
                            m.decode_scaled_vbmi(&codes, &[absmax], codes.len(), &mut db)
                        };
                        assert_eq!(done, codes.len() / 64 * 64);
                        assert!(done > 0);
                        assert_eq!(bits_of(&da[..done]), bits_of(&db[..done]), "VBMI decode");
                    } else {
                        eprintln!("no AVX-512 VBMI on this CPU: its decoder did not run");
                    }
                }
                let _ = (&mut b, &mut sb, &mut db);
            }
        }
    }

    /// Uniform grids are recognised, and the VBMI stochastic rounding's search-free path for
    /// them gives the codes of [`CodeMap::stochastic`]: on values in range (where it runs), on
    /// the grid's values and their neighbours, and on NaN and out-of-range lanes (which it hands
    /// over to the search).
    #[test]
    fn uniform_grids_round_stochastically_without_a_search() {
        let cases = [
            (CodeMap::linear_signed(8).unwrap(), Some((127, 127.0))),
            (CodeMap::linear_signed(2).unwrap(), Some((1, 1.0))),
            (CodeMap::linear_unsigned(8).unwrap(), Some((0, 255.0))),
            (CodeMap::linear_unsigned(3).unwrap(), Some((0, 7.0))),
            (CodeMap::dynamic(true, 8).unwrap(), None),
            (CodeMap::linear_without_zero(4).unwrap(), None),
            (
                CodeMap::from_values(2, &[-1.0, 0.0, 0.5, 1.0]).unwrap(),
                None,
            ),
        ];
        for (map, grid) in &cases {
            assert_eq!(map.grid, *grid, "{map:?}");
        }
        #[cfg(target_arch = "x86_64")]
        {
            if !(crate::simd::detected() >= crate::simd::Level::Avx512
                && std::is_x86_feature_detected!("avx512vbmi"))
            {
                eprintln!("no AVX-512 VBMI on this CPU: the grid path did not run");
                return;
            }
            let mut state = 0x2545_F491_4F6C_DD1Du64;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            for (map, grid) in &cases {
                let Some((_, steps)) = *grid else { continue };
                let low = map.values()[0];
                // 64-lane groups: uniform in the map's range; the grid's values and their
                // neighbours; then a group with one NaN, one below the range and one above.
                let mut xs: Vec<f32> = (0..64 * 40)
                    .map(|_| low + (1.0 - low) * (next() >> 40) as f32 / (1u64 << 24) as f32)
                    .collect();
                for &v in map.values() {
                    xs.extend([v.next_down(), v, v.next_up()]);
                }
                xs.resize(xs.len().next_multiple_of(64), 0.5);
                xs.extend([f32::NAN, low - 0.25, 1.5]);
                xs.resize(xs.len().next_multiple_of(64), -0.0);
                let bits: Vec<u32> = xs.iter().map(|_| next() as u32).collect();
                for absmax in [1.0f32, 1.0 / steps, 3.0] {
                    let mut want = vec![0u8; xs.len()];
                    map.stochastic_scaled_portable(&xs, absmax, &bits, &mut want);
                    let mut got = vec![0xAAu8; xs.len()];
                    // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                    let done = unsafe {
                        map.stochastic_scaled_vbmi(&xs, &[absmax], xs.len(), &bits, &mut got)
                    };
                    assert_eq!(done, xs.len());
                    assert_eq!(got, want, "{map:?}, absmax {absmax}");
                }
                // The search-free path itself: it takes a group of values in range and hands a
                // group with a NaN, or with an estimate rounded across an integer, to the search.
                // SAFETY: AVX-512 F was detected on this CPU.
                let values = unsafe { load_planes(&map.planes) };
                let (o, steps) = grid.unwrap();
                let take = |lanes: &[f32]| {
                    let y = std::array::from_fn(|m| {
                        // SAFETY: AVX-512 F was detected; 16 values per register.
                        unsafe { std::arch::x86_64::_mm512_loadu_ps(lanes[16 * m..].as_ptr()) }
                    });
                    let mut out = [0u8; 64];
                    // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                    unsafe { map.stochastic_grid64(&values, o, steps, y, &bits[..64], &mut out) }
                };
                assert!(take(&xs[..64]), "{map:?}: values in range");
                let mut nan = xs[..64].to_vec();
                nan[17] = f32::NAN;
                assert!(!take(&nan), "{map:?}: NaN");
                // A lane below the map's range: the clamped estimate's value is above it.
                let mut under = xs[..64].to_vec();
                under[40] = low - 0.25;
                assert!(!take(&under), "{map:?}: below the range");
            }
        }
    }

    /// The run-of-blocks kernels give, at every SIMD level, the codes and values of the
    /// one-block kernels called block by block (blocks of 7 to 256, partial last blocks,
    /// all-zero blocks).
    #[test]
    fn run_of_blocks_kernels_equal_block_by_block() {
        use crate::simd::{Level, force};
        let maps = [
            CodeMap::dynamic(true, 8).unwrap(),
            CodeMap::dynamic(false, 8).unwrap(),
            CodeMap::linear_signed(8).unwrap(),
            CodeMap::dynamic(true, 4).unwrap(),
            CodeMap::from_values(8, &[-1.0, 0.5]).unwrap(),
        ];
        let n = 1000;
        let xs: Vec<f32> = (0..n)
            .map(|k| ((k as f32 * 0.618).fract() - 0.5) * (1.0 + (k % 7) as f32))
            .collect();
        let bits: Vec<u32> = (0..n as u32).map(|k| k.wrapping_mul(0x9E37_79B9)).collect();
        let codes: Vec<u8> = (0..n).map(|k| (k * 37 % 256) as u8).collect();
        let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for m in &maps {
            for block in [16usize, 32, 48, 64, 256, 7] {
                let scales: Vec<f32> = xs
                    .chunks(block)
                    .enumerate()
                    .map(|(k, c)| {
                        let a = c.iter().fold(0f32, |a, v| a.max(v.abs()));
                        if k % 5 == 3 { 0.0 } else { a }
                    })
                    .collect();
                let mut want = (vec![0u8; n], vec![0u8; n], vec![0f32; n]);
                for (k, &a) in scales.iter().enumerate() {
                    let r = k * block..((k + 1) * block).min(n);
                    m.nearest_scaled_portable(&xs[r.clone()], a, &mut want.0[r.clone()]);
                    let (x, b) = (&xs[r.clone()], &bits[r.clone()]);
                    m.stochastic_scaled_portable(x, a, b, &mut want.1[r.clone()]);
                    m.decode_scaled_portable(&codes[r.clone()], a, &mut want.2[r]);
                }
                for level in [Level::Portable, Level::Avx2, Level::Avx512] {
                    force(Some(level));
                    let mut got = (vec![0xAAu8; n], vec![0xAAu8; n], vec![f32::NAN; n]);
                    m.nearest_blocks(&xs, &scales, block, &mut got.0);
                    m.stochastic_blocks(&xs, &scales, block, &bits, &mut got.1);
                    m.decode_blocks(&codes, &scales, block, &mut got.2);
                    assert_eq!(got.0, want.0, "nearest {m:?} block {block} {level:?}");
                    assert_eq!(got.1, want.1, "stochastic {m:?} block {block} {level:?}");
                    assert_eq!(
                        bits_of(&got.2),
                        bits_of(&want.2),
                        "decode {block} {level:?}"
                    );
                }
            }
        }
        force(None);
    }

    /// Why the quantizers divide by the absmax instead of multiplying by its reciprocal
    /// (bitsandbytes' CUDA kernel multiplies by `1 / absmax` once per block): `x * (1 / a)`
    /// differs from `x / a` by an ulp for some inputs, and where the quotient lands on a
    /// decision threshold that moves the nearest code. The search below finds such inputs for
    /// bitsandbytes' own 8-bit maps, so the reciprocal would not keep the exact-nearest
    /// guarantee (docs/FORMATS.md §4): every backend keeps one IEEE division per element.
    #[test]
    fn a_reciprocal_would_move_codes_across_thresholds() {
        for map in [
            CodeMap::dynamic(true, 8).unwrap(),
            CodeMap::dynamic(false, 8).unwrap(),
        ] {
            let mut moved = 0;
            'search: for &t in map.thresholds() {
                if t <= 0.0 {
                    continue;
                }
                for a in [3.0f32, 0.7, 1.1e-3, 0.123_456_7, 5e-6, 77.7] {
                    let r = 1.0 / a;
                    // Inputs whose exact quotient lies within a few ulps of the threshold.
                    let x0 = t * a;
                    let mut x = x0;
                    for _ in 0..8 {
                        x = x.next_down();
                    }
                    for _ in 0..16 {
                        let (exact, fast) = (map.nearest(x / a), map.nearest(x * r));
                        if exact != fast {
                            moved += 1;
                            if moved >= 3 {
                                break 'search;
                            }
                        }
                        x = x.next_up();
                    }
                }
            }
            assert!(
                moved >= 3,
                "{map:?}: the reciprocal gave the same codes ({moved} moved)"
            );
        }
    }

    /// The VBMI kernel's key table gives `nearest` on every bucket: every top-16-bit pattern of
    /// a magnitude below 2 with low halves 0, 0x8000, 0xFFFF and a pseudo-random one, and every
    /// threshold and value with its neighbours, in runs of 64 (the keyed path's unit).
    #[test]
    fn keyed_nearest_equals_nearest_on_every_bucket() {
        let maps = [
            CodeMap::dynamic(true, 8).unwrap(),
            CodeMap::dynamic(false, 8).unwrap(),
            CodeMap::linear_signed(8).unwrap(),
            CodeMap::dynamic(true, 4).unwrap(),
        ];
        for m in &maps {
            assert!(m.keys.is_some(), "{m:?} has no key table");
        }
        // A map whose buckets need more than seven mantissa bits has none (the gather path).
        let dense = CodeMap::from_values(8, &[0.5, 0.5f32.next_up(), 0.5f32.next_up().next_up()]);
        assert!(dense.unwrap().keys.is_none());
        #[cfg(target_arch = "x86_64")]
        if !std::is_x86_feature_detected!("avx512vbmi") {
            eprintln!("no AVX-512 VBMI on this CPU: the keyed kernel did not run");
            return;
        }
        #[cfg(not(target_arch = "x86_64"))]
        return;
        #[cfg(target_arch = "x86_64")]
        for m in &maps {
            let mut ys: Vec<f32> = Vec::new();
            let mut state = 0x2545_F491_4F6C_DD1Du64;
            for h in 0..=0xFFFFu32 {
                if h & 0x7FFF >= 0x4000 {
                    continue;
                }
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                for low in [0, 0x8000, 0xFFFF, state as u32 & 0xFFFF] {
                    ys.push(f32::from_bits(h << 16 | low));
                }
            }
            for &t in m.thresholds().iter().chain(m.values()) {
                ys.extend([t.next_down(), t, t.next_up()]);
            }
            ys.resize(ys.len().div_ceil(64) * 64, 0.25);
            let mut out = vec![0u8; ys.len()];
            // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
            let done = unsafe { m.nearest_scaled_vbmi(&ys, &[1.0], ys.len(), &mut out) };
            assert_eq!(done, ys.len());
            for (&y, &c) in ys.iter().zip(&out) {
                assert_eq!(c, m.nearest(y), "{m:?}: y {y} ({:#010x})", y.to_bits());
            }
        }
    }

    #[test]
    fn accelerated_search_equals_a_plain_binary_search() {
        let maps = [
            CodeMap::dynamic(true, 8).unwrap(),
            CodeMap::dynamic(false, 8).unwrap(),
            CodeMap::dynamic(true, 4).unwrap(),
            CodeMap::linear_signed(8).unwrap(),
            CodeMap::from_values(2, &[-1.0, -1e-8, 1e-8, 1.0]).unwrap(),
        ];
        for m in &maps {
            // Every threshold and its f32 neighbours, plus a sweep over bit patterns.
            let mut ys: Vec<f32> = m
                .thresholds()
                .iter()
                .flat_map(|&t| [t.next_down(), t, t.next_up()])
                .collect();
            ys.extend(
                (0..=u32::MAX)
                    .step_by(9973)
                    .map(f32::from_bits)
                    .filter(|v| !v.is_nan()),
            );
            ys.extend([f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]);
            for y in ys {
                let want = m.thresholds().partition_point(|&t| t <= y) as u8;
                assert_eq!(m.nearest(y), want, "{y:e} ({:#x})", y.to_bits());
                let lo = m.values().partition_point(|&v| v <= y).saturating_sub(1);
                let s = m.stochastic(y, u32::MAX);
                assert_eq!(usize::from(s), lo, "stochastic lower neighbour of {y:e}");
            }
        }
    }

    #[test]
    fn bad_maps_are_rejected() {
        assert_eq!(
            CodeMap::from_values(9, &[0.0, 1.0]),
            Err(FormatError::BitWidth { bits: 9 })
        );
        assert_eq!(
            CodeMap::from_values(1, &[0.0, 0.5, 1.0]),
            Err(FormatError::CodeMapLength { bits: 1, len: 3 })
        );
        assert_eq!(
            CodeMap::from_values(2, &[0.0, 0.5, 0.5]),
            Err(FormatError::CodeMapUnsorted {
                index: 2,
                value: 0.5
            })
        );
        assert!(matches!(
            CodeMap::from_values(2, &[0.0, f32::NAN]),
            Err(FormatError::CodeMapOutOfRange { index: 1, .. })
        ));
        assert!(matches!(
            CodeMap::from_values(2, &[0.0, 1.5]),
            Err(FormatError::CodeMapOutOfRange { index: 1, .. })
        ));
        assert!(CodeMap::linear_signed(1).is_err());
        assert_eq!(
            CodeMap::from_values(2, &[-1.0, 2f32.powi(-60), 1.0]),
            Err(FormatError::CodeMapSpread { index: 1 })
        );
        let m = CodeMap::dynamic(true, 8).unwrap();
        assert_eq!(m, m.clone());
        assert_eq!(m, CodeMap::from_values(8, m.values()).unwrap());
        assert_ne!(m, CodeMap::dynamic(false, 8).unwrap());
        assert!(CodeMap::dynamic_with_exponent_bits(false, 3, 8).is_err());
    }
}
