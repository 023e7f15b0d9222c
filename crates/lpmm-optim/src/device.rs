//! What GPU backends share: how a slot is laid out in device words, the code-map table and the
//! rule constants their kernels read, and the conversion of a slot's raw device words to and
//! from the canonical [`HostSlot`] (checkpoints, moving state between backends).
//!
//! A slot of `n` elements occupies two word regions (see [`SlotFormat::words`]): values (f32
//! words; bf16 pairs; packed codes, little-endian bytes) and a second region (Kahan
//! compensations, split-f32 remainders as 16-bit pairs, or one f32 block scale per block). A
//! backend may cut a tensor into pieces, each with its own regions; the functions here take the
//! pieces' element counts in tensor order. lpmm-wgpu's `step.wgsl` and lpmm-cuda's `lpmm.cu` read
//! these layouts and constants.

use lpmm_formats::SplitF32;
use lpmm_formats::bf16;
use lpmm_formats::packing::packed_len;

use crate::{
    ExactSum, HostSlot, MapKind, OptimError, ParamMeta, Rule, SlotKind, Storage, StoreRounding,
};

/// Format codes the kernels switch on.
pub const FMT_EMPTY: u32 = 0;
/// f32 words.
pub const FMT_F32: u32 = 1;
/// bf16, rounded to nearest.
pub const FMT_BF16: u32 = 2;
/// bf16, stochastically rounded.
pub const FMT_BF16_SR: u32 = 3;
/// bf16 value and bf16 Kahan compensation.
pub const FMT_KAHAN: u32 = 4;
/// Split f32 (bf16 visible half, 16-bit remainder).
pub const FMT_SPLIT: u32 = 5;
/// Block-quantized codes and block scales.
pub const FMT_QUANT: u32 = 6;

/// How one slot is stored on a device: the kernels' format code and parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotFormat {
    /// One of the `FMT_*` codes.
    pub code: u32,
    /// Quantized slots: map | log2(block) << 8 | stochastic << 16 | code bits << 24.
    pub aux: u32,
    /// The storage (None for an unallocated slot).
    pub storage: Option<Storage>,
}

impl SlotFormat {
    /// An unallocated slot.
    pub const EMPTY: SlotFormat = SlotFormat {
        code: FMT_EMPTY,
        aux: 0,
        storage: None,
    };

    /// The device format of `storage` in `slot`; rank-1 and factorized storages (tensor-wide
    /// statistics) are [`OptimError::Unsupported`] on device backends named `backend`.
    pub fn of(storage: Storage, slot: SlotKind, backend: &'static str) -> Result<Self, OptimError> {
        let code = match storage {
            Storage::None => return Ok(Self::EMPTY),
            Storage::F32 => FMT_F32,
            Storage::Bf16(StoreRounding::Nearest) => FMT_BF16,
            Storage::Bf16(StoreRounding::Stochastic) => FMT_BF16_SR,
            Storage::Bf16Kahan => FMT_KAHAN,
            Storage::SplitF32 => FMT_SPLIT,
            Storage::Quantized { .. } => FMT_QUANT,
            Storage::Rank1 { .. } | Storage::Factorized => {
                return Err(OptimError::Unsupported {
                    backend,
                    what: format!(
                        "{} storage of the {} slot (tensor-wide second moments run on the CPU backend)",
                        storage.describe(),
                        slot.name()
                    ),
                });
            }
        };
        let aux = match storage {
            Storage::Quantized {
                map,
                block,
                rounding,
            } => {
                map as u32
                    | block.get().trailing_zeros() << 8
                    | u32::from(rounding == StoreRounding::Stochastic) << 16
                    | map.shared().bits() << 24
            }
            _ => 0,
        };
        Ok(Self {
            code,
            aux,
            storage: Some(storage),
        })
    }

    /// Words of the slot's two regions for `n` elements.
    pub fn words(&self, n: usize) -> (usize, usize) {
        let half = n.div_ceil(2);
        match (self.code, self.storage) {
            (FMT_F32, _) => (n, 0),
            (FMT_BF16 | FMT_BF16_SR, _) => (half, 0),
            (FMT_KAHAN | FMT_SPLIT, _) => (half, half),
            (FMT_QUANT, Some(Storage::Quantized { map, block, .. })) => (
                packed_len(n, map.shared().bits()).div_ceil(4),
                block.blocks(n),
            ),
            _ => (0, 0),
        }
    }

