//! The CPU backend: the reference implementation of every [`Backend`] operation.
//!
//! A parameter is held as pieces of at most 2^16 elements (a multiple of every block size); the
//! step runs the pieces of all stepping parameters in parallel (rayon), so one big tensor uses
//! every thread and thousands of small ones are batched into a few tasks. Each piece is
//! processed in chunks of 4096 elements with f32 scratch on the stack: nothing is allocated
//! during a step. Every slot is its format's regions ([`crate::backend::RegionSpec`]): element
//! regions as words per piece, tensor-wide ones once per parameter (atomics, so the folds of a
//! two-phase step can run on all pieces at once in any order).

use std::sync::atomic::{AtomicU32, Ordering};

use rayon::prelude::*;

use crate::backend::{
    Backend, BackendError, Dtype, Folded, HostRegion, HostSlot, HostValues, HostValuesMut, Init,
    MatrixOp, MatrixShape, ParamLayout, Phase, SLOTS, STAT_WORDS, SlotKind, StepPlan, StepWork,
};
use crate::exact::{ExactSum, add_squares};
use crate::format::{
    MAX_REGIONS, Place, Random, Regions, RegionsMut, Walked, bytes_of, bytes_of_mut,
};
use crate::vocab::{CHUNK, fits};

mod matrix;
mod passes;
mod tile;

pub use matrix::CpuMatrices;
use passes::{decode_slot, fold_all, for_stepping, fused_step};
pub use tile::Kernel;

/// Elements per piece: small enough that one tensor of 128K–256K elements, as a per-tensor
/// optimizer (burn's `ModuleOptimizer`) steps it alone, keeps two threads busy (with pieces of
/// 2^18, 8-bit AdamW stepped a 256K tensor at 2.1 ns/param on two Zen 4 cores, 1.2 with 2^16),
/// large enough that the per-piece dispatch is noise (1M to 64M within ±4%; `step_profile`,
/// docs/BENCHMARKS.md), and the bookkeeping (about 0.9 KiB a piece) a rounding error.
pub(crate) const PIECE: usize = 1 << 16;

const NAME: &str = "cpu";

/// The CPU backend (multi-threaded with rayon's global pool, or the pool the caller installs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

impl Cpu {
    /// The name of the CPU kernel that runs `plan`'s fused pass: its slots' lanes (parameter and
    /// states, "bf16 q q -"), or "generic" for the element-wise path.
    pub fn kernel_name(plan: &StepPlan) -> String {
        Kernel::for_plan(plan).map_or_else(|| "generic".into(), |k| k.describe().to_string())
    }
}

/// One parameter on the CPU.
#[derive(Debug)]
pub struct CpuParam {
    pieces: Vec<Piece>,
    /// Each slot's tensor-wide regions.
    wide: [Vec<Box<[AtomicU32]>>; SLOTS],
    /// The folds of the rule's sums of squares (scratch, in place: no allocation).
    stats: [AtomicU32; STAT_WORDS],
}

/// A contiguous range of one parameter with its slots' element regions.
#[derive(Debug)]
struct Piece {
    offset: usize,
    len: usize,
    /// Each slot's element regions, as words (a lent parameter's primary region is empty).
    regions: [Vec<Vec<u32>>; SLOTS],
    /// The byte length of each element region for this piece.
    bytes: [[usize; MAX_REGIONS]; SLOTS],
    /// Whether the gradient accumulator's element regions are allocated. They are allocated on
    /// the first accumulation (or import): a parameter stepped only from given gradients
    /// (`Step::given`, released steps) never holds an accumulator. Unallocated, it reads as
    /// zeros, which is what a fresh accumulator holds.
    grad_held: bool,
    /// Results of the last pass, kept here so a step allocates nothing.
    grad_sum: ExactSum,
    grad_finite: bool,
    saw_non_finite: bool,
}

/// Runs `f` on every piece of one parameter: inline for a single piece (a small tensor must not
/// pay a thread-pool dispatch per call), in parallel otherwise.
fn for_pieces(pieces: &mut [Piece], f: impl Fn(&mut Piece) + Sync + Send) {
    match pieces {
        [one] => f(one),
        many => many.par_iter_mut().for_each(f),
    }
}

