//! The CPU backend: the reference implementation of every [`Backend`] operation.
//!
//! A parameter is held as pieces of at most 2^20 elements (a multiple of every block size); the
//! step runs the pieces of all active parameters in parallel (rayon), so one big tensor uses every
//! thread and thousands of small ones are batched into a few tasks. Each piece is processed in
//! chunks of 4096 elements with f32 scratch on the stack: nothing is allocated during a step.

use lpmm_formats::{SplitF32, bf16};
use lpmm_quant::{RandomStream, Rank1};
use rayon::prelude::*;

use crate::backend::{Backend, HostSlot, ParamMeta, SlotKind};
use crate::config::Storage;
use crate::error::OptimError;
use crate::exact::ExactSum;
use crate::rule::{Chunk, apply_chunk};
use crate::slot::{CHUNK, Slot, SlotData};

/// Elements per piece.
pub(crate) const PIECE: usize = 1 << 20;

/// The CPU backend (multi-threaded with rayon's global pool, or the pool the caller installs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

/// The random stream of slot `slot` of parameter `param` at counter `counter` (the step, or the
/// accumulate count for the gradient slot): docs/OPTIMIZERS.md.
pub(crate) fn stream(seed: u64, param: usize, slot: SlotKind, counter: u64) -> RandomStream {
    RandomStream::new(seed, (param as u64) << 2 | slot as u64, counter)
}

/// One parameter on the CPU.
#[derive(Debug, Clone)]
pub struct CpuParam {
    pieces: Vec<Piece>,
    rank1: Option<Rank1State>,
    factored: Option<Factored>,
}

/// Adafactor's factorized second moment of a tensor viewed as `rows x cols`: moving averages of
/// the row and column means of the squared gradient, and `mean(r)` for the reconstruction
/// `v_ij = r_i c_j / mean(r)`.
#[derive(Debug, Clone)]
struct Factored {
    rows: usize,
    cols: usize,
    r: Vec<f32>,
    c: Vec<f32>,
    mean_r: f32,
}

impl Factored {
    /// Moves the row and column averages by this step's sums (the pieces' shares, combined in
    /// order) and recomputes `mean(r)`. A value that would overflow keeps its old value.
    fn update(&mut self, pieces: &[Piece], meta: &ParamMeta) {
        let rule = if meta.update_param {
            meta.rule
        } else {
            meta.rule.without_decay()
        };
        let Some((b2, w2)) = rule.second_moment_betas() else {
            return;
        };
        let (rows, cols) = (self.rows, self.cols);
        let sum = |k: usize| pieces.iter().map(|piece| piece.sums[k]).sum::<f64>();
        for i in 0..rows {
            let new = w2.mul_add((sum(i) / cols as f64) as f32, self.r[i] * b2);
            if new.is_finite() {
                self.r[i] = new;
            }
        }
        for j in 0..cols {
            let new = w2.mul_add((sum(rows + j) / rows as f64) as f32, self.c[j] * b2);
            if new.is_finite() {
                self.c[j] = new;
            }
        }
        self.mean_r = (self.r.iter().map(|&x| f64::from(x)).sum::<f64>() / rows as f64) as f32;
    }

    /// The reconstructed second moment of flat element `e`.
    #[inline]
    fn v(&self, e: usize) -> f32 {
        if self.mean_r > 0.0 {
            self.r[e / self.cols] * self.c[e % self.cols] / self.mean_r
        } else {
            0.0
        }
    }
}

/// The per-dimension maxima of a rank-1 second moment: `scales` decode the stored codes; `next`
/// receives the maxima of the updated state during a step, then the two swap.
#[derive(Debug, Clone)]
struct Rank1State {
    q: Rank1<'static>,
    scales: Vec<f32>,
    next: Vec<f32>,
}

/// A contiguous range of one parameter with its slots.
#[derive(Debug, Clone)]
struct Piece {
    offset: usize,
    len: usize,
    slots: [Slot; 4],
    /// Results of the last pass, kept here so a step allocates nothing.
    grad_sum_squares: ExactSum,
    grad_finite: bool,
    saw_non_finite: bool,
    /// This piece's share of a rank-1 state's new maxima (empty otherwise).
    partial: Vec<f32>,
    /// This piece's row and column sums of squared gradients for a factorized state (empty
    /// otherwise).
    sums: Vec<f64>,
}

impl Piece {
    fn slot(&self, kind: SlotKind) -> &Slot {
        &self.slots[kind as usize]
    }
}

