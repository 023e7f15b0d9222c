//! The specialized fused step: one pass over a piece's memory for the plans a [`Kernel`] exists
//! for (the hot presets), with every bit the generic element-wise path gives.
//!
//! A kernel is monomorphized over each slot's *lanes* — how the slot's values reach the rule
//! ([`Lanes`]): f32 stepped where it is stored, bf16, split f32 and block-quantized codes decoded
//! into an L1-sized stash before the rule and encoded from it after, by the format's own lane-level
//! codec (`crate::format::lanes`), the one its generic chunk path calls too. A piece is walked in
//! tiles of [`TILE`] elements (a multiple of every block a kernel takes), each touched once in
//! memory while the next one's narrow slots (bf16, split, codes and block maxima) are prefetched
//! (f32 streams are left to the hardware's prefetchers, which follow them better): the tile's
//! gradient (read where the caller holds it, or decoded from the accumulator) and slots are
//! decoded, the rule's loop runs over the tile (the generic path's own vectorized loop,
//! `apply_chunk_lean`, without the absent state 3 and the increments: its bits by
//! construction), then each slot is encoded — a quantized slot's block
//! maxima, the exact quotient and nearest code or stochastic rounding, packing; bf16 rounding;
//! splitting — and the accumulator's tile cleared. Nothing is decoded or stored that the
//! configuration does not have, and no pass is made that cannot change a bit: no sign check of a
//! second moment (never negative), no work on a state the rule does not have (an absent state's
//! stash is zeroed once per piece).
//!
//! The rule's loop and every table kernel it calls (decode, nearest, stochastic rounding, bf16
//! rounding, random draws: lpmm-formats' and lpmm-quant's vector code, as the generic path calls
//! it) pick their SIMD level at run time. Plans without a kernel (Kahan parameters, rank-1 and
//! factorized states, blocks above [`TILE`], slot combinations `kernels!` does not list) take the
//! generic path, as do transforms and lent buffers not aligned to their dtype.

use half::bf16;
use lpmm_quant::RandomDraws;

use crate::backend::{HostValues, SlotKind, StepFlags, StepPlan};
use crate::format::Lanes;
use crate::format::lanes::{self, blockwise::Codes, blockwise::Scratch};
use crate::rule::{Chunk, Limits, RuleConsts, apply_chunk, apply_chunk_lean};
use crate::vocab::TILE;

/// How a slot is reached, as a kernel's signature names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Absent,
    F32,
    Bf16,
    Bf16Sr,
    Split,
    Quantized,
}

impl Kind {
    fn of(lanes: Option<Lanes>) -> Kind {
        match lanes {
            None => Kind::Absent,
            Some(Lanes::F32) => Kind::F32,
            Some(Lanes::Bf16 { stochastic: false }) => Kind::Bf16,
            Some(Lanes::Bf16 { stochastic: true }) => Kind::Bf16Sr,
            Some(Lanes::Split) => Kind::Split,
            Some(Lanes::Quantized { .. }) => Kind::Quantized,
        }
    }
}

/// One slot's storage in a piece, as a kernel receives it: its element regions (a lent
/// parameter's buffer as region 0), its lanes and, for stochastic rounding, its draws positioned
/// at the piece's first element.
pub(crate) struct SlotIo<'a> {
    pub elem: [&'a mut [u8]; crate::format::MAX_REGIONS],
    pub lanes: Option<Lanes>,
    pub draws: Option<RandomDraws>,
}

/// Where the gradient of a piece comes from.
// On the stack for one piece: boxing the larger variant would allocate in the step.
#[allow(clippy::large_enum_variant)]
pub(crate) enum GradIo<'a> {
    /// A released f32 gradient read where the caller holds it (the step's gradient is
    /// `0.0 + g`).
    Direct(&'a [f32]),
    /// The accumulator (decoded per tile and cleared after it), a released gradient, or both
    /// (summed as `accumulator + released`): the piece's part of each.
    Stashed {
        acc: Option<SlotIo<'a>>,
        released: Option<HostValues<'a>>,
    },
}

