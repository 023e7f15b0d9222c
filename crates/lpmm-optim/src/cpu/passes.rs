//! The element-wise passes over a piece: a fold pass of a tensor-wide phase and the fused step,
//! on the generic chunk path (chunks of [`CHUNK`] elements through an f32 scratch, every format
//! through its codec) or, for the fused step, by the plan's specialized kernel ([`super::tile`])
//! where one exists; and how the step primitives reach every stepping parameter of a batch.

use std::sync::atomic::AtomicU32;

use rayon::prelude::*;

use crate::backend::{
    FoldInput, HostValues, MAX_STATS, ParamLayout, ParamStep, Phase, SLOTS, STAT_WORDS, SlotKind,
    StepFlags, StepWork,
};
use crate::fixed;
use crate::format::MAX_REGIONS;
use crate::rule::{Chunk, FoldValue, apply_chunk, fold_inputs};
use crate::vocab::CHUNK;

use super::tile::{self, Kernel};
use super::{Cpu, CpuParam, Piece, elem_bytes, lent_stride, random, view_mut};

/// Decodes a chunk's gradient: the accumulator plus the released gradient, if any.
pub(super) fn load_gradient(
    layout: &ParamLayout,
    piece: &Piece,
    wide: &[Box<[AtomicU32]>],
    start: usize,
    released: Option<HostValues<'_>>,
    g: &mut [f32],
) {
    let held = layout.format(SlotKind::Grad).filter(|_| piece.grad_held);
    match (held, released) {
        (Some(f), extra) => {
            f.decode(
                &piece.view(SlotKind::Grad, wide, &layout.shape, None),
                start,
                g,
            );
            if let Some(extra) = extra {
                let mut e = [0f32; CHUNK];
                let e = &mut e[..g.len()];
                extra.read_f32(piece.offset + start, e);
                g.iter_mut().zip(e.iter()).for_each(|(a, &b)| *a += b);
            }
        }
        // The released gradient alone is `0.0 + g`, as if added to an empty accumulator: the
        // same bits (`-0.0` becomes `+0.0`), read straight into the chunk.
        (None, Some(extra)) => {
            extra.read_f32(piece.offset + start, g);
            g.iter_mut().for_each(|a| *a += 0.0);
        }
        (None, None) => g.fill(0.0),
    }
}

/// Decodes one slot's chunk (zeros for an unallocated slot).
pub(super) fn decode_slot(
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

/// The f32 scratch of one chunk: gradient, parameter, the three states and the increments.
pub(super) struct Scratch {
    g: [f32; CHUNK],
    p: [f32; CHUNK],
    m: [f32; CHUNK],
    v: [f32; CHUNK],
    w: [f32; CHUNK],
    d: [f32; CHUNK],
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            g: [0.0; CHUNK],
            p: [0.0; CHUNK],
            m: [0.0; CHUNK],
            v: [0.0; CHUNK],
            w: [0.0; CHUNK],
            d: [0.0; CHUNK],
        }
    }

    /// The first `n` values of each, as a chunk of the rule's work.
    fn chunk(&mut self, n: usize) -> Chunk<'_> {
        Chunk {
            g: &self.g[..n],
            g_plus: -0.0,
            p: &mut self.p[..n],
            m: &mut self.m[..n],
            v: &mut self.v[..n],
            w: &mut self.w[..n],
            d: &mut self.d[..n],
        }
    }
}

/// Decodes a chunk's gradient into `s.g` (zeros with `transform`; nothing with `g_direct`, where
/// the step reads a released gradient where the caller holds it), parameter and states into `s`,
/// except the slots stepped `in_place` (indexed by [`SlotKind`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_chunk(
    s: &mut Scratch,
    layout: &ParamLayout,
    piece: &Piece,
    wide: &[Vec<Box<[AtomicU32]>>; SLOTS],
    released: Option<HostValues<'_>>,
    lent: Option<&[u8]>,
    start: usize,
    n: usize,
    transform: bool,
    g_direct: bool,
    in_place: [bool; SLOTS],
) {
    if transform {
        s.g[..n].fill(0.0);
    } else if !g_direct {
        load_gradient(layout, piece, &wide[1], start, released, &mut s.g[..n]);
    }
    for (slot, out) in [
        (SlotKind::Param, &mut s.p),
        (SlotKind::State1, &mut s.m),
        (SlotKind::State2, &mut s.v),
        (SlotKind::State3, &mut s.w),
    ] {
        let k = slot as usize;
        if !in_place[k] {
            let lent = lent.filter(|_| slot == SlotKind::Param);
            decode_slot(layout, piece, &wide[k], slot, lent, start, &mut out[..n]);
        }
    }
}