/// Runs `f` on every piece of one parameter: inline for a single piece (a small tensor must not
/// pay a thread-pool dispatch per call), in parallel otherwise.
fn for_pieces(pieces: &mut [Piece], f: impl Fn(&mut Piece) + Sync + Send) {
    match pieces {
        [one] => f(one),
        many => many.par_iter_mut().for_each(f),
    }
}

impl Backend for Cpu {
    type Param = CpuParam;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn allocate(
        &self,
        _index: usize,
        meta: &ParamMeta,
        init: &[f32],
        seed: u64,
    ) -> Result<CpuParam, OptimError> {
        let c = meta.config;
        let states = c.hyper.states();
        let rank1 = match c.state2 {
            Storage::Rank1 { map, .. } if states >= 2 => {
                let q = Rank1::new(map.shared(), &meta.shape)?;
                let n = q.scales_len();
                Some(Rank1State {
                    q,
                    scales: vec![0.0; n],
                    next: vec![0.0; n],
                })
            }
            _ => None,
        };
        let factored = match c.state2 {
            Storage::Factorized if states >= 2 => {
                let cols = meta.shape.last().copied().unwrap_or(1).max(1);
                let rows = meta.numel / cols;
                Some(Factored {
                    rows,
                    cols,
                    r: vec![0.0; rows],
                    c: vec![0.0; cols],
                    mean_r: 0.0,
                })
            }
            _ => None,
        };
        let pieces = init
            .chunks(PIECE)
            .enumerate()
            .map(|(k, values)| {
                let offset = k * PIECE;
                let used = |s: Storage, needed: bool| {
                    if needed {
                        Slot::new(s, values.len())
                    } else {
                        Slot::empty()
                    }
                };
                let mut param = Slot::new(c.param, values.len());
                for (j, chunk) in values.chunks(CHUNK).enumerate() {
                    let at = j * CHUNK;
                    param.encode_keyed(
                        at,
                        chunk,
                        stream(seed, meta.stream, SlotKind::Param, 0),
                        (meta.offset + offset + at) as u64,
                    );
                }
                Piece {
                    offset,
                    len: values.len(),
                    slots: [
                        param,
                        Slot::new(c.grad, values.len()),
                        used(c.state1, states >= 1),
                        used(c.state2, states >= 2),
                    ],
                    grad_sum_squares: ExactSum::new(),
                    grad_finite: true,
                    saw_non_finite: false,
                    partial: rank1
                        .as_ref()
                        .map_or_else(Vec::new, |r| vec![0.0; r.scales.len()]),
                    sums: factored
                        .as_ref()
                        .map_or_else(Vec::new, |f| vec![0.0; f.rows + f.cols]),
                }
            })
            .collect();
        Ok(CpuParam {
            pieces,
            rank1,
            factored,
        })
    }

    fn accumulate(
        &self,
        _index: usize,
        param: &mut CpuParam,
        meta: &ParamMeta,
        grad: &[f32],
        seed: u64,
    ) {
        let s = stream(seed, meta.stream, SlotKind::Grad, meta.accumulations);
        for_pieces(&mut param.pieces, |piece| {
            let mut acc = [0f32; CHUNK];
            let g = &grad[piece.offset..piece.offset + piece.len];
            for (c, gc) in g.chunks(CHUNK).enumerate() {
                let start = c * CHUNK;
                let acc = &mut acc[..gc.len()];
                let slot = &mut piece.slots[SlotKind::Grad as usize];
                slot.decode(start, acc);
                acc.iter_mut().zip(gc).for_each(|(a, &x)| *a += x);
                slot.encode_keyed(start, acc, s, (meta.offset + piece.offset + start) as u64);
            }
        });
    }

