//! The CPU backend: the reference implementation of every [`Backend`] operation.
//!
//! A parameter is held as pieces of at most 2^20 elements (a multiple of every block size); the
//! step runs the pieces of all stepping parameters in parallel (rayon), so one big tensor uses
//! every thread and thousands of small ones are batched into a few tasks. Each piece is
//! processed in chunks of 4096 elements with f32 scratch on the stack: nothing is allocated
//! during a step. Every slot is its format's regions ([`crate::backend::RegionSpec`]): element
//! regions as words per piece, tensor-wide ones once per parameter (atomics, so the folds of a
//! two-phase step can run on all pieces at once in any order).

use std::sync::atomic::{AtomicU32, Ordering};

use rayon::prelude::*;

use crate::backend::{
    Backend, BackendError, Dtype, FoldInput, HostRegion, HostSlot, HostValues, HostValuesMut, Init,
    ParamLayout, ParamStep, SlotKind, StepFlags, StepWork,
};
use crate::exact::{ExactSum, add_squares};
use crate::format::{MAX_REGIONS, Random, Regions, RegionsMut, bytes_of, bytes_of_mut, fits};
use crate::rule::{Chunk, apply_chunk};

/// Elements per piece.
pub(crate) const PIECE: usize = 1 << 20;

/// Elements the fused step handles at a time: a multiple of every block size (all are powers of
/// two up to 4096), so every slot's blocks fall whole inside a chunk.
pub(crate) const CHUNK: usize = 4096;

const NAME: &str = "cpu";

/// The CPU backend (multi-threaded with rayon's global pool, or the pool the caller installs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

/// One parameter on the CPU.
#[derive(Debug)]
pub struct CpuParam {
    pieces: Vec<Piece>,
    /// Each slot's tensor-wide regions.
    wide: [Vec<Box<[AtomicU32]>>; 4],
}

/// A contiguous range of one parameter with its slots' element regions.
#[derive(Debug)]
struct Piece {
    offset: usize,
    len: usize,
    /// Each slot's element regions, as words (a lent parameter's primary region is empty).
    regions: [Vec<Vec<u32>>; 4],
    /// The byte length of each element region for this piece.
    bytes: [[usize; MAX_REGIONS]; 4],
    /// Whether the gradient accumulator's element regions are allocated. They are allocated on
    /// the first accumulation (or import): a parameter stepped only from given gradients
    /// (`step_gradients`, released steps) never holds an accumulator. Unallocated, it reads as
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

/// Writable views of one piece slot's regions.
fn view_mut<'a>(
    regions: &'a mut [Vec<u32>],
    bytes: &[usize; MAX_REGIONS],
    wide: &'a [Box<[AtomicU32]>],
    global: usize,
    shape: &'a [usize],
    lent: Option<&'a mut [u8]>,
) -> RegionsMut<'a> {
    let mut elem: [&mut [u8]; MAX_REGIONS] = Default::default();
    for (k, (e, w)) in elem.iter_mut().zip(regions.iter_mut()).enumerate() {
        // A lent region holds no words here (the caller's buffer stands in below).
        let n = bytes[k].min(4 * w.len());
        *e = bytes_of_mut(w, n);
    }
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

/// A lent buffer must have the primary region's dtype and one value per element.
fn check_lent(layout: &ParamLayout, info: (Dtype, usize)) -> Result<(), BackendError> {
    let want = layout
        .format(SlotKind::Param)
        .and_then(|f| f.lendable())
        .ok_or_else(|| unsupported("lending a parameter of this storage"))?;
    if info != (want, layout.numel) {
        return Err(BackendError::Buffer {
            what: format!(
                "a lent parameter buffer must hold {} {} values, not {} {}",
                layout.numel,
                want.name(),
                info.1,
                info.0.name()
            ),
        });
    }
    Ok(())
}

/// Decodes a chunk's gradient: the accumulator plus the released gradient, if any.
fn load_gradient(
    layout: &ParamLayout,
    piece: &Piece,
    wide: &[Box<[AtomicU32]>],
    start: usize,
    released: Option<HostValues<'_>>,
    g: &mut [f32],
) {
    match layout.format(SlotKind::Grad).filter(|_| piece.grad_held) {
        Some(f) => f.decode(
            &piece.view(SlotKind::Grad, wide, &layout.shape, None),
            start,
            g,
        ),
        None => g.fill(0.0),
    }
    if let Some(extra) = released {
        let mut e = [0f32; CHUNK];
        let e = &mut e[..g.len()];
        extra.read_f32(piece.offset + start, e);
        g.iter_mut().zip(e.iter()).for_each(|(a, &b)| *a += b);
    }
}