    /// The raw words of `n` freshly allocated elements, as the CPU initialises a slot: zeros,
    /// and every byte of a quantized slot's codes the code of 0 (bytes past the packed length
    /// zero).
    pub fn fresh(&self, n: usize) -> Words {
        let (wa, wb) = self.words(n);
        let mut a = vec![0u32; wa];
        if let Some(Storage::Quantized { map, .. }) = self.storage {
            let fill = u32::from_le_bytes([map.shared().nearest(0.0); 4]);
            if fill != 0 {
                a.fill(fill);
                zero_tail(&mut a, packed_len(n, map.shared().bits()));
            }
        }
        (a, vec![0; wb])
    }
}

/// The device formats of a parameter's four slots (states the optimizer does not use are empty).
pub fn slot_formats(
    meta: &ParamMeta,
    backend: &'static str,
) -> Result<[SlotFormat; 4], OptimError> {
    let c = meta.config;
    let states = c.hyper.states();
    let used = |s: Storage, needed: bool, k: SlotKind| {
        if needed {
            SlotFormat::of(s, k, backend)
        } else {
            Ok(SlotFormat::EMPTY)
        }
    };
    Ok([
        SlotFormat::of(c.param, SlotKind::Param, backend)?,
        SlotFormat::of(c.grad, SlotKind::Grad, backend)?,
        used(c.state1, states >= 1, SlotKind::State1)?,
        used(c.state2, states >= 2, SlotKind::State2)?,
    ])
}

/// A rule as the kernels read it: kind (0 SGD, 1 Adam/AdamW, 2 Lion), up to 11 f32 constants in
/// the order the kernels name them, and flags (1 Nesterov, 2 momentum, 4 decoupled decay,
/// 8 second moment given).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RuleWords {
    /// 0 SGD, 1 Adam/AdamW, 2 Lion.
    pub kind: u32,
    /// The constants (unused ones zero).
    pub constants: [f32; 11],
    /// Flag bits.
    pub flags: u32,
}

impl RuleWords {
    /// The kernels' view of `rule`.
    pub fn of(rule: Rule) -> Self {
        let mut constants = [0f32; 11];
        let (kind, list, flags): (u32, &[f32], u32) = match rule {
            Rule::Sgd {
                neg_lr,
                wd,
                momentum,
                one_minus_dampening,
                nesterov,
                has_momentum,
            } => (
                0,
                &[neg_lr, wd, momentum, one_minus_dampening],
                u32::from(nesterov) | u32::from(has_momentum) << 1,
            ),
            Rule::Adam {
                decoupled,
                decay,
                neg_lr_wd,
                wd,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                bias_correction2_sqrt,
                eps,
                neg_step_size,
                given_v,
            } => (
                1,
                &[
                    decay,
                    neg_lr_wd,
                    wd,
                    one_minus_beta1,
                    beta2,
                    one_minus_beta2,
                    bias_correction2_sqrt,
                    eps,
                    neg_step_size,
                ],
                u32::from(decoupled) << 2 | u32::from(given_v) << 3,
            ),
            Rule::Lion {
                decay,
                neg_lr_wd,
                neg_lr,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
            } => (
                2,
                &[
                    decay,
                    neg_lr_wd,
                    neg_lr,
                    beta1,
                    one_minus_beta1,
                    beta2,
                    one_minus_beta2,
                ],
                0,
            ),
        };
        constants[..list.len()].copy_from_slice(list);
        Self {
            kind,
            constants,
            flags,
        }
    }
}

/// `Backend::gradient_stats` from decoded accumulators: `outputs[k]` holds consecutive ranges of
/// parameter `owner[k]` (a parameter's ranges adjacent and in order); `out[index]` gets each
/// parameter's [`sum_squares`], and zero and `true` where it has none.
pub fn stats_by_owner(owner: &[usize], outputs: &[Vec<f32>], out: &mut [(ExactSum, bool)]) {
    out.iter_mut().for_each(|o| *o = (ExactSum::new(), true));
    let mut k = 0;
    while k < owner.len() {
        let index = owner[k];
        let mut values = Vec::new();
        while k < owner.len() && owner[k] == index {
            values.extend_from_slice(&outputs[k]);
            k += 1;
        }
        out[index] = sum_squares(&values);
    }
}

/// Elements per partial sum of the gradient norm (see `Backend::gradient_stats`).
pub const NORM_RUN: usize = 256;

/// Adds the squares of `values`' finite elements to `sum` as the gradient norm defines it (one
/// f64 partial per [`NORM_RUN`] elements, in element order, added exactly; `values` starts at a
/// multiple of `NORM_RUN` of the parameter) and returns whether every element is finite.
pub fn add_squares(values: &[f32], sum: &mut ExactSum) -> bool {
    let mut finite = true;
    for run in values.chunks(NORM_RUN) {
        let mut part = 0.0f64;
        for &x in run {
            // Only finite values count towards the norm: under SkipElements one Inf must not
            // turn clipping off for the rest.
            if x.is_finite() {
                part += f64::from(x) * f64::from(x);
            } else {
                finite = false;
            }
        }
        sum.add(part);
    }
    finite
}