    fn gradient_stats(
        &self,
        params: &mut [CpuParam],
        metas: &[ParamMeta],
        out: &mut [(ExactSum, bool)],
    ) {
        params
            .par_iter_mut()
            .zip(metas.par_iter())
            .filter(|(_, m)| m.active)
            .flat_map(|(p, _)| p.pieces.par_iter_mut())
            .for_each(|p| {
                let mut acc = [0f32; CHUNK];
                let (mut sum, mut finite) = (ExactSum::new(), true);
                for c in (0..p.len).step_by(CHUNK) {
                    let a = &mut acc[..CHUNK.min(p.len - c)];
                    p.slot(SlotKind::Grad).decode(c, a);
                    // One f64 partial per 256 elements, added exactly: the norm does not
                    // depend on how they are grouped into pieces or shards.
                    finite &= crate::device::add_squares(a, &mut sum);
                }
                p.grad_sum_squares = sum;
                p.grad_finite = finite;
            });
        // Exact sums: the same norm for any thread count, piece size or sharding.
        for ((p, m), o) in params.iter().zip(metas).zip(out.iter_mut()) {
            *o = (ExactSum::new(), true);
            if m.active {
                for piece in &p.pieces {
                    o.0.merge(&piece.grad_sum_squares);
                    o.1 &= piece.grad_finite;
                }
            }
        }
    }

    fn step(
        &self,
        params: &mut [CpuParam],
        metas: &[ParamMeta],
        seed: u64,
        clip: f32,
        released: Option<(usize, &[f32])>,
        non_finite: &mut [bool],
    ) {
        let extra = |index: usize, piece: &Piece| match released {
            Some((i, g)) if i == index => Some(&g[piece.offset..piece.offset + piece.len]),
            _ => None,
        };
        // Phase A (second moments that span pieces: rank-1 maxima, factorized row and column
        // sums): every piece folds its share, then the shares are combined in a fixed order.
        let spans =
            |p: &CpuParam, m: &ParamMeta| m.active && (p.rank1.is_some() || p.factored.is_some());
        if params.iter().zip(metas).any(|(p, m)| spans(p, m)) {
            params
                .par_iter_mut()
                .zip(metas.par_iter())
                .enumerate()
                .filter(|(_, (p, m))| spans(p, m))
                .for_each(|(index, (p, meta))| {
                    let CpuParam {
                        pieces,
                        rank1,
                        factored,
                    } = p;
                    let (rank1, factored) = (rank1.as_ref(), factored.as_ref());
                    for_pieces(pieces, |piece| {
                        let g = extra(index, piece);
                        if let Some(r) = rank1 {
                            rank1_fold(piece, meta, r, clip, g);
                        }
                        if let Some(f) = factored {
                            factor_fold(piece, meta, f, clip, g);
                        }
                    });
                });
            for (p, m) in params.iter_mut().zip(metas).filter(|(p, m)| spans(p, m)) {
                let CpuParam {
                    pieces,
                    rank1,
                    factored,
                } = p;
                if let Some(r) = rank1 {
                    r.next.fill(0.0);
                    for piece in pieces.iter() {
                        r.next
                            .iter_mut()
                            .zip(&piece.partial)
                            .for_each(|(a, &b)| *a = a.max(b));
                    }
                }
                if let Some(f) = factored {
                    f.update(pieces, m);
                }
            }
        }
        // Phase B: the fused pass.
        let run = |index: usize, p: &mut CpuParam, meta: &ParamMeta| {
            let CpuParam {
                pieces,
                rank1,
                factored,
            } = p;
            let wide = TensorWide {
                rank1: rank1.as_ref(),
                factored: factored.as_ref(),
            };
            for_pieces(pieces, |piece| {
                piece.saw_non_finite =
                    fused_step(piece, meta, wide, seed, clip, extra(index, piece));
            });
        };
        match released {
            Some((index, _)) => run(index, &mut params[index], &metas[index]),
            None => params
                .par_iter_mut()
                .zip(metas.par_iter())
                .enumerate()
                .filter(|(_, (_, m))| m.active)
                .for_each(|(index, (p, meta))| run(index, p, meta)),
        }
        for ((p, m), flag) in params.iter_mut().zip(metas).zip(non_finite.iter_mut()) {
            *flag = m.active && p.pieces.iter().any(|piece| piece.saw_non_finite);
            if m.active
                && let Some(r) = &mut p.rank1
            {
                std::mem::swap(&mut r.scales, &mut r.next);
            }
        }
    }

    fn clear_gradients(&self, params: &mut [CpuParam]) {
        for piece in params.iter_mut().flat_map(|p| p.pieces.iter_mut()) {
            let len = piece.len;
            piece.slots[SlotKind::Grad as usize].clear(0, len);
        }
    }