/// Everything a kernel steps one piece with.
pub(crate) struct PieceIo<'a> {
    /// Elements of the piece.
    pub len: usize,
    pub grad: GradIo<'a>,
    /// Parameter, state 1, state 2, state 3.
    pub slots: [SlotIo<'a>; 4],
}

/// The step's constants as a kernel reads them.
pub(crate) struct StepArgs {
    pub rule: RuleConsts,
    pub flags: StepFlags,
    pub clip: f32,
    pub limits: Limits,
}

type Run = fn(&StepArgs, PieceIo<'_>) -> Option<bool>;

/// A specialized fused-step kernel: the lanes of the parameter and the three states (the
/// gradient's are read per tile, whatever they are), for any element-wise rule.
#[derive(Clone, Copy)]
pub struct Kernel(&'static Entry);

struct Entry {
    name: &'static str,
    kinds: [Kind; 4],
    run: Run,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

impl PartialEq for Kernel {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Kernel {
    /// The kernel for `plan`, if one is specialized for its key and the plan is not
    /// [`StepPlan::generic`]: every allocated slot has lanes (the gradient accumulator's too) and no state is a tensor-wide statistic's
    /// reconstruction.
    pub(crate) fn for_plan(plan: &StepPlan) -> Option<Kernel> {
        let formats = plan.key().formats;
        if !plan.specialized() {
            return None;
        }
        let all_lanes = formats
            .iter()
            .flatten()
            .all(|f| f.lanes().is_some() && f.folds().is_empty());
        if !all_lanes {
            return None;
        }
        let kind = |slot: SlotKind| Kind::of(formats[slot as usize].and_then(|f| f.lanes()));
        let kinds = [
            kind(SlotKind::Param),
            kind(SlotKind::State1),
            kind(SlotKind::State2),
            kind(SlotKind::State3),
        ];
        KERNELS.iter().find(|e| e.kinds == kinds).map(Kernel)
    }

    /// The kernel's name: the lanes of parameter and states.
    pub fn describe(&self) -> &'static str {
        self.0.name
    }

    /// Steps one piece; `None` if the piece's buffers do not fit the kernel (a lent buffer not
    /// aligned to its dtype), before anything is written: the caller takes the generic path.
    /// Otherwise whether an element was left unchanged (a non-finite gradient or result, or one
    /// beyond its slot's limit).
    pub(crate) fn run(&self, args: &StepArgs, io: PieceIo<'_>) -> Option<bool> {
        (self.0.run)(args, io)
    }
}

/// A slot's values as the rule reads and writes them, a tile at a time.
trait SlotLanes<'a>: Sized {
    /// Stepped where they are stored (f32): nothing is decoded or encoded.
    const IN_PLACE: bool = false;

    /// The lanes of `io`, if it is this kind and its buffers fit.
    fn new(io: SlotIo<'a>) -> Option<Self>;
    /// Decodes elements `at .. at + stash.len()` of the piece into `stash`.
    fn decode(&mut self, at: usize, stash: &mut [f32]);
    /// The values of elements `at .. at + stash.len()` for the rule: stepped in place
    /// ([`SlotLanes::IN_PLACE`], when `moves`: the step stores them), or decoded into `stash`.
    fn values<'v>(&'v mut self, at: usize, stash: &'v mut [f32], _moves: bool) -> &'v mut [f32] {
        self.decode(at, stash);
        stash
    }
    /// Stores `values` as elements `at ..` of the piece.
    fn encode(&mut self, _at: usize, _values: &[f32]) {}
    /// Asks for elements `at .. at + n` of the piece to be brought into the cache (the next
    /// tile's, while this one is stepped).
    fn prefetch(&self, _at: usize, _n: usize) {}
}

/// Asks for the cache lines of `values` to be brought into the cache (a hint: no effect on
/// results; nothing on other architectures).
#[inline(always)]
fn prefetch<T>(values: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in values.chunks((64 / std::mem::size_of::<T>()).max(1)) {
        // SAFETY: SSE is part of x86-64's baseline; a prefetch reads nothing the program sees
        // and cannot fault, and the address is inside `values` besides.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
}

/// Which kind a type of lanes is (a kernel's signature names these).
trait LaneKind {
    type Lanes<'a>: SlotLanes<'a>;
    const KIND: Kind;
}

/// An f32 slice of a region's bytes (regions are word-aligned; a lent buffer may not be).
fn f32s(bytes: &mut [u8]) -> Option<&mut [f32]> {
    bytemuck::try_cast_slice_mut(bytes).ok()
}

/// A bf16 slice of a region's bytes.
fn bf16s(bytes: &mut [u8]) -> Option<&mut [bf16]> {
    bytemuck::try_cast_slice_mut(bytes).ok()
}

/// No slot: zeros in, nothing out. The rule never changes a state it does not have, so its
/// stash is zeroed once per piece (`filled`: up to this length).
struct Absent {
    filled: usize,
}

impl<'a> SlotLanes<'a> for Absent {
    fn new(io: SlotIo<'a>) -> Option<Self> {
        io.lanes.is_none().then_some(Absent { filled: 0 })
    }
    fn decode(&mut self, _at: usize, stash: &mut [f32]) {
        if self.filled < stash.len() {
            stash.fill(0.0);
            self.filled = stash.len();
        }
    }
}

struct KAbsent;
impl LaneKind for KAbsent {
    type Lanes<'a> = Absent;
    const KIND: Kind = Kind::Absent;
}

/// f32 values stepped where they are stored.
struct F32Lanes<'a>(&'a mut [f32]);

impl<'a> SlotLanes<'a> for F32Lanes<'a> {
    const IN_PLACE: bool = true;
    fn new(io: SlotIo<'a>) -> Option<Self> {
        let [values, ..] = io.elem;
        (io.lanes == Some(Lanes::F32)).then_some(())?;
        f32s(values).map(F32Lanes)
    }
    fn decode(&mut self, at: usize, stash: &mut [f32]) {
        lanes::f32::decode(&self.0[at..at + stash.len()], stash);
    }
    // No prefetch: the hardware's stream prefetchers follow an f32 stream (32 lines a tile), and
    // asking for its lines too made the step slower (docs/BENCHMARKS.md, "What was tried").
    fn values<'v>(&'v mut self, at: usize, stash: &'v mut [f32], moves: bool) -> &'v mut [f32] {
        if moves {
            return &mut self.0[at..at + stash.len()];
        }
        self.decode(at, stash);
        stash
    }
}

struct KF32;
impl LaneKind for KF32 {
    type Lanes<'a> = F32Lanes<'a>;
    const KIND: Kind = Kind::F32;
}

/// bf16 values, rounded to nearest even or stochastically with the slot's draws.
struct Bf16Lanes<'a, const SR: bool> {
    values: &'a mut [bf16],
    draws: Option<RandomDraws>,
    words: [u32; TILE],
}

impl<'a, const SR: bool> SlotLanes<'a> for Bf16Lanes<'a, SR> {
    fn new(io: SlotIo<'a>) -> Option<Self> {
        let [values, ..] = io.elem;
        (io.lanes == Some(Lanes::Bf16 { stochastic: SR })).then_some(())?;
        Some(Bf16Lanes {
            values: bf16s(values)?,
            draws: if SR { Some(io.draws?) } else { None },
            words: [0; TILE],
        })
    }
    fn decode(&mut self, at: usize, stash: &mut [f32]) {
        lanes::bf16::decode(&self.values[at..at + stash.len()], stash);
    }
    fn prefetch(&self, at: usize, n: usize) {
        prefetch(&self.values[at..at + n]);
    }
    fn encode(&mut self, at: usize, values: &[f32]) {
        let out = &mut self.values[at..at + values.len()];
        let draws = self.draws.as_mut().map(|d| (d, &mut self.words));
        lanes::bf16::encode(values, out, draws);
    }
}