/// Which slots of a piece the fused step updates where they are stored (indexed by
/// [`SlotKind`]): those whose format holds plain f32 values ([`Format::plain_f32`]: decoding and
/// encoding would be copies), the parameter only when the step stores it (and, lent, only when
/// the caller's buffer is f32-aligned), the states only when it stores them (not under
/// [`StepFlags::TRANSFORM`]). The gradient is always read into the scratch.
///
/// [`Format::plain_f32`]: crate::format::Format::plain_f32
pub(super) fn in_place_slots(
    layout: &ParamLayout,
    piece: &Piece,
    flags: StepFlags,
    lent: Option<&[u8]>,
) -> [bool; SLOTS] {
    let plain =
        |slot: SlotKind| piece.holds(slot) && layout.format(slot).is_some_and(|f| f.plain_f32());
    let mut in_place = [false; SLOTS];
    in_place[SlotKind::Param as usize] = flags.has(StepFlags::UPDATE_PARAM)
        && plain(SlotKind::Param)
        && lent.is_none_or(|l| l.as_ptr().align_offset(4) == 0);
    if !flags.has(StepFlags::TRANSFORM) {
        for slot in [SlotKind::State1, SlotKind::State2, SlotKind::State3] {
            in_place[slot as usize] = plain(slot);
        }
    }
    in_place
}

/// Elements `start..start + n` of a plain-f32 primary region, as f32.
pub(super) fn f32_values(words: &mut [u32], start: usize, n: usize) -> &mut [f32] {
    bytemuck::cast_slice_mut(&mut words[start..start + n])
}

/// One fold pass over a piece: the folded values of every chunk — for a slot's statistics (see
/// [`Format::folds`](crate::format::Format::folds)) its updated value or the rule's moment input, for the rule's sums its stat
/// inputs.
#[allow(clippy::too_many_arguments)]
pub(super) fn fold_piece(
    piece: &Piece,
    layout: &ParamLayout,
    wide: &[Vec<Box<[AtomicU32]>>; SLOTS],
    stats: &[AtomicU32; STAT_WORDS],
    plan: &ParamStep,
    target: Phase,
    pass: usize,
    released: Option<HostValues<'_>>,
    lent: Option<&[u8]>,
) {
    let flags = layout.step_flags(plan.flags);
    let rule = &plan.rule;
    let mut s = Scratch::new();
    let mut local = fixed::Local::default();
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        decode_chunk(
            &mut s,
            layout,
            piece,
            wide,
            released,
            lent,
            start,
            n,
            false,
            false,
            [false; SLOTS],
        );
        let clip = plan.clip;
        match target {
            Phase::Stats => {
                let (exp, sum) = stats.split_at(MAX_STATS);
                for k in 0..rule.stats() {
                    fold_inputs(*rule, flags, FoldValue::Stat(k), clip, &mut s.chunk(n));
                    // One atomic operation per chunk and sum (the sums are order-free).
                    fixed::fold_many(exp, sum, k, layout.numel, pass, &s.d[..n]);
                }
            }
            Phase::Slot(slot) => {
                let Some(format) = layout.format(slot) else {
                    return;
                };
                let k = slot as usize;
                let view = piece.view(slot, &wide[k], &layout.shape, None);
                match format.folds()[pass] {
                    FoldInput::UpdatedState2 => {
                        // Exactly the fused pass's element-wise work, restore included, so both
                        // phases agree (the parameter and increments it computes are dropped).
                        let limits = layout.limits(flags);
                        apply_chunk(*rule, flags, plan.clip, limits, &mut s.chunk(n));
                        let values = if slot == SlotKind::State3 { &s.w } else { &s.v };
                        format.fold(&view, pass, start, &values[..n], &mut local);
                    }
                    FoldInput::MomentGradient => {
                        fold_inputs(*rule, flags, FoldValue::Moment(slot), clip, &mut s.chunk(n));
                        format.fold(&view, pass, start, &s.d[..n], &mut local);
                    }
                }
            }
        }
    }
    if let Phase::Slot(slot) = target
        && let Some(format) = layout.format(slot)
    {
        let view = piece.view(slot, &wide[slot as usize], &layout.shape, None);
        format.fold_flush(&view, pass, &local);
    }
}