    fn read(&self, param: &CpuParam, _meta: &ParamMeta, slot: SlotKind, out: &mut [f32]) {
        for piece in &param.pieces {
            let out = &mut out[piece.offset..piece.offset + piece.len];
            for (c, o) in out.chunks_mut(CHUNK).enumerate() {
                match (&param.rank1, slot) {
                    (_, SlotKind::State2) if param.factored.is_some() => {
                        if let Some(f) = &param.factored {
                            let g0 = piece.offset + c * CHUNK;
                            o.iter_mut().enumerate().for_each(|(j, x)| *x = f.v(g0 + j));
                        }
                    }
                    (Some(r), SlotKind::State2) => piece.slot(slot).decode_rank1(
                        c * CHUNK,
                        piece.offset + c * CHUNK,
                        o,
                        &r.q,
                        &r.scales,
                    ),
                    _ => piece.slot(slot).decode(c * CHUNK, o),
                }
            }
        }
    }

    fn export(&self, param: &CpuParam, _meta: &ParamMeta, slot: SlotKind) -> HostSlot {
        if let (SlotKind::State2, Some(f)) = (slot, &param.factored) {
            return HostSlot::Factored {
                row: f.r.clone(),
                col: f.c.clone(),
            };
        }
        let datas = param.pieces.iter().map(|p| &p.slot(slot).data);
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        let mut host = HostSlot::Empty;
        for d in datas {
            host = match (host, d) {
                (h, SlotData::Empty) => h,
                (HostSlot::Empty, SlotData::F32(v)) => HostSlot::F32(v.clone()),
                (HostSlot::F32(mut a), SlotData::F32(v)) => {
                    a.extend_from_slice(v);
                    HostSlot::F32(a)
                }
                (HostSlot::Empty, SlotData::Bf16(v)) => HostSlot::Bf16(bits(v)),
                (HostSlot::Bf16(mut a), SlotData::Bf16(v)) => {
                    a.extend(bits(v));
                    HostSlot::Bf16(a)
                }
                (HostSlot::Empty, SlotData::Kahan { value, comp }) => HostSlot::Kahan {
                    value: bits(value),
                    comp: bits(comp),
                },
                (
                    HostSlot::Kahan {
                        value: mut a,
                        comp: mut b,
                    },
                    SlotData::Kahan { value, comp },
                ) => {
                    a.extend(bits(value));
                    b.extend(bits(comp));
                    HostSlot::Kahan { value: a, comp: b }
                }
                (HostSlot::Empty, SlotData::Split(v)) => HostSlot::Split {
                    hi: v.iter().map(|s| s.hi.to_bits()).collect(),
                    rem: v.iter().map(|s| s.rem).collect(),
                },
                (HostSlot::Split { mut hi, mut rem }, SlotData::Split(v)) => {
                    hi.extend(v.iter().map(|s| s.hi.to_bits()));
                    rem.extend(v.iter().map(|s| s.rem));
                    HostSlot::Split { hi, rem }
                }
                (HostSlot::Empty, SlotData::Quantized { codes, absmax }) => HostSlot::Quantized {
                    codes: codes.clone(),
                    absmax: absmax.clone(),
                },
                (
                    HostSlot::Quantized {
                        codes: mut c,
                        absmax: mut a,
                    },
                    SlotData::Quantized { codes, absmax },
                ) => {
                    c.extend_from_slice(codes);
                    a.extend_from_slice(absmax);
                    HostSlot::Quantized {
                        codes: c,
                        absmax: a,
                    }
                }
                (HostSlot::Empty, SlotData::Rank1(codes)) => HostSlot::Rank1 {
                    codes: codes.clone(),
                    scales: param
                        .rank1
                        .as_ref()
                        .map_or_else(Vec::new, |r| r.scales.clone()),
                },
                (
                    HostSlot::Rank1 {
                        codes: mut c,
                        scales,
                    },
                    SlotData::Rank1(codes),
                ) => {
                    c.extend_from_slice(codes);
                    HostSlot::Rank1 { codes: c, scales }
                }
                // Every piece of a slot has the same storage.
                (h, _) => h,
            };
        }
        host
    }