/// Like [`for_pieces`], each piece with its part of a lent buffer (`stride` bytes per piece).
fn for_pieces_lent(
    pieces: &mut [Piece],
    lent: &mut [u8],
    stride: usize,
    f: impl Fn(&mut Piece, &mut [u8]) + Sync + Send,
) {
    match pieces {
        [one] => f(one, lent),
        many => many
            .par_iter_mut()
            .zip(lent.par_chunks_mut(stride.max(1)))
            .for_each(|(p, l)| f(p, l)),
    }
}

impl Piece {
    /// Allocates the gradient accumulator's element regions (fresh: zero) if they are not yet.
    fn hold_grad(&mut self, layout: &ParamLayout) {
        let Some(format) = layout.format(SlotKind::Grad) else {
            return;
        };
        if self.grad_held {
            return;
        }
        let specs = format.regions(&layout.shape);
        for (k, r) in specs.iter().filter(|r| r.per_element()).enumerate() {
            let mut words = vec![0u32; r.words(self.len)];
            format.fresh(k, &mut words, self.len);
            self.regions[SlotKind::Grad as usize][k] = words;
        }
        self.grad_held = true;
    }

    /// Whether `slot`'s element regions are allocated (only the accumulator's may not be).
    fn holds(&self, slot: SlotKind) -> bool {
        slot != SlotKind::Grad || self.grad_held
    }

    /// Read-only views of `slot`'s regions (`lent`: the piece's part of a lent primary region).
    fn view<'a>(
        &'a self,
        slot: SlotKind,
        wide: &'a [Box<[AtomicU32]>],
        shape: &'a [usize],
        lent: Option<&'a [u8]>,
    ) -> Regions<'a> {
        let s = slot as usize;
        let mut elem: [&[u8]; MAX_REGIONS] = Default::default();
        for (k, (e, w)) in elem.iter_mut().zip(&self.regions[s]).enumerate() {
            // A lent region holds no words here (the caller's buffer stands in below).
            *e = bytes_of(w, self.bytes[s][k].min(4 * w.len()));
        }
        if let Some(l) = lent {
            elem[0] = l;
        }
        Regions {
            elem,
            wide,
            global: self.offset,
            shape,
        }
    }
}

/// The element regions of one piece slot as bytes (a lent region holds no words: empty).
fn elem_bytes<'a>(
    regions: &'a mut [Vec<u32>],
    bytes: &[usize; MAX_REGIONS],
) -> [&'a mut [u8]; MAX_REGIONS] {
    let mut elem: [&mut [u8]; MAX_REGIONS] = Default::default();
    for (k, (e, w)) in elem.iter_mut().zip(regions.iter_mut()).enumerate() {
        let n = bytes[k].min(4 * w.len());
        *e = bytes_of_mut(w, n);
    }
    elem
}

/// Writable views of one piece slot's regions.
fn view_mut<'a>(
    regions: &'a mut [Vec<u32>],
    bytes: &[usize; MAX_REGIONS],
    wide: &'a [Box<[AtomicU32]>],
    global: usize,
    shape: &'a [usize],
    lent: Option<&'a mut [u8]>,
) -> RegionsMut<'a> {
    // A lent region holds no words here (the caller's buffer stands in below).
    let mut elem = elem_bytes(regions, bytes);
    if let Some(l) = lent {
        elem[0] = l;
    }
    RegionsMut {
        elem,
        wide,
        global,
        shape,
    }
}

fn random(layout: &ParamLayout, seed: u64, slot: SlotKind, counter: u64, index: usize) -> Random {
    Random {
        stream: layout.stream(seed, slot, counter),
        index: layout.offset + index as u64,
    }
}

/// Bytes of the primary region per full piece (how a lent buffer is cut across pieces): one
/// value of the lendable dtype per element.
fn lent_stride(layout: &ParamLayout) -> usize {
    layout
        .format(SlotKind::Param)
        .and_then(|f| f.lendable())
        .map_or(0, |d| PIECE * d.size())
}