/// The matrix phase's input of one piece ([`crate::rule::RuleConsts::matrix_input`] of each
/// element, the gradient clipped), into `out` (the piece's elements).
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_piece(
    piece: &Piece,
    layout: &ParamLayout,
    wide: &[Vec<Box<[AtomicU32]>>; SLOTS],
    plan: &ParamStep,
    released: Option<HostValues<'_>>,
    lent: Option<&[u8]>,
    out: &mut [f32],
) {
    let flags = layout.step_flags(plan.flags);
    let mut s = Scratch::new();
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        decode_chunk(
            &mut s,
            layout,
            piece,
            wide,
            released,
            lent,
            start,
            n,
            false,
            false,
            [false; SLOTS],
        );
        fold_inputs(
            plan.rule,
            flags,
            FoldValue::Matrix,
            plan.clip,
            &mut s.chunk(n),
        );
        out[start..start + n].copy_from_slice(&s.d[..n]);
    }
}

/// The fused step of one piece: for each chunk, decode gradient, parameter and states, apply the
/// rule, store the states (a quantized state gets the exact absmax of its updated block), the
/// parameter (Kahan: add the increment), clear the gradient. With [`StepFlags::TRANSFORM`] only
/// the parameter is stored. `matrix`: the matrix phase's result for the piece's elements, read
/// as the rule's `v` operand (the generic path). Returns whether a non-finite value was met
/// (those elements were left unchanged).
#[allow(clippy::too_many_arguments)]
pub(super) fn fused_step(
    piece: &mut Piece,
    layout: &ParamLayout,
    wide: &[Vec<Box<[AtomicU32]>>; SLOTS],
    plan: &ParamStep,
    seed: u64,
    released: Option<HostValues<'_>>,
    mut lent: Option<&mut [u8]>,
    matrix: Option<&[f32]>,
) -> bool {
    let flags = layout.step_flags(plan.flags);
    let transform = flags.has(StepFlags::TRANSFORM);
    let limits = layout.limits(flags);
    if let Some(kernel) = Kernel::for_plan(&plan.plan).filter(|_| !transform && matrix.is_none())
        && let Some(bad) = specialized(
            kernel,
            piece,
            layout,
            plan,
            seed,
            released,
            lent.as_deref_mut(),
        )
    {
        return bad;
    }
    let t = plan.t;
    let mut s = Scratch::new();
    let shape = &layout.shape[..];
    let mut saw_non_finite = false;
    let in_place = in_place_slots(layout, piece, flags, lent.as_deref());
    // A released f32 gradient with no accumulator is read where the caller holds it (the rule
    // adds the `0.0` of `0.0 + g`), not copied into the scratch.
    let direct = match (
        layout.format(SlotKind::Grad).filter(|_| piece.grad_held),
        released,
    ) {
        (None, Some(HostValues::F32(v))) if !transform => Some(&v[piece.offset..][..piece.len]),
        _ => None,
    };
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        let at = piece.offset + start;
        decode_chunk(
            &mut s,
            layout,
            piece,
            wide,
            released,
            lent.as_deref(),
            start,
            n,
            transform,
            direct.is_some(),
            in_place,
        );
        if let Some(x) = matrix {
            s.v[..n].copy_from_slice(&x[start..start + n]);
        }
        {
            // The rule's operands: the stored values of the slots stepped in place, the scratch
            // for the others.
            let [rp, _, r1, r2, r3] = &mut piece.regions;
            let Scratch { g, p, m, v, w, d } = &mut s;
            let p = match (in_place[SlotKind::Param as usize], lent.as_deref_mut()) {
                // `in_place_slots` checked the alignment; the length is the piece's (4 bytes per
                // element), as `decode` reads it.
                (true, Some(l)) => bytemuck::cast_slice_mut(&mut l[4 * start..4 * (start + n)]),
                (true, None) => f32_values(&mut rp[0], start, n),
                (false, _) => &mut p[..n],
            };
            let [m, v, w] = [
                (SlotKind::State1, r1, m),
                (SlotKind::State2, r2, v),
                (SlotKind::State3, r3, w),
            ]
            .map(|(slot, r, scratch)| match r.first_mut() {
                Some(words) if in_place[slot as usize] => f32_values(words, start, n),
                _ => &mut scratch[..n],
            });
            let (g, g_plus) = match direct {
                Some(v) => (&v[start..start + n], 0.0),
                None => (&g[..n], -0.0),
            };
            let mut chunk = Chunk {
                g,
                g_plus,
                p,
                m,
                v,
                w,
                d: &mut d[..n],
            };
            saw_non_finite |= apply_chunk(plan.rule, flags, plan.clip, limits, &mut chunk);
        }
        let [rp, rg, r1, r2, r3] = &mut piece.regions;
        let [bp, bg, b1, b2, b3] = &piece.bytes;
        if !transform {
            for (slot, regions, bytes, values) in [
                (SlotKind::State1, r1, b1, &s.m),
                (SlotKind::State2, r2, b2, &s.v),
                (SlotKind::State3, r3, b3, &s.w),
            ] {
                if in_place[slot as usize] {
                    continue;
                }
                if let Some(f) = layout.format(slot) {
                    let w = &wide[slot as usize];
                    let mut r = view_mut(regions, bytes, w, piece.offset, shape, None);
                    f.encode(
                        &mut r,
                        start,
                        &values[..n],
                        random(layout, seed, slot, t, at),
                    );
                }
            }
        }
        if flags.has(StepFlags::UPDATE_PARAM)
            && !in_place[SlotKind::Param as usize]
            && let Some(f) = layout.format(SlotKind::Param)
        {
            let mut r = view_mut(rp, bp, &wide[0], piece.offset, shape, lent.as_deref_mut());
            if !f.add(&mut r, start, &s.d[..n]) {
                f.encode(
                    &mut r,
                    start,
                    &s.p[..n],
                    random(layout, seed, SlotKind::Param, t, at),
                );
            }
        }
        if !transform && let Some(f) = layout.format(SlotKind::Grad).filter(|_| piece.grad_held) {
            let mut r = view_mut(rg, bg, &wide[1], piece.offset, shape, None);
            f.clear(&mut r, start, n);
        }
    }
    saw_non_finite
}