    fn import(
        &self,
        param: &mut CpuParam,
        _meta: &ParamMeta,
        slot: SlotKind,
        host: HostSlot,
    ) -> Result<(), String> {
        if let (SlotKind::State2, Some(f)) = (slot, &mut param.factored) {
            let HostSlot::Factored { row, col } = host else {
                return Err("state2 slot: a factorized state was expected".into());
            };
            if row.len() != f.rows || col.len() != f.cols {
                return Err("state2 slot: factorized statistics do not match the shape".into());
            }
            if let Some(bad) = row.iter().chain(&col).find(|x| !x.is_finite() || **x < 0.0) {
                return Err(format!(
                    "state2 slot: factorized statistic {bad} is not a finite non-negative number"
                ));
            }
            f.mean_r = (row.iter().map(|&x| f64::from(x)).sum::<f64>() / f.rows as f64) as f32;
            (f.r, f.c) = (row, col);
            return Ok(());
        }
        // Validate everything first, then write: an error leaves the slot unchanged.
        let lens: Vec<(usize, usize)> = param
            .pieces
            .iter()
            .map(|p| data_lens(&p.slot(slot).data))
            .collect();
        let want: (usize, usize) = lens.iter().fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let kind = param
            .pieces
            .first()
            .map(|p| std::mem::discriminant(&p.slot(slot).data));
        let host_lens = host_lens(&host);
        let matches = match (&host, param.pieces.first().map(|p| &p.slot(slot).data)) {
            (HostSlot::Empty, None | Some(SlotData::Empty)) => true,
            (HostSlot::F32(_), Some(SlotData::F32(_)))
            | (HostSlot::Bf16(_), Some(SlotData::Bf16(_)))
            | (HostSlot::Kahan { .. }, Some(SlotData::Kahan { .. }))
            | (HostSlot::Split { .. }, Some(SlotData::Split(_)))
            | (HostSlot::Quantized { .. }, Some(SlotData::Quantized { .. }))
            | (HostSlot::Rank1 { .. }, Some(SlotData::Rank1(_))) => host_lens == want,
            _ => false,
        };
        let _ = kind;
        if !matches {
            return Err(format!(
                "{} slot: stored layout or length does not match the configuration",
                slot.name()
            ));
        }
        if let HostSlot::Quantized { absmax, .. } | HostSlot::Rank1 { scales: absmax, .. } = &host
            && let Some(bad) = absmax.iter().find(|x| !x.is_finite() || **x < 0.0)
        {
            return Err(format!(
                "{} slot: scale {bad} is not a finite non-negative number",
                slot.name()
            ));
        }
        // Parameters and states must be finite (a gradient accumulator may hold a pending
        // non-finite value for the step's policy).
        if slot != SlotKind::Grad {
            let bf_ok = |b: &u16| b & 0x7F80 != 0x7F80;
            let ok = match &host {
                HostSlot::F32(v) => v.iter().all(|x| x.is_finite()),
                HostSlot::Bf16(v) => v.iter().all(bf_ok),
                HostSlot::Kahan { value, comp } => value.iter().chain(comp).all(bf_ok),
                HostSlot::Split { hi, rem } => hi.iter().zip(rem).all(|(&h, &r)| {
                    SplitF32 {
                        hi: bf16::from_bits(h),
                        rem: r,
                    }
                    .to_f32()
                    .is_finite()
                }),
                _ => true,
            };
            if !ok {
                return Err(format!("{} slot holds a non-finite value", slot.name()));
            }
        }
        if let HostSlot::Rank1 { scales, .. } = &host {
            match &mut param.rank1 {
                Some(r) if r.scales.len() == scales.len() => r.scales.copy_from_slice(scales),
                _ => {
                    return Err(format!(
                        "{} slot: rank-1 scales do not match the shape",
                        slot.name()
                    ));
                }
            }
        }
        let (mut a, mut b) = (0usize, 0usize);
        for (piece, (la, lb)) in param.pieces.iter_mut().zip(lens) {
            let data = &mut piece.slots[slot as usize].data;
            match (data, &host) {
                (SlotData::F32(v), HostSlot::F32(h)) => v.copy_from_slice(&h[a..a + la]),
                (SlotData::Bf16(v), HostSlot::Bf16(h)) => v
                    .iter_mut()
                    .zip(&h[a..a + la])
                    .for_each(|(x, &y)| *x = bf16::from_bits(y)),
                (
                    SlotData::Kahan { value, comp },
                    HostSlot::Kahan {
                        value: hv,
                        comp: hc,
                    },
                ) => {
                    value
                        .iter_mut()
                        .zip(&hv[a..a + la])
                        .for_each(|(x, &y)| *x = bf16::from_bits(y));
                    comp.iter_mut()
                        .zip(&hc[b..b + lb])
                        .for_each(|(x, &y)| *x = bf16::from_bits(y));
                }
                (SlotData::Split(v), HostSlot::Split { hi, rem }) => {
                    for ((s, &h), &r) in v.iter_mut().zip(&hi[a..a + la]).zip(&rem[b..b + lb]) {
                        *s = SplitF32 {
                            hi: bf16::from_bits(h),
                            rem: r,
                        };
                    }
                }
                (
                    SlotData::Quantized { codes, absmax },
                    HostSlot::Quantized {
                        codes: hc,
                        absmax: ha,
                    },
                ) => {
                    codes.copy_from_slice(&hc[a..a + la]);
                    absmax.copy_from_slice(&ha[b..b + lb]);
                }
                (SlotData::Rank1(codes), HostSlot::Rank1 { codes: hc, .. }) => {
                    codes.copy_from_slice(&hc[a..a + la])
                }
                _ => {}
            }
            a += la;
            b += lb;
        }
        Ok(())
    }

