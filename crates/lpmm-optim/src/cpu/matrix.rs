//! The matrix phase on the CPU (Muon's Newton–Schulz iterations): the workspace, its products
//! by the `gemm` crate (the GEMM candle uses), and the gather and fused passes of one
//! parameter around them.
//!
//! Determinism: `gemm` splits a product's output among threads and sums each output element
//! over its `k` dimension in one microkernel, in `k` order, in blocks of `kc` that depend on the
//! cache sizes and on `k`, never on the thread count. The products here are cut into blocks of
//! at most [`K_BLOCK`] along `k` (`gemm` sums a block of at most 512 whole), so each element is
//! the same sequence of operations on any thread count and any cache size; only `gemm`'s
//! microkernel for the machine's instruction set (AVX2 with FMA, AVX-512, NEON, scalar) sets the
//! rounding of each operation.

use rayon::prelude::*;

use crate::backend::{BackendError, HostValues, Mat, MatrixOp, MatrixShape, StepWork};

use super::passes::{fused_step, gather_piece};
use super::{Cpu, CpuParam, NAME, for_pieces, for_pieces_lent, lent_stride};

/// The longest run of the `k` dimension one `gemm` call sums: `gemm` sums runs of at most 512
/// without cutting them ([`gemm_common::cache::kernel_params`] never takes `kc` below 512 or
/// above `k`), so the sums do not depend on the cache sizes it reads.
pub(crate) const K_BLOCK: usize = 512;

/// The CPU's matrix-phase workspace ([`crate::backend::Backend::Matrices`]): two matrices of the
/// parameter's size (the iterate and the next one, in the parameter's row-major layout) and two
/// `m × m` ones (row-major), all f32.
#[derive(Debug)]
pub struct CpuMatrices {
    /// `Update` and `Next` (which is which: `update`).
    x: [Vec<f32>; 2],
    update: usize,
    gram: Vec<f32>,
    poly: Vec<f32>,
    /// The shape of the phase being run (set by `matrix_in`).
    shape: Option<MatrixShape>,
}

