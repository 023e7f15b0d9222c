//! Rank-1 normalization (lpmm's best 4-bit second-moment setting): a tensor of shape
//! `(n_0, ..., n_{d-1})` keeps one max vector per dimension, `max_k[i] = max |x|` over all elements
//! whose index along dimension `k` is `i`, and scales element `(i_0, ..., i_{d-1})` by
//! `s = min_k max_k[i_k]`. Every `|x| <= s`, and `s` is much tighter than one tensor-wide scale.
//! Storage: `sum(n_k)` f32 instead of one per block.

use lpmm_formats::{CodeMap, packing};
use rayon::prelude::*;

use crate::blockwise::{BlockSize, Blockwise, MAX_BLOCK, QuantRounding};
use crate::error::QuantError;

/// The most dimensions a rank-1 tensor may have (scratch lives on the stack).
pub const MAX_DIMS: usize = 8;

/// Elements per rayon task (a multiple of 8, so every task starts on a byte boundary).
const CHUNK_ELEMENTS: usize = 1 << 16;

/// Rank-1 quantization of a tensor of 2 or more dimensions onto a code map.
#[derive(Debug, Clone)]
pub struct Rank1<'m> {
    map: &'m CodeMap,
    /// The shape in its first `ndim` entries (a fixed array: building a quantizer allocates
    /// nothing, so a fused optimizer step may build one per call).
    dims: [usize; MAX_DIMS],
    ndim: usize,
    len: usize,
}

impl<'m> Rank1<'m> {
    /// A quantizer for tensors of `shape` (row-major, at least 2 dimensions, none of them 0).
    pub fn new(map: &'m CodeMap, shape: &[usize]) -> Result<Self, QuantError> {
        if shape.len() < 2 || shape.len() > MAX_DIMS {
            return Err(QuantError::Rank1Dims { ndim: shape.len() });
        }
        // Codes are addressed in bits: keep `len * 8` representable.
        let len = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| n > 0 && n <= usize::MAX / 8);
        let len = len.ok_or_else(|| QuantError::Shape {
            shape: shape.to_vec(),
            len: 0,
        })?;
        let mut dims = [0; MAX_DIMS];
        dims[..shape.len()].copy_from_slice(shape);
        Ok(Self {
            map,
            dims,
            ndim: shape.len(),
            len,
        })
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.dims[..self.ndim]
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: zero-sized shapes are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes of packed codes.
    pub fn codes_len(&self) -> usize {
        packing::packed_len(self.len, self.map.bits())
    }

    /// Number of f32 scales: the per-dimension max vectors, dimension 0's first.
    pub fn scales_len(&self) -> usize {
        self.shape().iter().sum()
    }

    fn check(&self, n: usize, codes: usize, scales: usize) -> Result<(), QuantError> {
        if n != self.len {
            return Err(QuantError::Shape {
                shape: self.shape().to_vec(),
                len: n,
            });
        }
        for (what, expected, actual) in [
            ("codes", self.codes_len(), codes),
            ("rank-1 scales", self.scales_len(), scales),
        ] {
            if expected != actual {
                return Err(QuantError::Length {
                    what,
                    expected,
                    actual,
                });
            }
        }
        Ok(())
    }

    /// The multi-index of flat element `start` and where each dimension's max vector starts.
    fn position(&self, start: usize) -> ([usize; MAX_DIMS], [usize; MAX_DIMS]) {
        let (mut index, mut offsets) = ([0usize; MAX_DIMS], [0usize; MAX_DIMS]);
        let mut acc = 0;
        for (k, &d) in self.shape().iter().enumerate() {
            offsets[k] = acc;
            acc += d;
        }
        let mut rest = start;
        for k in (0..self.shape().len()).rev() {
            index[k] = rest % self.shape()[k];
            rest /= self.shape()[k];
        }
        (index, offsets)
    }

    /// Walks `start .. start + count` in runs along the last dimension: `f(flat, index, run)`
    /// with the multi-index of the run's first element. Allocation-free.
    fn for_each_run(&self, start: usize, count: usize, mut f: impl FnMut(usize, &[usize], usize)) {
        let nd = self.shape().len();
        let (mut index, _) = self.position(start);
        let last = nd - 1;
        let mut flat = start;
        let end = start + count;
        while flat < end {
            let run = (self.shape()[last] - index[last]).min(end - flat);
            f(flat, &index[..nd], run);
            flat += run;
            index[last] += run;
            // Carry into the outer dimensions.
            let mut k = last;
            while k > 0 && index[k] == self.shape()[k] {
                index[k] = 0;
                k -= 1;
                index[k] += 1;
            }
        }
    }

    /// Calls `f(flat_index, scale)` for every element of `start .. start + count`, in order,
    /// with `scale = min_k scales[k][i_k]` (the scales laid out as [`Rank1::scales_len`] says).
    /// Allocation-free, so a fused optimizer step can decode and encode any range with it.
    pub fn for_each_scale(
        &self,
        scales: &[f32],
        start: usize,
        count: usize,
        f: impl FnMut(usize, f32),
    ) {
        self.for_each_scale_with(|k| scales[k], start, count, f);
    }