    fn bytes(&self, param: &CpuParam) -> [usize; 4] {
        let mut bytes = [0usize; 4];
        for piece in &param.pieces {
            for (b, slot) in bytes.iter_mut().zip(&piece.slots) {
                *b += slot.bytes();
            }
        }
        // A factorized state: its row and column averages, and each piece's f64 sums.
        if let Some(f) = &param.factored {
            let sums: usize = param.pieces.iter().map(|p| p.sums.len()).sum();
            bytes[3] += 4 * (f.r.len() + f.c.len()) + 8 * sums;
        }
        // A rank-1 state's tensor-wide scales, the next step's maxima and each piece's share.
        if let Some(r) = &param.rank1 {
            let partials: usize = param.pieces.iter().map(|p| p.partial.len()).sum();
            bytes[3] += 4 * (r.scales.len() + r.next.len() + partials);
        }
        bytes
    }
}

/// Element counts of a piece's slot data: (main, side) — side is the Kahan compensation, the
/// split remainder or the block scales.
fn data_lens(d: &SlotData) -> (usize, usize) {
    match d {
        SlotData::Empty => (0, 0),
        SlotData::F32(v) => (v.len(), 0),
        SlotData::Bf16(v) => (v.len(), 0),
        SlotData::Kahan { value, comp } => (value.len(), comp.len()),
        SlotData::Split(v) => (v.len(), v.len()),
        SlotData::Quantized { codes, absmax } => (codes.len(), absmax.len()),
        SlotData::Rank1(codes) => (codes.len(), 0),
    }
}

fn host_lens(h: &HostSlot) -> (usize, usize) {
    match h {
        HostSlot::Empty => (0, 0),
        HostSlot::F32(v) => (v.len(), 0),
        HostSlot::Bf16(v) => (v.len(), 0),
        HostSlot::Kahan { value, comp } => (value.len(), comp.len()),
        HostSlot::Split { hi, rem } => (hi.len(), rem.len()),
        HostSlot::Quantized { codes, absmax } => (codes.len(), absmax.len()),
        HostSlot::Rank1 { codes, .. } => (codes.len(), 0),
        HostSlot::Factored { row, col } => (row.len(), col.len()),
    }
}

/// Decodes a chunk's gradient (the accumulator plus the released gradient, if any) and parameter.
fn load_gradient_and_param(
    grad_slot: &Slot,
    param: &Slot,
    start: usize,
    released: Option<&[f32]>,
    g: &mut [f32],
    p: &mut [f32],
) {
    grad_slot.decode(start, g);
    let n = g.len();
    if let Some(extra) = released {
        g.iter_mut()
            .zip(&extra[start..start + n])
            .for_each(|(a, &b)| *a += b);
    }
    param.decode(start, p);
}

/// A parameter's statistics that span its pieces (read-only during the fused pass).
#[derive(Clone, Copy)]
struct TensorWide<'a> {
    rank1: Option<&'a Rank1State>,
    factored: Option<&'a Factored>,
}