/// The fused step of one piece by the plan's specialized kernel ([`tile`]); `None` (nothing
/// written) if the piece's buffers do not fit it.
pub(super) fn specialized<'a>(
    kernel: Kernel,
    piece: &'a mut Piece,
    layout: &ParamLayout,
    plan: &ParamStep,
    seed: u64,
    released: Option<HostValues<'a>>,
    lent: Option<&'a mut [u8]>,
) -> Option<bool> {
    let flags = layout.step_flags(plan.flags);
    let args = tile::StepArgs {
        rule: plan.rule,
        flags,
        clip: plan.clip,
        limits: layout.limits(flags),
    };
    let (offset, len) = (piece.offset, piece.len);
    let index = layout.offset + offset as u64;
    let draws = |slot: SlotKind| {
        layout
            .format(slot)
            .filter(|f| f.stochastic())
            .map(|_| layout.stream(seed, slot, plan.t).draws_at(index))
    };
    let held = piece.grad_held && layout.format(SlotKind::Grad).is_some();
    let Piece { regions, bytes, .. } = piece;
    let [rp, rg, r1, r2, r3] = regions;
    let [bp, bg, b1, b2, b3] = &*bytes;
    let io =
        |slot: SlotKind, words: &'a mut [Vec<u32>], bytes: &[usize; MAX_REGIONS]| tile::SlotIo {
            elem: elem_bytes(words, bytes),
            lanes: layout.format(slot).and_then(|f| f.lanes()),
            draws: draws(slot),
        };
    let mut param = io(SlotKind::Param, rp, bp);
    if let Some(l) = lent {
        param.elem[0] = l;
    }
    let part = |g: HostValues<'a>| -> HostValues<'a> {
        match g {
            HostValues::F32(v) => HostValues::F32(&v[offset..offset + len]),
            HostValues::Bf16(v) => HostValues::Bf16(&v[offset..offset + len]),
        }
    };
    let grad = match (held, released) {
        (false, Some(HostValues::F32(v))) => tile::GradIo::Direct(&v[offset..offset + len]),
        (held, released) => tile::GradIo::Stashed {
            acc: held.then(|| io(SlotKind::Grad, rg, bg)),
            released: released.map(part),
        },
    };
    let slots = [
        param,
        io(SlotKind::State1, r1, b1),
        io(SlotKind::State2, r2, b2),
        io(SlotKind::State3, r3, b3),
    ];
    kernel.run(&args, tile::PieceIo { len, grad, slots })
}