struct KBf16;
impl LaneKind for KBf16 {
    type Lanes<'a> = Bf16Lanes<'a, false>;
    const KIND: Kind = Kind::Bf16;
}

struct KBf16Sr;
impl LaneKind for KBf16Sr {
    type Lanes<'a> = Bf16Lanes<'a, true>;
    const KIND: Kind = Kind::Bf16Sr;
}

/// Split f32 ([docs/FORMATS.md] §10): the bf16 halves and the remainders.
///
/// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
struct SplitLanes<'a> {
    hi: &'a mut [u16],
    rem: &'a mut [u16],
}

impl<'a> SlotLanes<'a> for SplitLanes<'a> {
    fn new(io: SlotIo<'a>) -> Option<Self> {
        let [hi, rem, _] = io.elem;
        (io.lanes == Some(Lanes::Split)).then_some(())?;
        Some(SplitLanes {
            hi: bytemuck::try_cast_slice_mut(hi).ok()?,
            rem: bytemuck::try_cast_slice_mut(rem).ok()?,
        })
    }
    fn decode(&mut self, at: usize, stash: &mut [f32]) {
        let n = stash.len();
        lanes::split_f32::decode(&self.hi[at..at + n], &self.rem[at..at + n], stash);
    }
    fn prefetch(&self, at: usize, n: usize) {
        prefetch(&self.hi[at..at + n]);
        prefetch(&self.rem[at..at + n]);
    }
    fn encode(&mut self, at: usize, values: &[f32]) {
        let n = values.len();
        let (hi, rem) = (&mut self.hi[at..at + n], &mut self.rem[at..at + n]);
        lanes::split_f32::encode(values, hi, rem);
    }
}