/// Decodes one slot's chunk (zeros for an unallocated slot).
fn decode_slot(
    layout: &ParamLayout,
    piece: &Piece,
    wide: &[Box<[AtomicU32]>],
    slot: SlotKind,
    lent: Option<&[u8]>,
    start: usize,
    out: &mut [f32],
) {
    match layout.format(slot).filter(|_| piece.holds(slot)) {
        Some(f) => f.decode(&piece.view(slot, wide, &layout.shape, lent), start, out),
        None => out.fill(0.0),
    }
}

/// The step's flags for `layout`: the plan's, with the second moment given where state 2 is a
/// reconstruction (factorized).
fn flags_for(layout: &ParamLayout, plan: &ParamStep) -> StepFlags {
    let given = layout
        .format(SlotKind::State2)
        .is_some_and(|f| f.folds().contains(&FoldInput::MomentGradient));
    plan.flags.with(StepFlags::GIVEN_V, given)
}

/// One fold pass over a piece (see [`Format::folds`]): the folded values of every chunk.
#[allow(clippy::too_many_arguments)]
fn fold_piece(
    piece: &Piece,
    layout: &ParamLayout,
    wide: &[Vec<Box<[AtomicU32]>>; 4],
    plan: &ParamStep,
    pass: usize,
    input: FoldInput,
    released: Option<HostValues<'_>>,
    lent: Option<&[u8]>,
) {
    let Some(state2) = layout.format(SlotKind::State2) else {
        return;
    };
    let flags = flags_for(layout, plan);
    let (mut g, mut p, mut m, mut v, mut d) = (
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
    );
    let target = piece.view(SlotKind::State2, &wide[3], &layout.shape, None);
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        let (g, p, m, v, d) = (
            &mut g[..n],
            &mut p[..n],
            &mut m[..n],
            &mut v[..n],
            &mut d[..n],
        );
        load_gradient(layout, piece, &wide[1], start, released, g);
        decode_slot(layout, piece, &wide[0], SlotKind::Param, lent, start, p);
        match input {
            FoldInput::UpdatedState2 => {
                decode_slot(layout, piece, &wide[2], SlotKind::State1, None, start, m);
                decode_slot(layout, piece, &wide[3], SlotKind::State2, None, start, v);
                // Exactly the fused pass's element-wise work, restore included, so both phases
                // agree (the parameter and increments it computes are dropped).
                let limits = layout.limits(flags);
                apply_chunk(
                    plan.rule,
                    flags,
                    plan.clip,
                    limits,
                    &mut Chunk { g, p, m, v, d },
                );
                state2.fold(&target, pass, start, v);
            }
            FoldInput::MomentGradient => {
                for (x, &p) in g.iter_mut().zip(p.iter()) {
                    *x = plan.rule.moment_gradient(flags, p, *x * plan.clip);
                }
                state2.fold(&target, pass, start, g);
            }
        }
    }
}

/// The fused step of one piece: for each chunk, decode gradient, parameter and states, apply the
/// rule, store the states (a quantized state gets the exact absmax of its updated block), the
/// parameter (Kahan: add the increment), clear the gradient. Returns whether a non-finite value
/// was met (those elements were left unchanged).
fn fused_step(
    piece: &mut Piece,
    layout: &ParamLayout,
    wide: &[Vec<Box<[AtomicU32]>>; 4],
    plan: &ParamStep,
    seed: u64,
    released: Option<HostValues<'_>>,
    mut lent: Option<&mut [u8]>,
) -> bool {
    let flags = flags_for(layout, plan);
    let limits = layout.limits(flags);
    let t = plan.t;
    let (mut g, mut p, mut m, mut v, mut d) = (
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
    );
    let shape = &layout.shape[..];
    let mut saw_non_finite = false;
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        let (g, p, m, v, d) = (
            &mut g[..n],
            &mut p[..n],
            &mut m[..n],
            &mut v[..n],
            &mut d[..n],
        );
        let at = piece.offset + start;
        load_gradient(layout, piece, &wide[1], start, released, g);
        decode_slot(
            layout,
            piece,
            &wide[0],
            SlotKind::Param,
            lent.as_deref(),
            start,
            p,
        );
        decode_slot(layout, piece, &wide[2], SlotKind::State1, None, start, m);
        decode_slot(layout, piece, &wide[3], SlotKind::State2, None, start, v);
        let mut chunk = Chunk { g, p, m, v, d };
        saw_non_finite |= apply_chunk(plan.rule, flags, plan.clip, limits, &mut chunk);
        let Chunk { p, m, v, d, .. } = chunk;
        let [rp, rg, r1, r2] = &mut piece.regions;
        let [bp, bg, b1, b2] = &piece.bytes;
        for (slot, regions, bytes, values) in [
            (SlotKind::State1, r1, b1, &*m),
            (SlotKind::State2, r2, b2, &*v),
        ] {
            if let Some(f) = layout.format(slot) {
                let w = &wide[slot as usize];
                let mut r = view_mut(regions, bytes, w, piece.offset, shape, None);
                f.encode(&mut r, start, values, random(layout, seed, slot, t, at));
            }
        }
        if flags.has(StepFlags::UPDATE_PARAM)
            && let Some(f) = layout.format(SlotKind::Param)
        {
            let mut r = view_mut(rp, bp, &wide[0], piece.offset, shape, lent.as_deref_mut());
            if !f.add(&mut r, start, d) {
                f.encode(
                    &mut r,
                    start,
                    p,
                    random(layout, seed, SlotKind::Param, t, at),
                );
            }
        }
        if let Some(f) = layout.format(SlotKind::Grad).filter(|_| piece.grad_held) {
            let mut r = view_mut(rg, bg, &wide[1], piece.offset, shape, None);
            f.clear(&mut r, start, n);
        }
    }
    saw_non_finite
}