/// The fused step of one piece: for each chunk, decode gradient, parameter and states, apply the
/// rule, requantize the states with their new absmax, store the parameter, clear the gradient.
/// Returns whether a non-finite gradient was met (its elements were left unchanged).
fn fused_step(
    piece: &mut Piece,
    meta: &ParamMeta,
    tensor_wide: TensorWide<'_>,
    seed: u64,
    clip: f32,
    grad: Option<&[f32]>,
) -> bool {
    let TensorWide { rank1, factored } = tensor_wide;
    let t = meta.steps + 1;
    let first = meta.steps == 0;
    let rule = if meta.update_param {
        meta.rule
    } else {
        meta.rule.without_decay()
    };
    let rule = if factored.is_some() {
        rule.with_given_second_moment()
    } else {
        rule
    };
    let [param, grad_slot, state1, state2] = &mut piece.slots;
    let kahan = matches!(param.data, SlotData::Kahan { .. });
    let (mut g, mut p, mut m, mut v, mut d) = (
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
    );
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
        let global = piece.offset + start;
        load_gradient_and_param(grad_slot, param, start, grad, g, p);
        state1.decode(start, m);
        match (rank1, factored) {
            (Some(r), _) => state2.decode_rank1(start, global, v, &r.q, &r.scales),
            (_, Some(f)) => v
                .iter_mut()
                .enumerate()
                .for_each(|(j, x)| *x = f.v(global + j)),
            _ => state2.decode(start, v),
        }
        let mut chunk = Chunk { g, p, m, v, d };
        saw_non_finite |= apply_chunk(rule, clip, first, &mut chunk);
        let Chunk { p, m, v, d, .. } = chunk;
        state1.encode_keyed(
            start,
            m,
            stream(seed, meta.stream, SlotKind::State1, t),
            (meta.offset + global) as u64,
        );
        match rank1 {
            Some(r) => state2.encode_rank1(start, global, v, &r.q, &r.next),
            None => state2.encode_keyed(
                start,
                v,
                stream(seed, meta.stream, SlotKind::State2, t),
                (meta.offset + global) as u64,
            ),
        }
        if meta.update_param {
            if kahan {
                param.kahan_add(start, d);
            } else {
                param.encode_keyed(
                    start,
                    p,
                    stream(seed, meta.stream, SlotKind::Param, t),
                    (meta.offset + global) as u64,
                );
            }
        }
        grad_slot.clear(start, n);
    }
    saw_non_finite
}

/// Phase A of a rank-1 step for one piece: recompute the updated second moment exactly as
/// [`fused_step`] will, and fold its per-dimension maxima into `piece.partial`.
fn rank1_fold(
    piece: &mut Piece,
    meta: &ParamMeta,
    r: &Rank1State,
    clip: f32,
    grad: Option<&[f32]>,
) {
    let first = meta.steps == 0;
    let rule = if meta.update_param {
        meta.rule
    } else {
        meta.rule.without_decay()
    };
    piece.partial.fill(0.0);
    let (mut g, mut p, mut m, mut v, mut d) = (
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
    );
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        let (g, p, m, v, d) = (
            &mut g[..n],
            &mut p[..n],
            &mut m[..n],
            &mut v[..n],
            &mut d[..n],
        );
        let global = piece.offset + start;
        load_gradient_and_param(
            piece.slot(SlotKind::Grad),
            piece.slot(SlotKind::Param),
            start,
            grad,
            g,
            p,
        );
        piece.slot(SlotKind::State1).decode(start, m);
        piece
            .slot(SlotKind::State2)
            .decode_rank1(start, global, v, &r.q, &r.scales);
        // Exactly the fused pass's element-wise work, restore included, so both phases agree
        // (the parameter and increments it computes are dropped).
        apply_chunk(rule, clip, first, &mut Chunk { g, p, m, v, d });
        r.q.fold_maxima(v, global, &mut piece.partial);
    }
}

/// Phase A of a factorized step for one piece: the row and column sums of the squared gradients
/// the moments see (clipped, L2 decay folded in; non-finite values left out).
fn factor_fold(piece: &mut Piece, meta: &ParamMeta, f: &Factored, clip: f32, grad: Option<&[f32]>) {
    let rule = if meta.update_param {
        meta.rule
    } else {
        meta.rule.without_decay()
    };
    piece.sums.fill(0.0);
    let (mut g, mut p) = ([0f32; CHUNK], [0f32; CHUNK]);
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        let (g, p) = (&mut g[..n], &mut p[..n]);
        let global = piece.offset + start;
        load_gradient_and_param(
            piece.slot(SlotKind::Grad),
            piece.slot(SlotKind::Param),
            start,
            grad,
            g,
            p,
        );
        for i in 0..n {
            let gm = rule.moment_gradient(p[i], g[i] * clip);
            if gm.is_finite() {
                let e = global + i;
                let sq = f64::from(gm) * f64::from(gm);
                piece.sums[e / f.cols] += sq;
                piece.sums[f.rows + e % f.cols] += sq;
            }
        }
    }
}