    /// [`Rank1::for_each_scale`] with the scales read through `scale(k)` (word `k` of the
    /// layout), for scales held in memory that is not a slice of f32 (atomics, device words).
    pub fn for_each_scale_with(
        &self,
        scale: impl Fn(usize) -> f32,
        start: usize,
        count: usize,
        mut f: impl FnMut(usize, f32),
    ) {
        let (_, offsets) = self.position(0);
        let last = self.shape().len() - 1;
        self.for_each_run(start, count, |flat, index, run| {
            // Min over the outer dimensions, constant along the last one.
            let outer = (0..last)
                .map(|k| scale(offsets[k] + index[k]))
                .fold(f32::INFINITY, f32::min);
            let first = offsets[last] + index[last];
            for j in 0..run {
                f(flat + j, outer.min(scale(first + j)));
            }
        });
    }

    /// Folds `|values|` (elements `start ..` of the tensor) into the per-dimension max vectors
    /// `maxima` (laid out as the scales). Allocation-free: a sharded or chunked computation of
    /// the scales folds each part and then takes the element-wise max of the parts.
    pub fn fold_maxima(&self, values: &[f32], start: usize, maxima: &mut [f32]) {
        self.fold_maxima_with(values, start, |k, v| {
            let m = &mut maxima[k];
            *m = m.max(v);
        });
    }

    /// [`Rank1::fold_maxima`] through `fold(k, |x|)`, which must raise word `k` of the layout to
    /// at least `|x|` (an atomic max on the bits of a non-negative f32 will do: the result is the
    /// same in any order).
    pub fn fold_maxima_with(&self, values: &[f32], start: usize, mut fold: impl FnMut(usize, f32)) {
        let (_, offsets) = self.position(0);
        let last = self.shape().len() - 1;
        self.for_each_run(start, values.len(), |flat, index, run| {
            let run_values = &values[flat - start..][..run];
            let mut run_max = 0.0f32;
            let first = offsets[last] + index[last];
            for (j, &v) in run_values.iter().enumerate() {
                fold(first + j, v.abs());
                run_max = run_max.max(v.abs());
            }
            for k in 0..last {
                fold(offsets[k] + index[k], run_max);
            }
        });
    }

    /// Quantizes `x` (row-major, `len()` elements) into `codes` and the max vectors `scales`.
    /// Refuses non-finite values ([`QuantError::NonFinite`]) and, when the map has no negative
    /// values, negative ones ([`QuantError::Negative`]), before writing anything.
    pub fn quantize(
        &self,
        x: &[f32],
        codes: &mut [u8],
        scales: &mut [f32],
        rounding: QuantRounding,
    ) -> Result<(), QuantError> {
        self.check(x.len(), codes.len(), scales.len())?;
        crate::check_sign(self.map, x)?;
        if let Some(index) = x.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFinite {
                index,
                value: x[index],
            });
        }
        // Pass 1: the per-dimension max vectors. Tasks take ranges of dimension 0 (contiguous
        // memory), write dimension 0's maxima directly and reduce the others by element-wise max.
        let (dim0, rest) = scales.split_at_mut(self.shape()[0]);
        let inner_shape = &self.shape()[1..];
        let stride0 = self.len / self.shape()[0];
        let rows_per_task = (CHUNK_ELEMENTS / stride0).max(1);
        let partial = x
            .par_chunks(stride0 * rows_per_task)
            .zip(dim0.par_chunks_mut(rows_per_task))
            .map(|(xs, d0)| {
                let mut local = vec![0f32; rest.len()];
                for (row, m0) in xs.chunks(stride0).zip(d0.iter_mut()) {
                    *m0 = inner_maxima(inner_shape, row, &mut local);
                }
                local
            })
            .reduce_with(|mut a, b| {
                a.iter_mut().zip(&b).for_each(|(m, &v)| *m = m.max(v));
                a
            });
        if let Some(partial) = partial {
            rest.copy_from_slice(&partial);
        }
        // Pass 2: codes, in parallel chunks.
        let scales: &[f32] = scales;
        let bits = self.map.bits();
        let chunk_bytes = packing::packed_len(CHUNK_ELEMENTS, bits);
        let map = self.map;
        codes
            .par_chunks_mut(chunk_bytes)
            .enumerate()
            .for_each(|(c, out)| {
                let start = c * CHUNK_ELEMENTS;
                let count = CHUNK_ELEMENTS.min(self.len - start);
                let mut random = match rounding {
                    QuantRounding::Nearest => None,
                    QuantRounding::Stochastic { stream, offset } => {
                        Some(stream.draws_at(offset.wrapping_add(start as u64)))
                    }
                };
                let mut buf = [0u8; MAX_BLOCK];
                let mut filled = 0;
                let mut written = 0;
                self.for_each_scale(scales, start, count, |i, s| {
                    let y = if s == 0.0 { 0.0 } else { x[i] / s };
                    buf[filled] = match random.as_mut() {
                        None => map.nearest(y),
                        Some(r) => map.stochastic(y, r.next()),
                    };
                    filled += 1;
                    if filled == MAX_BLOCK || i + 1 == start + count {
                        let bytes = packing::packed_len(filled, bits);
                        // Lengths match and codes fit by construction.
                        let _ =
                            packing::pack(&buf[..filled], bits, &mut out[written..written + bytes]);
                        written += bytes;
                        filled = 0;
                    }
                });
            });
        Ok(())
    }

    /// Dequantizes: `map[code] * min_k max_k[i_k]`.
    pub fn dequantize(
        &self,
        codes: &[u8],
        scales: &[f32],
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        self.check(out.len(), codes.len(), scales.len())?;
        let bits = self.map.bits();
        out.par_chunks_mut(CHUNK_ELEMENTS)
            .enumerate()
            .for_each(|(c, out)| {
                let start = c * CHUNK_ELEMENTS;
                let byte0 = start * bits as usize / 8;
                self.for_each_scale(scales, start, out.len(), |i, s| {
                    // In range after the length check above.
                    let code = packing::get(&codes[byte0..], bits, i - start).unwrap_or(0);
                    out[i - start] = self.map.value(code) * s;
                });
            });
        Ok(())
    }
}