/// Runs one fold pass over every piece of a parameter (in parallel; a lent buffer cut per piece).
#[allow(clippy::too_many_arguments)]
pub(super) fn fold_all(
    pieces: &[Piece],
    layout: &ParamLayout,
    wide: &[Vec<Box<[AtomicU32]>>; SLOTS],
    stats: &[AtomicU32; STAT_WORDS],
    plan: &ParamStep,
    target: Phase,
    pass: usize,
    released: Option<HostValues<'_>>,
    lent: Option<&[u8]>,
) {
    let stride = lent_stride(layout);
    let fold = |k: usize, piece: &Piece| {
        let lent = lent.map(|l| &l[(k * stride).min(l.len())..((k + 1) * stride).min(l.len())]);
        fold_piece(
            piece, layout, wide, stats, plan, target, pass, released, lent,
        );
    };
    match pieces {
        [one] => fold(0, one),
        many => many
            .par_iter()
            .enumerate()
            .for_each(|(k, piece)| fold(k, piece)),
    }
}

/// Runs `f` on every parameter of a batch that steps, with its plan, its part of the released
/// gradient and its lent buffer: those lpmm holds in parallel (each over its pieces in parallel
/// too; a lone one inline, over its pieces in parallel), then the lent ones one after another,
/// each over its pieces in parallel. Allocates nothing.
pub(super) fn for_stepping<F>(work: &mut StepWork<'_, '_, '_, Cpu>, f: F)
where
    F: Fn(&mut CpuParam, &ParamLayout, &ParamStep, Option<HostValues<'_>>, Option<&mut [u8]>)
        + Sync
        + Send,
{
    let released = work.released;
    let extra = |index: usize| match released {
        Some((i, g)) if i == index => Some(g),
        _ => None,
    };
    let mut held = (work.layouts.iter().zip(work.plans.iter()).enumerate())
        .filter(|(_, (layout, plan))| plan.is_some() && !layout.lent)
        .map(|(i, _)| i);
    match (held.next(), held.next()) {
        (None, _) => {}
        // One parameter: its pieces are the parallel work, and a dispatch to the thread pool
        // from outside it costs two context switches.
        (Some(i), None) => {
            if let Some(plan) = &work.plans[i] {
                f(&mut work.params[i], &work.layouts[i], plan, extra(i), None);
            }
        }
        _ => work
            .params
            .par_iter_mut()
            .zip(work.layouts.par_iter())
            .zip(work.plans.par_iter())
            .enumerate()
            .for_each(|(i, ((param, layout), plan))| {
                if let Some(plan) = plan
                    && !layout.lent
                {
                    f(param, layout, plan, extra(i), None);
                }
            }),
    }
    for (id, buffer) in work.lent.iter_mut() {
        let i = id.index();
        if let Some(plan) = &work.plans[i] {
            f(
                &mut work.params[i],
                &work.layouts[i],
                plan,
                extra(i),
                Some(buffer.bytes_mut()),
            );
        }
    }
}