/// The gradient statistics of a tensor's decoded accumulator: [`add_squares`] from zero.
pub fn sum_squares(values: &[f32]) -> (ExactSum, bool) {
    let mut total = ExactSum::new();
    let finite = add_squares(values, &mut total);
    (total, finite)
}

/// The parameters a `Backend::step` call steps, in order: each one's index, the released
/// gradient it adds (gradient release), and the rule in force (without weight decay during
/// optimizer accumulation, when the parameter does not move).
pub fn stepping<'a>(
    metas: &[ParamMeta],
    released: Option<(usize, &'a [f32])>,
) -> Vec<(usize, Option<&'a [f32]>, Rule)> {
    metas
        .iter()
        .enumerate()
        .filter_map(|(index, meta)| {
            let extra = match released {
                Some((i, g)) if i == index => Some(g),
                Some(_) => return None,
                None if !meta.active => return None,
                None => None,
            };
            let rule = if meta.update_param {
                meta.rule
            } else {
                meta.rule.without_decay()
            };
            Some((index, extra, rule))
        })
        .collect()
}

/// One piece's raw words of a slot: its two regions (values; compensations, remainders or
/// block scales).
pub type Words = (Vec<u32>, Vec<u32>);

/// Every built-in map: values at `512 k`, thresholds at `512 k + 256` (f32 bits), and the
/// number of values of map `k` at `2560 + k` (the kernels' `maps`).
pub fn map_table() -> Vec<u32> {
    const KINDS: [MapKind; 5] = [
        MapKind::DynamicSigned8,
        MapKind::DynamicUnsigned8,
        MapKind::DynamicExponentSigned4,
        MapKind::LinearWithoutZero4,
        MapKind::LinearSigned8,
    ];
    let mut table = vec![0u32; 512 * KINDS.len() + KINDS.len()];
    for kind in KINDS {
        let k = kind as usize;
        let map = kind.shared();
        for (j, v) in map.values().iter().enumerate() {
            table[512 * k + j] = v.to_bits();
        }
        for (j, t) in map.thresholds().iter().enumerate() {
            table[512 * k + 256 + j] = t.to_bits();
        }
        table[512 * KINDS.len() + k] = map.len() as u32;
    }
    table
}

/// Zeroes every byte of `words` (little-endian) from byte `bytes` on.
pub fn zero_tail(words: &mut [u32], bytes: usize) {
    for (w, word) in words.iter_mut().enumerate() {
        for b in 0..4 {
            if 4 * w + b >= bytes {
                *word &= !(0xFF << (8 * b));
            }
        }
    }
}

fn halves(words: &[u32], n: usize) -> impl Iterator<Item = u16> + '_ {
    (0..n).map(move |i| (words[i / 2] >> (16 * (i % 2))) as u16)
}

fn pack_halves(values: &[u16]) -> Vec<u32> {
    values
        .chunks(2)
        .map(|c| u32::from(c[0]) | c.get(1).map_or(0, |&h| u32::from(h) << 16))
        .collect()
}

fn bytes_of(words: &[u32], n: usize) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).take(n).collect()
}