/// Folds `|x|` of one slice along dimension 0 (a tensor of `shape`, row-major) into the max
/// vectors `maxima` (those of `shape`'s dimensions, concatenated) and returns the slice's max.
fn inner_maxima(shape: &[usize], x: &[f32], maxima: &mut [f32]) -> f32 {
    let last = shape.len() - 1;
    let last_offset = maxima.len() - shape[last];
    let mut outer = vec![0usize; last];
    let offsets: Vec<usize> = shape
        .iter()
        .scan(0, |acc, &d| Some(std::mem::replace(acc, *acc + d)))
        .collect();
    let mut total = 0.0f32;
    for run in x.chunks(shape[last]) {
        let mut run_max = 0.0f32;
        for (m, &v) in maxima[last_offset..].iter_mut().zip(run) {
            *m = m.max(v.abs());
            run_max = run_max.max(v.abs());
        }
        total = total.max(run_max);
        for (k, &i) in outer.iter().enumerate() {
            let m = &mut maxima[offsets[k] + i];
            *m = m.max(run_max);
        }
        // Next outer multi-index (row-major odometer).
        for k in (0..last).rev() {
            outer[k] += 1;
            if outer[k] < shape[k] {
                break;
            }
            outer[k] = 0;
        }
    }
    total
}

/// The normalization a tensor's state uses: rank-1 for 2 or more dimensions, blocks for 1-D
/// (lpmm's rule for its 4-bit second moment).
#[derive(Debug, Clone)]
pub enum Rank1OrBlock<'m> {
    /// A matrix or N-d tensor.
    Rank1(Rank1<'m>),
    /// A vector (or a tensor whose shape is unknown).
    Block(Blockwise<'m>),
}

impl<'m> Rank1OrBlock<'m> {
    /// Rank-1 if `shape` has 2 or more dimensions, otherwise blocks of `fallback`.
    pub fn for_shape(
        map: &'m CodeMap,
        shape: &[usize],
        fallback: BlockSize,
    ) -> Result<Self, QuantError> {
        if shape.len() >= 2 {
            Ok(Self::Rank1(Rank1::new(map, shape)?))
        } else {
            Ok(Self::Block(Blockwise::new(map, fallback)))
        }
    }

    /// Bytes of packed codes for `n` elements.
    pub fn codes_len(&self, n: usize) -> usize {
        match self {
            Self::Rank1(r) => r.codes_len(),
            Self::Block(b) => b.codes_len(n),
        }
    }

    /// Number of f32 scales for `n` elements.
    pub fn scales_len(&self, n: usize) -> usize {
        match self {
            Self::Rank1(r) => r.scales_len(),
            Self::Block(b) => b.scales_len(n),
        }
    }

    /// Quantizes (see [`Rank1::quantize`] and [`Blockwise::quantize`]).
    pub fn quantize(
        &self,
        x: &[f32],
        codes: &mut [u8],
        scales: &mut [f32],
        rounding: QuantRounding,
    ) -> Result<(), QuantError> {
        match self {
            Self::Rank1(r) => r.quantize(x, codes, scales, rounding),
            Self::Block(b) => b.quantize(x, codes, scales, rounding),
        }
    }

    /// Dequantizes (see [`Rank1::dequantize`] and [`Blockwise::dequantize`]).
    pub fn dequantize(
        &self,
        codes: &[u8],
        scales: &[f32],
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        match self {
            Self::Rank1(r) => r.dequantize(codes, scales, out),
            Self::Block(b) => b.dequantize(codes, scales, out),
        }
    }
}