struct KSplit;
impl LaneKind for KSplit {
    type Lanes<'a> = SplitLanes<'a>;
    const KIND: Kind = Kind::Split;
}

/// Block-wise codes ([docs/FORMATS.md] §6): the packed codes and the block maxima, decoded and
/// encoded by the format's [`Codes`].
///
/// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
struct QuantLanes<'a> {
    packed: &'a mut [u8],
    absmax: &'a mut [f32],
    codes: Codes,
    draws: Option<RandomDraws>,
    scratch: Scratch,
}

impl<'a> SlotLanes<'a> for QuantLanes<'a> {
    fn new(io: SlotIo<'a>) -> Option<Self> {
        let [packed, absmax, _] = io.elem;
        let Some(Lanes::Quantized { codes, stochastic }) = io.lanes else {
            return None;
        };
        Some(QuantLanes {
            packed,
            absmax: f32s(absmax)?,
            codes,
            draws: if stochastic { Some(io.draws?) } else { None },
            scratch: Scratch::new(),
        })
    }
    fn decode(&mut self, at: usize, stash: &mut [f32]) {
        let (c, end) = (self.codes, at + stash.len());
        let packed = &self.packed[c.code_bytes(at, end)];
        c.decode(
            packed,
            &self.absmax[c.scales(at, end)],
            &mut self.scratch,
            stash,
        );
    }
    fn prefetch(&self, at: usize, n: usize) {
        let (c, end) = (self.codes, at + n);
        prefetch(&self.packed[c.code_bytes(at, end)]);
        prefetch(&self.absmax[c.scales(at, end)]);
    }
    fn encode(&mut self, at: usize, values: &[f32]) {
        let (c, end) = (self.codes, at + values.len());
        let packed = &mut self.packed[c.code_bytes(at, end)];
        let absmax = &mut self.absmax[c.scales(at, end)];
        c.encode(
            values,
            packed,
            absmax,
            self.draws.as_mut(),
            &mut self.scratch,
        );
    }
}

struct KQuant;
impl LaneKind for KQuant {
    type Lanes<'a> = QuantLanes<'a>;
    const KIND: Kind = Kind::Quantized;
}

/// The gradient of a piece, tile by tile.
struct GradLanes<'a> {
    io: GradIo<'a>,
    scratch: Scratch,
}