fn words_of(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// The pieces' raw words of one slot (`pieces`: each piece's element count, in tensor order) as the canonical whole-tensor host layout (the CPU
/// backend's export of the same contents is equal).
pub fn export(storage: Option<Storage>, pieces: &[usize], parts: &[Words]) -> HostSlot {
    let each = pieces.iter().zip(parts);
    match storage {
        None | Some(Storage::None) => HostSlot::Empty,
        Some(Storage::F32) => HostSlot::F32(
            each.flat_map(|(&p, (a, _))| a[..p].iter().map(|&w| f32::from_bits(w)))
                .collect(),
        ),
        Some(Storage::Bf16(_)) => {
            HostSlot::Bf16(each.flat_map(|(&p, (a, _))| halves(a, p)).collect())
        }
        Some(Storage::Bf16Kahan) => HostSlot::Kahan {
            value: each.clone().flat_map(|(&p, (a, _))| halves(a, p)).collect(),
            comp: each.flat_map(|(&p, (_, b))| halves(b, p)).collect(),
        },
        Some(Storage::SplitF32) => HostSlot::Split {
            hi: each.clone().flat_map(|(&p, (a, _))| halves(a, p)).collect(),
            rem: each.flat_map(|(&p, (_, b))| halves(b, p)).collect(),
        },
        Some(Storage::Quantized { map, block, .. }) => {
            let bits = map.shared().bits();
            HostSlot::Quantized {
                codes: each
                    .clone()
                    .flat_map(|(&p, (a, _))| bytes_of(a, packed_len(p, bits)))
                    .collect(),
                absmax: each
                    .flat_map(|(&p, (_, b))| {
                        b[..block.blocks(p)].iter().map(|&w| f32::from_bits(w))
                    })
                    .collect(),
            }
        }
        // Not allocated by this backend (refused at registration).
        Some(Storage::Rank1 { .. } | Storage::Factorized) => HostSlot::Empty,
    }
}

/// Checks canonical host contents against the slot's storage (layout, lengths, finite values
/// and scales, as the CPU backend checks them) and cuts them into the pieces' raw words.
pub fn import(
    storage: Option<Storage>,
    numel: usize,
    pieces: &[usize],
    slot: SlotKind,
    host: HostSlot,
) -> Result<Vec<Words>, String> {
    let name = slot.name();
    let mismatch =
        || format!("{name} slot: stored layout or length does not match the configuration");
    let bf_ok = |b: &u16| b & 0x7F80 != 0x7F80;
    let check_values = slot != SlotKind::Grad;
    let cut = |f: &dyn Fn(usize, usize) -> Words| {
        let mut at = 0;
        pieces
            .iter()
            .map(|&p| {
                let part = f(p, at);
                at += p;
                part
            })
            .collect::<Vec<_>>()
    };
    match (storage, host) {
        (None | Some(Storage::None), HostSlot::Empty) => {
            Ok(pieces.iter().map(|_| (Vec::new(), Vec::new())).collect())
        }
        (Some(Storage::F32), HostSlot::F32(v)) if v.len() == numel => {
            if check_values && !v.iter().all(|x| x.is_finite()) {
                return Err(format!("{name} slot holds a non-finite value"));
            }
            Ok(cut(&|p, at| {
                (
                    v[at..at + p].iter().map(|x| x.to_bits()).collect(),
                    Vec::new(),
                )
            }))
        }
        (Some(Storage::Bf16(_)), HostSlot::Bf16(v)) if v.len() == numel => {
            if check_values && !v.iter().all(bf_ok) {
                return Err(format!("{name} slot holds a non-finite value"));
            }
            Ok(cut(&|p, at| (pack_halves(&v[at..at + p]), Vec::new())))
        }
        (Some(Storage::Bf16Kahan), HostSlot::Kahan { value, comp })
            if value.len() == numel && comp.len() == numel =>
        {
            if check_values && !value.iter().chain(&comp).all(bf_ok) {
                return Err(format!("{name} slot holds a non-finite value"));
            }
            Ok(cut(&|p, at| {
                (
                    pack_halves(&value[at..at + p]),
                    pack_halves(&comp[at..at + p]),
                )
            }))
        }
        (Some(Storage::SplitF32), HostSlot::Split { hi, rem })
            if hi.len() == numel && rem.len() == numel =>
        {
            let finite = hi.iter().zip(&rem).all(|(&h, &r)| {
                SplitF32 {
                    hi: bf16::from_bits(h),
                    rem: r,
                }
                .to_f32()
                .is_finite()
            });
            if check_values && !finite {
                return Err(format!("{name} slot holds a non-finite value"));
            }
            Ok(cut(&|p, at| {
                (pack_halves(&hi[at..at + p]), pack_halves(&rem[at..at + p]))
            }))
        }
        (Some(Storage::Quantized { map, block, .. }), HostSlot::Quantized { codes, absmax }) => {
            let bits = map.shared().bits();
            let want_codes: usize = pieces.iter().map(|&p| packed_len(p, bits)).sum();
            let want_scales: usize = pieces.iter().map(|&p| block.blocks(p)).sum();
            if codes.len() != want_codes || absmax.len() != want_scales {
                return Err(mismatch());
            }
            if let Some(bad) = absmax.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return Err(format!(
                    "{name} slot: scale {bad} is not a finite non-negative number"
                ));
            }
            let (mut c, mut s) = (0, 0);
            Ok(pieces
                .iter()
                .map(|&p| {
                    let (nc, ns) = (packed_len(p, bits), block.blocks(p));
                    let part = (
                        words_of(&codes[c..c + nc]),
                        absmax[s..s + ns].iter().map(|x| x.to_bits()).collect(),
                    );
                    (c, s) = (c + nc, s + ns);
                    part
                })
                .collect())
        }
        _ => Err(mismatch()),
    }
}
