//! The CPU backend: the reference implementation of every [`Backend`] operation.
//!
//! A parameter is held as pieces of at most 2^18 elements (a multiple of every block size); the
//! step runs the pieces of all stepping parameters in parallel (rayon), so one big tensor uses
//! every thread and thousands of small ones are batched into a few tasks. Each piece is
//! processed in chunks of 4096 elements with f32 scratch on the stack: nothing is allocated
//! during a step. Every slot is its format's regions ([`crate::backend::RegionSpec`]): element
//! regions as words per piece, tensor-wide ones once per parameter (atomics, so the folds of a
//! two-phase step can run on all pieces at once in any order).

use std::sync::atomic::{AtomicU32, Ordering};

use rayon::prelude::*;

use crate::backend::{
    Backend, BackendError, Dtype, FoldInput, Folded, HostRegion, HostSlot, HostValues,
    HostValuesMut, Init, MAX_STATS, ParamLayout, ParamStep, Phase, SLOTS, STAT_WORDS, SlotKind,
    StepFlags, StepPlan, StepWork,
};

mod tile;

use crate::exact::{ExactSum, add_squares};
use crate::fixed;
use crate::format::{
    MAX_REGIONS, Place, Random, Regions, RegionsMut, Walked, bytes_of, bytes_of_mut,
};
use crate::rule::{Chunk, FoldValue, apply_chunk, fold_inputs};
use crate::vocab::{CHUNK, fits};
pub use tile::Kernel;

/// Elements per piece: small enough that a tensor of 1M elements keeps two threads busy (with
/// pieces of 2^20, 8-bit AdamW ran at 3.2 ns/param at 1M against 1.8 at 64M), large enough that
/// the per-piece dispatch is noise.
pub(crate) const PIECE: usize = 1 << 18;

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

/// The f32 scratch of one chunk: gradient, parameter, the three states and the increments.
struct Scratch {
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
fn decode_chunk(
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
fn in_place_slots(
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
fn f32_values(words: &mut [u32], start: usize, n: usize) -> &mut [f32] {
    bytemuck::cast_slice_mut(&mut words[start..start + n])
}

/// One fold pass over a piece: the folded values of every chunk — for a slot's statistics (see
/// [`Format::folds`](crate::format::Format::folds)) its updated value or the rule's moment input, for the rule's sums its stat
/// inputs.
#[allow(clippy::too_many_arguments)]
fn fold_piece(
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

/// The fused step of one piece: for each chunk, decode gradient, parameter and states, apply the
/// rule, store the states (a quantized state gets the exact absmax of its updated block), the
/// parameter (Kahan: add the increment), clear the gradient. With [`StepFlags::TRANSFORM`] only
/// the parameter is stored. Returns whether a non-finite value was met (those elements were left
/// unchanged).
fn fused_step(
    piece: &mut Piece,
    layout: &ParamLayout,
    wide: &[Vec<Box<[AtomicU32]>>; SLOTS],
    plan: &ParamStep,
    seed: u64,
    released: Option<HostValues<'_>>,
    mut lent: Option<&mut [u8]>,
) -> bool {
    let flags = layout.step_flags(plan.flags);
    let transform = flags.has(StepFlags::TRANSFORM);
    let limits = layout.limits(flags);
    if let Some(kernel) = Kernel::for_plan(&plan.plan).filter(|_| !transform)
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
fn specialized<'a>(
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
fn fold_all(
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
/// too), then the lent ones one after another, each over its pieces in parallel. Allocates
/// nothing.
fn for_stepping<F>(work: &mut StepWork<'_, '_, '_, Cpu>, f: F)
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
    work.params
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
        });
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
                        fused_step(piece, layout, wide, plan, seed, released, Some(l));
                }),
                None => for_pieces(pieces, |piece| {
                    piece.saw_non_finite =
                        fused_step(piece, layout, wide, plan, seed, released, None);
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
                Some(l) => check_lent(layout, l.info())?,
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