impl GradLanes<'_> {
    /// The gradient of tile `at .. at + n` and what the loop adds to it before clipping (`+0.0`
    /// for a released gradient read in place: `0.0 + g`; `-0.0` for the stash, which holds the
    /// sum already).
    fn tile<'s>(&'s mut self, at: usize, n: usize, stash: &'s mut [f32; TILE]) -> (&'s [f32], f32) {
        match &mut self.io {
            GradIo::Direct(g) => (&g[at..at + n], 0.0),
            GradIo::Stashed { acc, released } => {
                let g = &mut stash[..n];
                match acc {
                    Some(SlotIo {
                        elem,
                        lanes: Some(lanes),
                        ..
                    }) => {
                        let elem = elem.each_ref().map(|e| &**e);
                        lanes.decode(elem, at, &mut self.scratch, g);
                    }
                    _ => g.fill(0.0),
                }
                if let Some(r) = released {
                    let mut extra = [0f32; TILE];
                    let extra = &mut extra[..n];
                    r.read_f32(at, extra);
                    g.iter_mut().zip(extra.iter()).for_each(|(a, &b)| *a += b);
                }
                (&stash[..n], -0.0)
            }
        }
    }

    /// Asks for tile `at .. at + n`'s gradient to be brought into the cache.
    fn prefetch(&self, at: usize, n: usize) {
        match &self.io {
            // An f32 stream: left to the hardware, as [`F32Lanes`] are.
            GradIo::Direct(_) => {}
            GradIo::Stashed { acc, released } => {
                if let Some(acc) = acc
                    && let Some(lanes) = acc.lanes
                {
                    // The byte ranges of its regions that hold the tile.
                    for (region, r) in acc.elem.iter().zip(lanes.bytes(at, at + n)) {
                        prefetch(&region[r.start.min(region.len())..r.end.min(region.len())]);
                    }
                }
                if let Some(HostValues::Bf16(v)) = released {
                    prefetch(&v[at..at + n]);
                }
            }
        }
    }

    /// Clears the accumulator's tile after the step read it.
    fn clear(&mut self, at: usize, n: usize) {
        if let GradIo::Stashed { acc: Some(acc), .. } = &mut self.io
            && let Some(lanes) = acc.lanes
        {
            lanes.clear(&mut acc.elem, at, n);
        }
    }
}

/// The stash: one tile of the gradient, the parameter, each state and the increments.
struct Stash {
    g: [f32; TILE],
    p: [f32; TILE],
    s: [[f32; TILE]; 3],
    d: [f32; TILE],
}

/// One piece, tile by tile (inlined into each SIMD level's entry).
#[inline(always)]
fn piece<P: LaneKind, S1: LaneKind, S2: LaneKind, S3: LaneKind>(
    a: &StepArgs,
    io: PieceIo<'_>,
) -> Option<bool> {
    let PieceIo { len, grad, slots } = io;
    let [sp, s1, s2, s3] = slots;
    let mut p = P::Lanes::new(sp)?;
    let mut s1 = S1::Lanes::new(s1)?;
    let mut s2 = S2::Lanes::new(s2)?;
    let mut s3 = S3::Lanes::new(s3)?;
    let mut grad = GradLanes {
        io: grad,
        scratch: Scratch::new(),
    };
    let moves = a.flags.has(StepFlags::UPDATE_PARAM);
    let mut st = Stash {
        g: [0.0; TILE],
        p: [0.0; TILE],
        s: [[0.0; TILE]; 3],
        d: [0.0; TILE],
    };
    let mut bad = false;
    for at in (0..len).step_by(TILE) {
        let n = TILE.min(len - at);
        // The next tile's memory, while this one is stepped.
        let next = (at + TILE).min(len);
        let m = TILE.min(len - next);
        grad.prefetch(next, m);
        p.prefetch(next, m);
        s1.prefetch(next, m);
        s2.prefetch(next, m);
        s3.prefetch(next, m);
        let Stash {
            g,
            p: sp,
            s: [sm, sv, sw],
            d,
        } = &mut st;
        let (g, g_plus) = grad.tile(at, n, g);
        let pv = p.values(at, &mut sp[..n], moves);
        let mv = s1.values(at, &mut sm[..n], true);
        let vv = s2.values(at, &mut sv[..n], true);
        let wv = s3.values(at, &mut sw[..n], true);
        let mut chunk = Chunk {
            g,
            g_plus,
            p: pv,
            m: mv,
            v: vv,
            w: wv,
            d: &mut d[..n],
        };
        bad |= if S3::KIND == Kind::Absent {
            apply_chunk_lean(a.rule, a.flags, a.clip, a.limits, &mut chunk)
        } else {
            apply_chunk(a.rule, a.flags, a.clip, a.limits, &mut chunk)
        };
        if moves && !P::Lanes::IN_PLACE {
            p.encode(at, &st.p[..n]);
        }
        let [sm, sv, sw] = &st.s;
        if !S1::Lanes::IN_PLACE {
            s1.encode(at, &sm[..n]);
        }
        if !S2::Lanes::IN_PLACE {
            s2.encode(at, &sv[..n]);
        }
        if !S3::Lanes::IN_PLACE {
            s3.encode(at, &sw[..n]);
        }
        grad.clear(at, n);
    }
    Some(bad)
}