/// Steps one parameter: the folds of a two-phase step, the fused pass, the swap after it.
fn step_param(
    param: &mut CpuParam,
    layout: &ParamLayout,
    plan: &ParamStep,
    seed: u64,
    released: Option<HostValues<'_>>,
    lent: Option<&mut [u8]>,
) -> bool {
    let CpuParam { pieces, wide } = param;
    let stride = lent_stride(layout);
    // A tensor-wide statistic that would not fit keeps its old value and flags the parameter.
    let mut kept = false;
    if let Some(state2) = layout.format(SlotKind::State2)
        && !state2.folds().is_empty()
    {
        for &k in state2.fold_targets() {
            wide[3][k]
                .iter()
                .for_each(|w| w.store(0, Ordering::Relaxed));
        }
        for (pass, &input) in state2.folds().iter().enumerate() {
            let wide = &*wide;
            match lent.as_deref() {
                Some(l) => {
                    let cut =
                        |k: usize| &l[(k * stride).min(l.len())..((k + 1) * stride).min(l.len())];
                    if pieces.len() == 1 {
                        fold_piece(
                            &pieces[0],
                            layout,
                            wide,
                            plan,
                            pass,
                            input,
                            released,
                            Some(l),
                        );
                    } else {
                        pieces.par_iter().enumerate().for_each(|(k, piece)| {
                            fold_piece(
                                piece,
                                layout,
                                wide,
                                plan,
                                pass,
                                input,
                                released,
                                Some(cut(k)),
                            )
                        });
                    }
                }
                None => pieces.par_iter().for_each(|piece| {
                    fold_piece(piece, layout, wide, plan, pass, input, released, None)
                }),
            }
        }
        kept = state2.combine(&wide[3], &layout.shape, &plan.rule);
    }
    let wide_ref = &*wide;
    match lent {
        Some(l) => for_pieces_lent(pieces, l, stride, |piece, l| {
            piece.saw_non_finite =
                fused_step(piece, layout, wide_ref, plan, seed, released, Some(l));
        }),
        None => for_pieces(pieces, |piece| {
            piece.saw_non_finite = fused_step(piece, layout, wide_ref, plan, seed, released, None);
        }),
    }
    if let Some((a, b)) = layout
        .format(SlotKind::State2)
        .and_then(|f| f.swap_after_step())
    {
        wide[3].swap(a, b);
    }
    kept | pieces.iter().any(|p| p.saw_non_finite)
}

