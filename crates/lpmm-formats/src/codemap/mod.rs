//! Code maps: sorted tables of at most 2^bits values in [-1, 1] that a code indexes. A block-wise
//! quantizer stores `code` and a scale; the value is `map[code] * scale`.
//!
//! Every map here is built by code, reproducing the anchors' constructions (bitsandbytes'
//! `create_dynamic_map`, `create_normal_map`, lpmm's linear maps) including the f32 arithmetic
//! they do, so the 8-bit dynamic maps equal bitsandbytes' bit for bit (tested against
//! `shared/spec/dynamic-map-8bit.tsv`).
//!
//! Where things are: the map's construction and its checks, the accessors and [`CodeMap::encode`]
//! here; the anchors' maps in `anchors.rs`; the search tables (thresholds, buckets, the key table,
//! byte and word planes, the uniform grid) and the scalar search that defines every kernel's bits
//! in `search.rs`; the slice kernels in `slices.rs`, which pick a SIMD kernel at run time:
//! `avx2.rs` (8 lanes), `avx512.rs` (16 lanes, gathers; 64 lanes on uniform grids), `words.rs`
//! (32 lanes, word tables in registers, without VBMI) and `vbmi.rs` (64 lanes, byte tables in
//! registers). `tests.rs` holds every kernel to the portable loops' bits.

mod anchors;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod search;
mod slices;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod vbmi;
#[cfg(target_arch = "x86_64")]
mod words;

use search::{
    BUCKET_SHIFT, KeyTable, bucket_range, byte_planes, threshold, uniform_grid, word_planes,
};

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
    /// false for every `y`), and by more NaNs up to 256 entries, so that any `u8` code indexes
    /// it.
    padded: Box<[f32]>,
    /// The value of every `u8` code (entries past the end repeat the last value): what
    /// [`CodeMap::value`] reads, and the AVX2 decoder lane by lane.
    lookup: Box<[f32; 256]>,
    /// The values' bytes as four planes of 256 entries (byte `p` of entry `c` at `256 p + c`;
    /// entries past the end repeat the last value, as [`CodeMap::value`] reads them): the
    /// AVX-512 VBMI decoder looks values up from registers instead of gathering them.
    planes: Box<[u8]>,
    /// `padded` as four byte planes of 256 entries (entries past it are NaN), when it fits
    /// (every map whose buckets hold at most one threshold): the VBMI stochastic rounding
    /// looks thresholds up from registers. Empty otherwise.
    threshold_planes: Box<[u8]>,
    /// The values' 16-bit halves as two planes of 256 entries (half `h` of entry `c` at
    /// `256 h + c`; entries past the end repeat the last value): the AVX-512 kernels without
    /// VBMI look values up from registers with word permutes.
    words: Box<[u16]>,
    /// `padded` as two word planes (entries past it are NaN), when it fits, as
    /// `threshold_planes`. Empty otherwise.
    threshold_words: Box<[u16]>,
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
        let fits = thresholds.len() + scan <= 256;
        let mut padded = thresholds.to_vec();
        padded.resize((thresholds.len() + scan).max(256), f32::NAN);
        let last = values[values.len() - 1];
        let planes = byte_planes(values, last);
        let (threshold_planes, threshold_words) = if fits {
            (
                byte_planes(&padded, f32::NAN),
                word_planes(&padded, f32::NAN),
            )
        } else {
            (Box::default(), Box::default())
        };
        // The key table serves the register-table nearest kernels, which also read
        // `threshold_planes` (VBMI) or `threshold_words`.
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
            padded: padded.into(),
            lookup: Box::new(std::array::from_fn(|c| {
                values.get(c).copied().unwrap_or(last)
            })),
            words: word_planes(values, last),
            planes,
            threshold_planes,
            threshold_words,
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
        self.lookup[usize::from(code)]
    }

    /// Rounds `y` to a code with the given rounding.
    #[inline]
    pub fn encode(&self, y: f32, rounding: Rounding) -> u8 {
        match rounding {
            Rounding::NearestEven => self.nearest(y),
            Rounding::Stochastic(bits) => self.stochastic(y, bits),
        }
    }
}
