//! The search tables of a map, built once from its values: the decision thresholds, the 64 KiB
//! bucket table, the vector kernels' key table, byte and word planes of values and thresholds,
//! the uniform grid and its values without a division; and the scalar nearest and stochastic
//! rounding that define every kernel's bits.

use super::CodeMap;

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
pub(super) struct KeyTable {
    /// `base | shift << 12` by `s << 5 | b`.
    pub(super) meta: [u16; 64],
    /// The bucket counts, padded with zeros to a multiple of 128 entries.
    pub(super) starts: Box<[u8]>,
}

impl KeyTable {
    /// The most buckets: four 128-entry halves of byte-permute tables.
    const MAX: usize = 512;

    /// The key table of `thresholds`, if at most [`KeyTable::MAX`] buckets of at most one
    /// threshold each cover every `|y| < 2`.
    pub(super) fn new(thresholds: &[f32]) -> Option<KeyTable> {
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
pub(super) fn byte_planes(table: &[f32], fill: f32) -> Box<[u8]> {
    (0..4)
        .flat_map(|p| {
            (0..256).map(move |c: usize| {
                let v = table.get(c).copied().unwrap_or(fill);
                (v.to_bits() >> (8 * p)) as u8
            })
        })
        .collect()
}

/// The low and high 16-bit halves of 256 entries of `table` (`f32` bit patterns; entries past
/// the end read `fill`): half `h` of entry `c` at `256 h + c`.
pub(super) fn word_planes(table: &[f32], fill: f32) -> Box<[u16]> {
    (0..2)
        .flat_map(|h| {
            (0..256).map(move |c: usize| {
                let v = table.get(c).copied().unwrap_or(fill);
                (v.to_bits() >> (16 * h)) as u16
            })
        })
        .collect()
}

/// `Some((o, l))` if `values[c] == f32(c - o) / f32(l)` for every code `c`, with `l` the
/// number of steps from the origin code `o` (the code of 0) to the last (see `CodeMap::grid`).
pub(super) fn uniform_grid(values: &[f32]) -> Option<(i32, f32)> {
    let origin = values.iter().position(|&v| v == 0.0)?;
    let steps = values.len() - 1 - origin;
    if steps == 0 {
        return None;
    }
    let (o, l) = (i32::try_from(origin).ok()?, steps as f32);
    // The vector kernels compute the values as `grid_value` does: a map where that gave another
    // bit than the division (none: a test checks every grid a map can have) would take the
    // kernels' table paths instead.
    let on_grid = values.iter().enumerate().all(|(c, &v)| {
        let k = c as i32 - o;
        v.to_bits() == (k as f32 / l).to_bits() && v.to_bits() == grid_value(k, l).to_bits()
    });
    on_grid.then_some((o, l))
}

/// A uniform grid's value `f32(k) / steps` as the vector kernels compute it, without a division:
/// `q0 = RN(k r)` with `r = RN(1 / steps)`, then one correction with the exact remainder `k -
/// steps q0` (Markstein's; docs/FORMATS.md, "Exact shortcuts of the CUDA specialized steps", has
/// the argument). The IEEE quotient's bits for every `|k| <= 255` and whole `steps` in 1..=255
/// (test `grid_values_by_reciprocal_are_the_quotients`).
pub(super) fn grid_value(k: i32, steps: f32) -> f32 {
    let (a, r) = (k as f32, 1.0 / steps);
    let q0 = a * r;
    (-steps).mul_add(q0, a).mul_add(r, q0)
}

/// Buckets are the top `1 + 8 + BUCKET_MANTISSA_BITS` bits of an f32: sign, exponent and the
/// first mantissa bits (2^16 one-byte entries, 64 KiB): fine enough that every bucket of the
/// shipped maps holds at most one threshold, so a search is one table read and one comparison.
const BUCKET_MANTISSA_BITS: u32 = 7;
pub(super) const BUCKET_SHIFT: u32 = 23 - BUCKET_MANTISSA_BITS;

#[inline]
fn bucket(y: f32) -> usize {
    (y.to_bits() >> BUCKET_SHIFT) as usize
}

/// The lowest and highest non-NaN f32 whose bit patterns fall in `bucket` (None for NaN-only
/// buckets). Positive patterns grow with the value, negative ones shrink.
pub(super) fn bucket_range(bucket: usize) -> Option<(f32, f32)> {
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

/// The smallest f32 that rounds to `hi` rather than `lo` (both f32, `lo < hi`) under the tie rule
/// of [`CodeMap::nearest`]. The midpoint is exact in f64: [`CodeMap::from_values`] refuses
/// neighbours whose exponents differ by more than 28.
pub(super) fn threshold(lo: f32, hi: f32) -> f32 {
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

impl CodeMap {
    /// The decision thresholds: `thresholds()[j]` is the smallest f32 `y` whose nearest code is
    /// `j + 1` or above. A GPU kernel can upload this table and reproduce [`CodeMap::nearest`]
    /// with f32 comparisons only.
    pub fn thresholds(&self) -> &[f32] {
        &self.thresholds
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

    /// The small search table of the 8-bit maps' vector kernels, for kernels that search the
    /// same way (lpmm-cuda's specialized steps keep it in shared memory): `(meta, starts)` such
    /// that for an f32 `y` with `|y| < 2` whose top 16 bits are `h` (sign `s`, exponent `e`, 7
    /// mantissa bits `m`), `b = e - 96` (0 for `e <= 96`), `meta[s << 5 | b] = base | shift << 12`
    /// and `c = starts[base + (m >> shift)]`, `nearest(y) = c + (thresholds()[c] <= y)` (no
    /// comparison where `c` is the last code). `None` for a map whose buckets would need more than
    /// 512 entries or hold two thresholds (none of the shipped maps).
    pub fn key_table(&self) -> Option<(&[u16; 64], &[u8])> {
        self.keys.as_ref().map(|k| (&k.meta, &k.starts[..]))
    }

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
}