impl Backend for Cpu {
    type Param = CpuParam;
    type Input<'a> = HostValues<'a>;
    type Output<'a> = HostValuesMut<'a>;

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
            let mut regions: [Vec<Vec<u32>>; 4] = Default::default();
            let mut bytes = [[0usize; MAX_REGIONS]; 4];
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
        let mut param = CpuParam { pieces, wide };
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
        // One vectorized pass on all threads (NaN and Inf patterns exceed every finite one).
        let limit = limit.abs().min(f32::MAX).to_bits();
        Ok(match values {
            HostValues::F32(v) => v
                .par_chunks(1 << 16)
                .all(|c| lpmm_formats::simd::abs_max_bits(c) <= limit),
            HostValues::Bf16(v) => v.par_iter().all(|x| fits(x.to_f32(), limit)),
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

    fn step(&self, work: StepWork<'_, '_, '_, Self>) -> Result<(), BackendError> {
        let StepWork {
            params,
            layouts,
            plans,
            released,
            lent,
            seed,
            non_finite,
        } = work;
        for (id, buffer) in lent.iter() {
            let index = id.index();
            if !layouts[index].lent {
                return Err(BackendError::Buffer {
                    what: format!("parameter #{index} is not lent, but a buffer was lent for it"),
                });
            }
            check_lent(&layouts[index], buffer.info())?;
        }
        let is_lent = |i: usize| lent.iter().any(|(k, _)| k.index() == i);
        for (i, (layout, plan)) in layouts.iter().zip(plans).enumerate() {
            if plan.is_some() && layout.lent && !is_lent(i) {
                return Err(BackendError::Buffer {
                    what: format!("parameter #{i} is lent: its buffer must be lent to the step"),
                });
            }
        }
        let extra = |index: usize| match released {
            Some((i, g)) if i == index => Some(g),
            _ => None,
        };
        non_finite.iter_mut().for_each(|f| *f = false);
        // Parameters in lpmm's memory, in parallel.
        params
            .par_iter_mut()
            .zip(layouts.par_iter())
            .zip(plans.par_iter())
            .zip(non_finite.par_iter_mut())
            .enumerate()
            .for_each(|(index, (((param, layout), plan), flag))| {
                if let Some(plan) = plan
                    && !layout.lent
                    && !is_lent(index)
                {
                    *flag = step_param(param, layout, plan, seed, extra(index), None);
                }
            });
        // Lent parameters, each with its buffer.
        for (id, buffer) in lent.iter_mut() {
            let i = id.index();
            if let Some(plan) = &plans[i] {
                non_finite[i] = step_param(
                    &mut params[i],
                    &layouts[i],
                    plan,
                    seed,
                    extra(i),
                    Some(buffer.bytes_mut()),
                );
            }
        }
        Ok(())
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
                Some(l) => check_lent(layout, l.info())?,
                None => return Err(unsupported("exporting a lent parameter without its buffer")),
            }
        }
        let (mut e, mut w) = (0, 0);
        let mut regions = Vec::new();
        for spec in format.regions(&layout.shape) {
            let bytes = if spec.per_element() {
                e += 1;
                match (lent_here && e == 1, lent) {
                    (true, Some(l)) => l.bytes().to_vec(),
                    _ => {
                        let mut out = Vec::with_capacity(spec.bytes(layout.numel));
                        for p in &param.pieces {
                            let n = p.bytes[slot as usize][e - 1];
                            if p.holds(slot) {
                                out.extend_from_slice(bytes_of(
                                    &p.regions[slot as usize][e - 1],
                                    n,
                                ));
                            } else {
                                // An accumulator never used: what a fresh one holds.
                                let mut words = vec![0u32; spec.words(p.len)];
                                format.fresh(e - 1, &mut words, p.len);
                                out.extend_from_slice(bytes_of(&words, n));
                            }
                        }
                        out
                    }
                }
            } else {
                w += 1;
                param.wide[slot as usize][w - 1]
                    .iter()
                    .flat_map(|x| x.load(Ordering::Relaxed).to_le_bytes())
                    .take(spec.bytes(layout.numel))
                    .collect()
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
                Some(l) => check_lent(layout, l.info())?,
                None => return Err(unsupported("importing a lent parameter without its buffer")),
            }
        }
        let s = slot as usize;
        if slot == SlotKind::Grad {
            param.pieces.iter_mut().for_each(|p| p.hold_grad(layout));
        }
        let (mut e, mut w) = (0, 0);
        let mut saved = host.regions.iter();
        for spec in format.regions(&layout.shape) {
            let source = if spec.saved {
                saved.next().map(|r| &r.bytes[..])
            } else {
                None
            };
            if spec.per_element() {
                e += 1;
                let Some(bytes) = source else { continue };
                if lent_here && e == 1 {
                    if let Some(l) = &mut lent {
                        l.bytes_mut().copy_from_slice(bytes);
                    }
                    continue;
                }
                for piece in &mut param.pieces {
                    let range = spec.byte_range(piece.offset, piece.offset + piece.len);
                    let n = piece.bytes[s][e - 1];
                    bytes_of_mut(&mut piece.regions[s][e - 1], n).copy_from_slice(&bytes[range]);
                }
            } else {
                w += 1;
                let region = &param.wide[s][w - 1];
                match source {
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
        format.loaded(&param.wide[s], &layout.shape);
        Ok(())
    }

    fn bytes(&self, param: &CpuParam, layout: &ParamLayout) -> [usize; 4] {
        let mut bytes = [0usize; 4];
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