/// A kernel's entry: its lanes' [`piece`] (the rule loop inside picks the SIMD level, as does
/// every table kernel it calls).
fn run<P: LaneKind, S1: LaneKind, S2: LaneKind, S3: LaneKind>(
    a: &StepArgs,
    io: PieceIo<'_>,
) -> Option<bool> {
    piece::<P, S1, S2, S3>(a, io)
}

/// The registry of specialized kernels: a name and the lanes of the parameter and the three
/// states. Every element-wise rule runs on each (its loop is the rule's, `apply_chunk`); a
/// configuration matching none takes the generic path.
macro_rules! kernels {
    ($($name:literal: $p:ty, $s1:ty, $s2:ty, $s3:ty;)*) => {
        static KERNELS: &[Entry] = &[$(
            Entry {
                name: $name,
                kinds: [<$p>::KIND, <$s1>::KIND, <$s2>::KIND, <$s3>::KIND],
                run: run::<$p, $s1, $s2, $s3>,
            },
        )*];
    };
}

kernels! {
    // adamw_f32, ademamix_f32
    "f32 f32 f32 -": KF32, KF32, KF32, KAbsent;
    // sgdm_f32, lion_f32
    "f32 f32 - -": KF32, KF32, KAbsent, KAbsent;
    // adamw_8bit, adamw_4bit
    "f32 q q -": KF32, KQuant, KQuant, KAbsent;
    // adamw_8bit_bf16
    "bf16 q q -": KBf16, KQuant, KQuant, KAbsent;
    // adamw_8bit_bf16_sr, adamw_4bit_bf16_sr_released
    "bf16-sr q q -": KBf16Sr, KQuant, KQuant, KAbsent;
    // adamw_4bit_split
    "split q q -": KSplit, KQuant, KQuant, KAbsent;
    // bf16_nearest(adamw)
    "bf16 bf16 bf16 -": KBf16, KBf16, KBf16, KAbsent;
    // lpmm_sgdm
    "q q - -": KQuant, KQuant, KAbsent, KAbsent;
    // lion_8bit, sgdm with an 8-bit momentum
    "f32 q - -": KF32, KQuant, KAbsent, KAbsent;
    // ademamix_8bit
    "f32 q q q": KF32, KQuant, KQuant, KQuant;
    // schedule_free_adamw_8bit
    "f32 bf16-sr q -": KF32, KBf16Sr, KQuant, KAbsent;
    // rmsprop_f32, adagrad_f32
    "f32 - f32 -": KF32, KAbsent, KF32, KAbsent;
    // rmsprop_8bit, adagrad_8bit
    "f32 - q -": KF32, KAbsent, KQuant, KAbsent;
}