fn unsupported(what: &str) -> BackendError {
    BackendError::Unsupported {
        backend: NAME,
        what: what.into(),
    }
}

impl Backend for Cpu {
    type Param = CpuParam;
    type Input<'a> = HostValues<'a>;
    type Output<'a> = HostValuesMut<'a>;
    type Matrices = CpuMatrices;

    fn name(&self) -> &'static str {
        NAME
    }

    fn host_input<'a>(&self, values: HostValues<'a>) -> HostValues<'a> {
        values
    }

    fn host_output<'a>(&self, out: HostValuesMut<'a>) -> HostValuesMut<'a> {
        out
    }

    fn input_info(&self, input: &HostValues<'_>) -> (Dtype, usize) {
        input.info()
    }

    fn output_info(&self, output: &HostValuesMut<'_>) -> (Dtype, usize) {
        output.info()
    }

    fn allocate(
        &self,
        layout: &ParamLayout,
        init: Init<'_, Self>,
        seed: u64,
    ) -> Result<CpuParam, BackendError> {
        let specs = layout.formats.map(|f| f.map(|f| f.regions(&layout.shape)));
        let wide = specs.clone().map(|s| {
            s.unwrap_or_default()
                .iter()
                .filter(|r| !r.per_element())
                .map(|r| {
                    (0..r.words(layout.numel))
                        .map(|_| AtomicU32::new(0))
                        .collect()
                })
                .collect()
        });
        let mut pieces = Vec::with_capacity(layout.numel.div_ceil(PIECE));
        for offset in (0..layout.numel).step_by(PIECE) {
            let len = PIECE.min(layout.numel - offset);
            let mut regions: [Vec<Vec<u32>>; SLOTS] = Default::default();
            let mut bytes = [[0usize; MAX_REGIONS]; SLOTS];
            for (s, spec) in specs.iter().enumerate() {
                let (Some(spec), Some(format)) = (spec, layout.formats[s]) else {
                    continue;
                };
                for (k, r) in spec.iter().filter(|r| r.per_element()).enumerate() {
                    bytes[s][k] = r.bytes(len);
                    // A lent primary region and the accumulator (until used) hold no words.
                    let lent_here = s == SlotKind::Param as usize && k == 0 && layout.lent;
                    let absent = lent_here || s == SlotKind::Grad as usize;
                    let mut words = vec![0u32; if absent { 0 } else { r.words(len) }];
                    if !absent {
                        format.fresh(k, &mut words, len);
                    }
                    regions[s].push(words);
                }
            }
            pieces.push(Piece {
                offset,
                len,
                regions,
                bytes,
                grad_sum: ExactSum::new(),
                grad_finite: true,
                saw_non_finite: false,
                grad_held: false,
            });
        }
        let mut param = CpuParam {
            pieces,
            wide,
            stats: Default::default(),
        };
        if let (Init::Values(values), Some(format)) = (init, layout.format(SlotKind::Param)) {
            let shape = &layout.shape[..];
            let wide = &param.wide[0];
            // Sequential: registration must not start the thread pool.
            param.pieces.iter_mut().for_each(|piece| {
                let mut vals = [0f32; CHUNK];
                let (offset, len) = (piece.offset, piece.len);
                let mut r = view_mut(
                    &mut piece.regions[0],
                    &piece.bytes[0],
                    wide,
                    offset,
                    shape,
                    None,
                );
                for start in (0..len).step_by(CHUNK) {
                    let vals = &mut vals[..CHUNK.min(len - start)];
                    values.read_f32(offset + start, vals);
                    let at = offset + start;
                    format.encode(
                        &mut r,
                        start,
                        vals,
                        random(layout, seed, SlotKind::Param, 0, at),
                    );
                }
            });
        }
        Ok(param)
    }

    fn accumulate(
        &self,
        param: &mut CpuParam,
        layout: &ParamLayout,
        counter: u64,
        grad: HostValues<'_>,
        seed: u64,
    ) -> Result<(), BackendError> {
        let Some(format) = layout.format(SlotKind::Grad) else {
            return Err(unsupported(
                "accumulating into a parameter without an accumulator",
            ));
        };
        let (shape, wide) = (&layout.shape[..], &param.wide[1]);
        for_pieces(&mut param.pieces, |piece| {
            piece.hold_grad(layout);
            let (mut acc, mut g) = ([0f32; CHUNK], [0f32; CHUNK]);
            let (offset, len) = (piece.offset, piece.len);
            for start in (0..len).step_by(CHUNK) {
                let n = CHUNK.min(len - start);
                let (acc, g) = (&mut acc[..n], &mut g[..n]);
                if piece.grad_held {
                    format.decode(&piece.view(SlotKind::Grad, wide, shape, None), start, acc);
                } else {
                    // An accumulator not yet allocated holds zeros.
                    acc.fill(0.0);
                }
                grad.read_f32(offset + start, g);
                acc.iter_mut().zip(g.iter()).for_each(|(a, &x)| *a += x);
                let mut r = view_mut(
                    &mut piece.regions[1],
                    &piece.bytes[1],
                    wide,
                    offset,
                    shape,
                    None,
                );
                let at = offset + start;
                format.encode(
                    &mut r,
                    start,
                    acc,
                    random(layout, seed, SlotKind::Grad, counter, at),
                );
            }
        });
        Ok(())
    }

    fn fits(&self, values: HostValues<'_>, limit: f32) -> Result<bool, BackendError> {
        // One vectorized pass on all threads (NaN and Inf patterns exceed every finite one), in
        // chunks of a piece; a single chunk inline (no thread-pool dispatch for a small tensor).
        let limit = limit.abs().min(f32::MAX).to_bits();
        let f32s = |c: &[f32]| lpmm_formats::simd::abs_max_bits(c) <= limit;
        let bf16s = |c: &[lpmm_formats::bf16]| c.iter().all(|x| fits(x.to_f32(), limit));
        Ok(match values {
            HostValues::F32(v) if v.len() <= PIECE => f32s(v),
            HostValues::F32(v) => v.par_chunks(PIECE).all(f32s),
            HostValues::Bf16(v) if v.len() <= PIECE => bf16s(v),
            HostValues::Bf16(v) => v.par_chunks(PIECE).all(bf16s),
        })
    }

    fn accumulate_fits(
        &self,
        param: &CpuParam,
        layout: &ParamLayout,
        grad: HostValues<'_>,
    ) -> Result<bool, BackendError> {
        let Some(format) = layout.format(SlotKind::Grad) else {
            return Err(unsupported(
                "accumulating into a parameter without an accumulator",
            ));
        };
        let limit = format.limit_bits();
        let (shape, wide) = (&layout.shape[..], &param.wide[1]);
        let piece_fits = |piece: &Piece| {
            let (mut acc, mut g) = ([0f32; CHUNK], [0f32; CHUNK]);
            (0..piece.len).step_by(CHUNK).all(|start| {
                let n = CHUNK.min(piece.len - start);
                let (acc, g) = (&mut acc[..n], &mut g[..n]);
                if piece.grad_held {
                    format.decode(&piece.view(SlotKind::Grad, wide, shape, None), start, acc);
                } else {
                    // An accumulator not yet allocated holds zeros.
                    acc.fill(0.0);
                }
                grad.read_f32(piece.offset + start, g);
                // The sum exactly as `accumulate` forms it.
                acc.iter().zip(g.iter()).all(|(&a, &x)| fits(a + x, limit))
            })
        };
        Ok(match &param.pieces[..] {
            [one] => piece_fits(one),
            many => many.par_iter().all(piece_fits),
        })
    }

    fn input_stats(&self, values: HostValues<'_>) -> Result<(ExactSum, bool), BackendError> {
        // The partials of 256 elements stay whole inside chunks of 2^16, which are summed in
        // parallel and merged exactly.
        let (n, chunk) = (values.info().1, 1 << 16);
        let parts: Vec<(ExactSum, bool)> = (0..n)
            .into_par_iter()
            .step_by(chunk)
            .map(|start| {
                let mut buf = vec![0f32; chunk.min(n - start)];
                values.read_f32(start, &mut buf);
                let mut sum = ExactSum::new();
                let finite = add_squares(&buf, &mut sum);
                (sum, finite)
            })
            .collect();
        let mut total = (ExactSum::new(), true);
        for (s, f) in &parts {
            total.0.merge(s);
            total.1 &= f;
        }
        Ok(total)
    }

    fn gradient_stats(
        &self,
        params: &mut [CpuParam],
        layouts: &[ParamLayout],
        select: &[bool],
        out: &mut [(ExactSum, bool)],
    ) -> Result<(), BackendError> {
        params
            .par_iter_mut()
            .zip(layouts.par_iter())
            .zip(select.par_iter())
            .filter(|(_, s)| **s)
            .flat_map(|((p, l), _)| {
                let wide = &p.wide[1];
                p.pieces.par_iter_mut().map(move |piece| (piece, l, wide))
            })
            .for_each(|(piece, layout, wide)| {
                let mut acc = [0f32; CHUNK];
                let (mut sum, mut finite) = (ExactSum::new(), true);
                for c in (0..piece.len).step_by(CHUNK) {
                    let a = &mut acc[..CHUNK.min(piece.len - c)];
                    decode_slot(layout, piece, wide, SlotKind::Grad, None, c, a);
                    // One f64 partial per 256 elements, added exactly: the norm does not
                    // depend on how they are grouped into pieces or shards.
                    finite &= add_squares(a, &mut sum);
                }
                piece.grad_sum = sum;
                piece.grad_finite = finite;
            });
        // Exact sums: the same norm for any thread count, piece size or sharding.
        for ((p, &s), o) in params.iter().zip(select).zip(out.iter_mut()) {
            *o = (ExactSum::new(), true);
            if s {
                for piece in &p.pieces {
                    o.0.merge(&piece.grad_sum);
                    o.1 &= piece.grad_finite;
                }
            }
        }
        Ok(())
    }

    fn begin_phase(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        phase: Phase,
    ) -> Result<(), BackendError> {
        let zero = |w: &AtomicU32| w.store(0, Ordering::Relaxed);
        for ((p, layout), plan) in work.params.iter_mut().zip(work.layouts).zip(work.plans) {
            if !plan.is_some_and(|p| p.plan.passes(phase, p.flags) > 0) {
                continue;
            }
            match phase {
                Phase::Stats => p.stats.iter().for_each(zero),
                Phase::Slot(slot) => {
                    if let Some(f) = layout.format(slot) {
                        for &k in f.fold_targets() {
                            p.wide[slot as usize][k].iter().for_each(zero);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn fold(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        phase: Phase,
        pass: usize,
    ) -> Result<(), BackendError> {
        for_stepping(work, |param, layout, plan, released, lent| {
            if pass < plan.plan.passes(phase, plan.flags) {
                let CpuParam {
                    pieces,
                    wide,
                    stats,
                } = &*param;
                let lent = lent.as_deref();
                fold_all(
                    pieces, layout, wide, stats, plan, phase, pass, released, lent,
                );
            }
        });
        Ok(())
    }

    fn folded(
        &self,
        params: &mut [CpuParam],
        _layouts: &[ParamLayout],
        ran: &[bool],
        phase: Phase,
        combine: &mut dyn FnMut(usize, Folded<'_>),
    ) -> Result<(), BackendError> {
        for (i, (p, &ran)) in params.iter().zip(ran).enumerate() {
            if ran {
                combine(
                    i,
                    match phase {
                        Phase::Stats => Folded::Stats(&p.stats),
                        Phase::Slot(slot) => Folded::Wide(&p.wide[slot as usize]),
                    },
                );
            }
        }
        Ok(())
    }

    fn fused(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        non_finite: &mut [bool],
    ) -> Result<(), BackendError> {
        let seed = work.seed;
        for_stepping(work, |param, layout, plan, released, lent| {
            let CpuParam { pieces, wide, .. } = param;
            let wide = &*wide;
            match lent {
                Some(l) => for_pieces_lent(pieces, l, lent_stride(layout), |piece, l| {
                    piece.saw_non_finite =
                        fused_step(piece, layout, wide, plan, seed, released, Some(l), None);
                }),
                None => for_pieces(pieces, |piece| {
                    piece.saw_non_finite =
                        fused_step(piece, layout, wide, plan, seed, released, None, None);
                }),
            }
        });
        for ((p, plan), f) in work
            .params
            .iter()
            .zip(work.plans)
            .zip(non_finite.iter_mut())
        {
            *f = plan.is_some() && p.pieces.iter().any(|piece| piece.saw_non_finite);
        }
        Ok(())
    }

    fn swap_wide(&self, param: &mut CpuParam, slot: SlotKind, a: usize, b: usize) {
        param.wide[slot as usize].swap(a, b);
    }

    fn matrices(&self, elements: usize, square: usize) -> Result<CpuMatrices, BackendError> {
        CpuMatrices::new(elements, square)
    }

    fn matrices_bytes(&self, matrices: &CpuMatrices) -> usize {
        matrices.bytes()
    }

    fn matrix_in(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        index: usize,
        shape: MatrixShape,
        matrices: &mut CpuMatrices,
    ) -> Result<(), BackendError> {
        Cpu::gather(work, index, shape, matrices)
    }

    fn matrix_op(&self, matrices: &mut CpuMatrices, op: MatrixOp) -> Result<(), BackendError> {
        matrices.run(op)
    }

    fn matrix_out(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        index: usize,
        matrices: &CpuMatrices,
    ) -> Result<bool, BackendError> {
        Cpu::scatter(work, index, matrices)
    }

    fn clear_gradients(
        &self,
        params: &mut [CpuParam],
        layouts: &[ParamLayout],
        only: Option<usize>,
    ) -> Result<(), BackendError> {
        for (i, (p, layout)) in params.iter_mut().zip(layouts).enumerate() {
            if only.is_some_and(|o| o != i) {
                continue;
            }
            let Some(format) = layout.format(SlotKind::Grad) else {
                continue;
            };
            let (shape, wide) = (&layout.shape[..], &p.wide[1]);
            for piece in p.pieces.iter_mut().filter(|p| p.grad_held) {
                let (offset, len) = (piece.offset, piece.len);
                let mut r = view_mut(
                    &mut piece.regions[1],
                    &piece.bytes[1],
                    wide,
                    offset,
                    shape,
                    None,
                );
                format.clear(&mut r, 0, len);
            }
        }
        Ok(())
    }

    fn read(
        &self,
        param: &CpuParam,
        layout: &ParamLayout,
        slot: SlotKind,
        out: HostValuesMut<'_>,
    ) -> Result<(), BackendError> {
        if slot == SlotKind::Param && layout.lent {
            return Err(unsupported(
                "reading a lent parameter (it is the caller's buffer)",
            ));
        }
        let wide = &param.wide[slot as usize];
        let mut out = out;
        for piece in &param.pieces {
            let mut buf = [0f32; CHUNK];
            for start in (0..piece.len).step_by(CHUNK) {
                let n = CHUNK.min(piece.len - start);
                let at = piece.offset + start;
                match &mut out {
                    HostValuesMut::F32(o) => {
                        decode_slot(layout, piece, wide, slot, None, start, &mut o[at..at + n])
                    }
                    HostValuesMut::Bf16(o) => {
                        decode_slot(layout, piece, wide, slot, None, start, &mut buf[..n]);
                        lpmm_formats::simd::f32_to_bf16_nearest(&buf[..n], &mut o[at..at + n]);
                    }
                }
            }
        }
        Ok(())
    }

    fn export(
        &self,
        param: &CpuParam,
        layout: &ParamLayout,
        slot: SlotKind,
        lent: Option<HostValues<'_>>,
    ) -> Result<HostSlot, BackendError> {
        let Some(format) = layout.format(slot) else {
            return Ok(HostSlot::empty());
        };
        let lent_here = slot == SlotKind::Param && layout.lent;
        if lent_here {
            match lent {
                Some(l) => self.check_lent(layout, l.info())?,
                None => return Err(unsupported("exporting a lent parameter without its buffer")),
            }
        }
        let mut regions = Vec::new();
        for Walked { spec, place, .. } in format.walk(&layout.shape, None) {
            let bytes = match place {
                Place::Element(k) => match (lent_here && k == 0, lent) {
                    (true, Some(l)) => l.bytes().to_vec(),
                    _ => {
                        let mut out = Vec::with_capacity(spec.bytes(layout.numel));
                        for p in &param.pieces {
                            let n = p.bytes[slot as usize][k];
                            if p.holds(slot) {
                                out.extend_from_slice(bytes_of(&p.regions[slot as usize][k], n));
                            } else {
                                // An accumulator never used: what a fresh one holds.
                                let mut words = vec![0u32; spec.words(p.len)];
                                format.fresh(k, &mut words, p.len);
                                out.extend_from_slice(bytes_of(&words, n));
                            }
                        }
                        out
                    }
                },
                Place::Wide(k) => param.wide[slot as usize][k]
                    .iter()
                    .flat_map(|x| x.load(Ordering::Relaxed).to_le_bytes())
                    .take(spec.bytes(layout.numel))
                    .collect(),
            };
            if spec.saved {
                regions.push(HostRegion { spec, bytes });
            }
        }
        Ok(HostSlot { regions })
    }

    fn import(
        &self,
        param: &mut CpuParam,
        layout: &ParamLayout,
        slot: SlotKind,
        host: &HostSlot,
        lent: Option<HostValuesMut<'_>>,
    ) -> Result<(), BackendError> {
        let Some(format) = layout.format(slot) else {
            return Ok(());
        };
        let lent_here = slot == SlotKind::Param && layout.lent;
        let mut lent = lent;
        if lent_here {
            match &lent {
                Some(l) => self.check_lent(layout, l.info())?,
                None => return Err(unsupported("importing a lent parameter without its buffer")),
            }
        }
        let s = slot as usize;
        if slot == SlotKind::Grad {
            param.pieces.iter_mut().for_each(|p| p.hold_grad(layout));
        }
        for Walked { spec, place, bytes } in format.walk(&layout.shape, Some(host)) {
            match place {
                Place::Element(k) => {
                    let Some(bytes) = bytes else { continue };
                    if lent_here && k == 0 {
                        if let Some(l) = &mut lent {
                            l.bytes_mut().copy_from_slice(bytes);
                        }
                        continue;
                    }
                    for piece in &mut param.pieces {
                        let range = spec.byte_range(piece.offset, piece.offset + piece.len);
                        let n = piece.bytes[s][k];
                        bytes_of_mut(&mut piece.regions[s][k], n).copy_from_slice(&bytes[range]);
                    }
                }
                Place::Wide(k) => {
                    let region = &param.wide[s][k];
                    match bytes {
                        Some(bytes) => {
                            for (word, c) in region.iter().zip(bytes.chunks(4)) {
                                let mut b = [0u8; 4];
                                b[..c.len()].copy_from_slice(c);
                                word.store(u32::from_le_bytes(b), Ordering::Relaxed);
                            }
                        }
                        None => region.iter().for_each(|x| x.store(0, Ordering::Relaxed)),
                    }
                }
            }
        }
        format.loaded(&param.wide[s], &layout.shape);
        Ok(())
    }

    fn bytes(&self, param: &CpuParam, layout: &ParamLayout) -> [usize; SLOTS] {
        let mut bytes = [0usize; SLOTS];
        for (s, b) in bytes.iter_mut().enumerate() {
            for piece in param.pieces.iter().filter(|p| p.holds(SlotKind::ALL[s])) {
                let lent = s == 0 && layout.lent;
                *b += piece.bytes[s]
                    .iter()
                    .enumerate()
                    .filter(|&(k, _)| !(lent && k == 0))
                    .map(|(_, n)| n)
                    .sum::<usize>();
            }
            *b += param.wide[s].iter().map(|r| 4 * r.len()).sum::<usize>();
        }
        bytes
    }
}