impl CpuMatrices {
    pub(super) fn new(elements: usize, square: usize) -> Result<CpuMatrices, BackendError> {
        let alloc = |n: usize| -> Result<Vec<f32>, BackendError> {
            let mut v = Vec::new();
            v.try_reserve_exact(n)
                .map_err(|_| BackendError::OutOfMemory {
                    backend: NAME,
                    bytes: 4 * n as u64,
                })?;
            v.resize(n, 0.0);
            Ok(v)
        };
        Ok(CpuMatrices {
            x: [alloc(elements)?, alloc(elements)?],
            update: 0,
            gram: alloc(square)?,
            poly: alloc(square)?,
            shape: None,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        4 * (self.x[0].len() + self.x[1].len() + self.gram.len() + self.poly.len())
    }

    /// Room for a phase of `shape`.
    fn fits(&self, shape: MatrixShape) -> bool {
        shape.numel() <= self.x[0].len() && shape.square() <= self.gram.len()
    }

    /// The phase's result (or input): [`Mat::Update`] in the parameter's layout.
    pub(super) fn update(&self, numel: usize) -> &[f32] {
        &self.x[self.update][..numel]
    }

    /// A matrix's first element and its (row, column) strides in the phase's wide view.
    fn view(&mut self, mat: Mat, shape: MatrixShape) -> (*mut f32, isize, isize) {
        let wide = |buf: &mut Vec<f32>| -> (*mut f32, isize, isize) {
            let cols = shape.cols as isize;
            if shape.transposed() {
                (buf.as_mut_ptr(), 1, cols)
            } else {
                (buf.as_mut_ptr(), cols, 1)
            }
        };
        let m = shape.m() as isize;
        match mat {
            Mat::Update => wide(&mut self.x[self.update]),
            Mat::Next => wide(&mut self.x[1 - self.update]),
            Mat::Gram => (self.gram.as_mut_ptr(), m, 1),
            Mat::Poly => (self.poly.as_mut_ptr(), m, 1),
        }
    }

    /// The buffer that holds `mat`.
    fn buffer(&mut self, mat: Mat) -> &mut Vec<f32> {
        match mat {
            Mat::Update => &mut self.x[self.update],
            Mat::Next => &mut self.x[1 - self.update],
            Mat::Gram => &mut self.gram,
            Mat::Poly => &mut self.poly,
        }
    }

    fn len_of(mat: Mat, shape: MatrixShape) -> usize {
        match mat {
            Mat::Update | Mat::Next => shape.numel(),
            Mat::Gram | Mat::Poly => shape.square(),
        }
    }

    /// One operation of the phase.
    pub(super) fn run(&mut self, op: MatrixOp) -> Result<(), BackendError> {
        let shape = self
            .shape
            .ok_or_else(|| bad("an operation before its matrix input"))?;
        match op {
            MatrixOp::Swap => {
                self.update = 1 - self.update;
                Ok(())
            }
            MatrixOp::Product {
                out,
                lhs,
                rhs,
                rhs_transposed,
                alpha,
                add,
            } => {
                let (p, k) = shape.dims(lhs);
                let (rk, q) = match (shape.dims(rhs), rhs_transposed) {
                    ((r, c), false) => (r, c),
                    ((r, c), true) => (c, r),
                };
                if k != rk || shape.dims(out) != (p, q) || out == lhs || out == rhs {
                    return Err(bad(&format!(
                        "{out:?} = {lhs:?} · {rhs:?}{}: the shapes do not fit, or the result \
                         overwrites a factor",
                        if rhs_transposed { "ᵀ" } else { "" }
                    )));
                }
                let read_dst = match add {
                    None => false,
                    Some((src, _)) if src == out => true,
                    Some((src, _)) => {
                        if shape.dims(src) != (p, q) {
                            return Err(bad(&format!("{out:?} + {src:?}: the shapes differ")));
                        }
                        // Same dimensions, same layout (a square matrix's wide view is itself):
                        // a copy, through a buffer taken out for the while (no allocation).
                        let len = Self::len_of(out, shape);
                        let from = std::mem::take(self.buffer(src));
                        self.buffer(out)[..len].copy_from_slice(&from[..len]);
                        *self.buffer(src) = from;
                        true
                    }
                };
                let beta = add.map_or(0.0, |(_, b)| b);
                let (dst, dst_rs, dst_cs) = self.view(out, shape);
                let (a, a_rs, a_cs) = self.view(lhs, shape);
                let (b, b_rs, b_cs) = match (self.view(rhs, shape), rhs_transposed) {
                    ((ptr, rs, cs), false) => (ptr, rs, cs),
                    ((ptr, rs, cs), true) => (ptr, cs, rs),
                };
                for (block, start) in (0..k).step_by(K_BLOCK).enumerate() {
                    let kb = K_BLOCK.min(k - start);
                    let first = block == 0;
                    // SAFETY: `dst`, `a` and `b` point to the workspace's buffers, each holding
                    // the whole matrix its view describes (`fits` was checked by `matrix_in`
                    // for this shape): `dst` is `p × q` with strides (dst_rs, dst_cs), `a` the
                    // `p × k` left factor, `b` the `k × q` right one, and the offsets
                    // `start * a_cs`, `start * b_rs` stay inside them (`start + kb <= k`).
                    // `dst` is a different buffer from `a` and `b` (`out` is neither `lhs` nor
                    // `rhs`, and each `Mat` is its own buffer), so the write aliases no read.
                    unsafe {
                        gemm::gemm(
                            p,
                            q,
                            kb,
                            dst,
                            dst_cs,
                            dst_rs,
                            read_dst || !first,
                            a.offset(start as isize * a_cs),
                            a_cs,
                            a_rs,
                            b.offset(start as isize * b_rs),
                            b_cs,
                            b_rs,
                            if first { beta } else { 1.0 },
                            alpha,
                            false,
                            false,
                            false,
                            gemm::Parallelism::Rayon(0),
                        );
                    }
                }
                Ok(())
            }
        }
    }
}

fn bad(what: &str) -> BackendError {
    BackendError::Buffer {
        what: format!("matrix phase: {what}"),
    }
}

/// Runs `f` on parameter `index` of a batch with its plan, its part of the released gradient
/// and its lent buffer.
fn with_param<T>(
    work: &mut StepWork<'_, '_, '_, Cpu>,
    index: usize,
    f: impl FnOnce(
        &mut CpuParam,
        &crate::backend::ParamLayout,
        &crate::backend::ParamStep,
        Option<HostValues<'_>>,
        Option<&mut [u8]>,
    ) -> T,
) -> Result<T, BackendError> {
    let plan = work
        .plans
        .get(index)
        .copied()
        .flatten()
        .ok_or_else(|| bad("a parameter that does not step in this batch"))?;
    let released = work.released.filter(|(i, _)| *i == index).map(|(_, g)| g);
    let layout = &work.layouts[index];
    let lent = work
        .lent
        .iter_mut()
        .find(|(id, _)| id.index() == index)
        .map(|(_, b)| b.bytes_mut());
    if layout.lent && lent.is_none() {
        return Err(bad("a lent parameter without its buffer"));
    }
    Ok(f(&mut work.params[index], layout, &plan, released, lent))
}

impl Cpu {
    pub(super) fn gather(
        work: &mut StepWork<'_, '_, '_, Cpu>,
        index: usize,
        shape: MatrixShape,
        matrices: &mut CpuMatrices,
    ) -> Result<(), BackendError> {
        if !matrices.fits(shape) || work.layouts.get(index).map(|l| l.numel) != Some(shape.numel())
        {
            return Err(bad(
                "a matrix larger than the workspace, or not the parameter's",
            ));
        }
        matrices.shape = Some(shape);
        matrices.update = 0;
        let x = &mut matrices.x[0][..shape.numel()];
        with_param(work, index, |param, layout, plan, released, lent| {
            let CpuParam { pieces, wide, .. } = &*param;
            let stride = lent_stride(layout);
            let lent = lent.as_deref();
            let gather = |k: usize, piece: &super::Piece, out: &mut [f32]| {
                let lent =
                    lent.map(|l| &l[(k * stride).min(l.len())..((k + 1) * stride).min(l.len())]);
                gather_piece(piece, layout, wide, plan, released, lent, out);
            };
            match &pieces[..] {
                [one] => gather(0, one, x),
                many => many
                    .par_iter()
                    .zip(x.par_chunks_mut(super::PIECE))
                    .enumerate()
                    .for_each(|(k, (piece, out))| gather(k, piece, out)),
            }
        })
    }

    pub(super) fn scatter(
        work: &mut StepWork<'_, '_, '_, Cpu>,
        index: usize,
        matrices: &CpuMatrices,
    ) -> Result<bool, BackendError> {
        let numel = work.layouts.get(index).map_or(0, |l| l.numel);
        if matrices.shape.map(|s| s.numel()) != Some(numel) {
            return Err(bad("the workspace holds another parameter's matrix"));
        }
        let result = matrices.update(numel);
        let seed = work.seed;
        with_param(work, index, |param, layout, plan, released, lent| {
            let CpuParam { pieces, wide, .. } = param;
            let wide = &*wide;
            let part = |piece: &super::Piece| &result[piece.offset..piece.offset + piece.len];
            match lent {
                Some(l) => for_pieces_lent(pieces, l, lent_stride(layout), |piece, l| {
                    let x = part(piece);
                    piece.saw_non_finite =
                        fused_step(piece, layout, wide, plan, seed, released, Some(l), Some(x));
                }),
                None => for_pieces(pieces, |piece| {
                    let x = part(piece);
                    piece.saw_non_finite =
                        fused_step(piece, layout, wide, plan, seed, released, None, Some(x));
                }),
            }
            pieces.iter().any(|p| p.saw_non_finite)
        })
    }
}
