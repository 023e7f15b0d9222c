//! The host side of the device layout: the code-map table the shader reads, and the conversion
//! of each piece's raw words to and from the canonical [`HostSlot`] (checkpoints, moving state
//! between backends).

use lpmm_formats::SplitF32;
use lpmm_formats::bf16;
use lpmm_formats::packing::packed_len;
use lpmm_optim::{HostSlot, MapKind, SlotKind, Storage};

use crate::Piece;

/// One piece's raw words of a slot: its two regions (values; compensations, remainders or
/// block scales).
pub(crate) type Words = (Vec<u32>, Vec<u32>);

/// Every built-in map: values at `512 k`, thresholds at `512 k + 256` (f32 bits), and the
/// number of values of map `k` at `2560 + k` (step.wgsl's `maps`).
pub(crate) fn map_table() -> Vec<u32> {
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
pub(crate) fn zero_tail(words: &mut [u32], bytes: usize) {
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

/// The pieces' raw words of one slot as the canonical whole-tensor host layout (the CPU
/// backend's export of the same contents is equal).
pub(crate) fn export(storage: Option<Storage>, pieces: &[Piece], parts: &[Words]) -> HostSlot {
    let each = pieces.iter().zip(parts);
    match storage {
        None | Some(Storage::None) => HostSlot::Empty,
        Some(Storage::F32) => HostSlot::F32(
            each.flat_map(|(p, (a, _))| a[..p.len].iter().map(|&w| f32::from_bits(w)))
                .collect(),
        ),
        Some(Storage::Bf16(_)) => {
            HostSlot::Bf16(each.flat_map(|(p, (a, _))| halves(a, p.len)).collect())
        }
        Some(Storage::Bf16Kahan) => HostSlot::Kahan {
            value: each
                .clone()
                .flat_map(|(p, (a, _))| halves(a, p.len))
                .collect(),
            comp: each.flat_map(|(p, (_, b))| halves(b, p.len)).collect(),
        },
        Some(Storage::SplitF32) => HostSlot::Split {
            hi: each
                .clone()
                .flat_map(|(p, (a, _))| halves(a, p.len))
                .collect(),
            rem: each.flat_map(|(p, (_, b))| halves(b, p.len)).collect(),
        },
        Some(Storage::Quantized { map, block, .. }) => {
            let bits = map.shared().bits();
            HostSlot::Quantized {
                codes: each
                    .clone()
                    .flat_map(|(p, (a, _))| bytes_of(a, packed_len(p.len, bits)))
                    .collect(),
                absmax: each
                    .flat_map(|(p, (_, b))| {
                        b[..block.blocks(p.len)].iter().map(|&w| f32::from_bits(w))
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
pub(crate) fn import(
    storage: Option<Storage>,
    numel: usize,
    pieces: &[Piece],
    slot: SlotKind,
    host: HostSlot,
) -> Result<Vec<Words>, String> {
    let name = slot.name();
    let mismatch =
        || format!("{name} slot: stored layout or length does not match the configuration");
    let bf_ok = |b: &u16| b & 0x7F80 != 0x7F80;
    let check_values = slot != SlotKind::Grad;
    let cut = |f: &dyn Fn(&Piece, usize) -> Words| {
        let mut at = 0;
        pieces
            .iter()
            .map(|p| {
                let part = f(p, at);
                at += p.len;
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
                    v[at..at + p.len].iter().map(|x| x.to_bits()).collect(),
                    Vec::new(),
                )
            }))
        }
        (Some(Storage::Bf16(_)), HostSlot::Bf16(v)) if v.len() == numel => {
            if check_values && !v.iter().all(bf_ok) {
                return Err(format!("{name} slot holds a non-finite value"));
            }
            Ok(cut(&|p, at| (pack_halves(&v[at..at + p.len]), Vec::new())))
        }
        (Some(Storage::Bf16Kahan), HostSlot::Kahan { value, comp })
            if value.len() == numel && comp.len() == numel =>
        {
            if check_values && !value.iter().chain(&comp).all(bf_ok) {
                return Err(format!("{name} slot holds a non-finite value"));
            }
            Ok(cut(&|p, at| {
                (
                    pack_halves(&value[at..at + p.len]),
                    pack_halves(&comp[at..at + p.len]),
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
                (
                    pack_halves(&hi[at..at + p.len]),
                    pack_halves(&rem[at..at + p.len]),
                )
            }))
        }
        (Some(Storage::Quantized { map, block, .. }), HostSlot::Quantized { codes, absmax }) => {
            let bits = map.shared().bits();
            let want_codes: usize = pieces.iter().map(|p| packed_len(p.len, bits)).sum();
            let want_scales: usize = pieces.iter().map(|p| block.blocks(p.len)).sum();
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
                .map(|p| {
                    let (nc, ns) = (packed_len(p.len, bits), block.blocks(p.len));
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
