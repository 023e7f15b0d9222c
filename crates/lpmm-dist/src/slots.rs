//! Cutting a slot's canonical host contents ([`HostSlot`]) into shards and joining shards back,
//! and the bytes a shard travels as between ranks.

use std::ops::Range;

use lpmm_formats::packing::packed_len;
use lpmm_optim::{HostSlot, Storage};

use crate::DistError;

fn bad(what: &str) -> DistError {
    DistError::Checkpoint(what.to_string())
}

/// Elements `range` of a whole tensor's slot of `storage` (`range.start` a multiple of 4096, so
/// packed codes and block scales cut cleanly). Tensor-wide layouts only as a whole.
pub fn slice(
    host: &HostSlot,
    storage: Storage,
    range: Range<usize>,
    numel: usize,
) -> Result<HostSlot, DistError> {
    let (a, b) = (range.start, range.end);
    let whole = a == 0 && b == numel;
    Ok(match host {
        HostSlot::Empty => HostSlot::Empty,
        HostSlot::F32(v) => HostSlot::F32(
            v.get(a..b)
                .ok_or_else(|| bad("f32 slot too short"))?
                .to_vec(),
        ),
        HostSlot::Bf16(v) => HostSlot::Bf16(
            v.get(a..b)
                .ok_or_else(|| bad("bf16 slot too short"))?
                .to_vec(),
        ),
        HostSlot::Kahan { value, comp } => HostSlot::Kahan {
            value: value
                .get(a..b)
                .ok_or_else(|| bad("kahan slot too short"))?
                .to_vec(),
            comp: comp
                .get(a..b)
                .ok_or_else(|| bad("kahan slot too short"))?
                .to_vec(),
        },
        HostSlot::Split { hi, rem } => HostSlot::Split {
            hi: hi
                .get(a..b)
                .ok_or_else(|| bad("split slot too short"))?
                .to_vec(),
            rem: rem
                .get(a..b)
                .ok_or_else(|| bad("split slot too short"))?
                .to_vec(),
        },
        HostSlot::Quantized { codes, absmax } => {
            let Storage::Quantized { map, block, .. } = storage else {
                return Err(bad("quantized contents for a storage that is not"));
            };
            let bits = map.shared().bits();
            let (ca, cb) = (packed_len(a, bits), packed_len(b, bits));
            let (sa, sb) = (block.blocks(a), block.blocks(b));
            HostSlot::Quantized {
                codes: codes
                    .get(ca..cb)
                    .ok_or_else(|| bad("codes too short"))?
                    .to_vec(),
                absmax: absmax
                    .get(sa..sb)
                    .ok_or_else(|| bad("scales too short"))?
                    .to_vec(),
            }
        }
        other if whole => other.clone(),
        _ => return Err(bad("a tensor-wide state cannot be cut")),
    })
}

/// The whole slot from its shards' contents, in element order.
pub fn join(parts: Vec<HostSlot>) -> Result<HostSlot, DistError> {
    let mut it = parts.into_iter();
    let Some(mut acc) = it.next() else {
        return Ok(HostSlot::Empty);
    };
    for p in it {
        match (&mut acc, p) {
            (HostSlot::Empty, HostSlot::Empty) => {}
            (HostSlot::F32(a), HostSlot::F32(b)) => a.extend(b),
            (HostSlot::Bf16(a), HostSlot::Bf16(b)) => a.extend(b),
            (HostSlot::Kahan { value, comp }, HostSlot::Kahan { value: v, comp: c }) => {
                value.extend(v);
                comp.extend(c);
            }
            (HostSlot::Split { hi, rem }, HostSlot::Split { hi: h, rem: r }) => {
                hi.extend(h);
                rem.extend(r);
            }
            (
                HostSlot::Quantized { codes, absmax },
                HostSlot::Quantized {
                    codes: c,
                    absmax: s,
                },
            ) => {
                codes.extend(c);
                absmax.extend(s);
            }
            _ => return Err(bad("shards of one slot hold different layouts")),
        }
    }
    Ok(acc)
}

/// A slot's contents as bytes (a tag, then length-prefixed little-endian arrays).
pub fn encode(host: &HostSlot) -> Vec<u8> {
    let mut out = Vec::new();
    let arr = |bytes: Vec<u8>, out: &mut Vec<u8>| {
        out.extend((bytes.len() as u64).to_le_bytes());
        out.extend(bytes);
    };
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let u16s = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    match host {
        HostSlot::Empty => out.push(0),
        HostSlot::F32(v) => {
            out.push(1);
            arr(f32s(v), &mut out);
        }
        HostSlot::Bf16(v) => {
            out.push(2);
            arr(u16s(v), &mut out);
        }
        HostSlot::Kahan { value, comp } => {
            out.push(3);
            arr(u16s(value), &mut out);
            arr(u16s(comp), &mut out);
        }
        HostSlot::Split { hi, rem } => {
            out.push(4);
            arr(u16s(hi), &mut out);
            arr(u16s(rem), &mut out);
        }
        HostSlot::Quantized { codes, absmax } => {
            out.push(5);
            arr(codes.clone(), &mut out);
            arr(f32s(absmax), &mut out);
        }
        HostSlot::Factored { row, col } => {
            out.push(6);
            arr(f32s(row), &mut out);
            arr(f32s(col), &mut out);
        }
        HostSlot::Rank1 { codes, scales } => {
            out.push(7);
            arr(codes.clone(), &mut out);
            arr(f32s(scales), &mut out);
        }
    }
    out
}

/// The inverse of [`encode`].
pub fn decode(bytes: &[u8]) -> Result<HostSlot, DistError> {
    let mut at = 1usize;
    let mut arr = || -> Result<&[u8], DistError> {
        let len = bytes
            .get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| bad("truncated slot bytes"))?;
        let out = bytes
            .get(at + 8..at + 8 + len)
            .ok_or_else(|| bad("truncated slot bytes"))?;
        at += 8 + len;
        Ok(out)
    };
    let f32s = |b: &[u8]| {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect::<Vec<f32>>()
    };
    let u16s = |b: &[u8]| {
        b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect::<Vec<u16>>()
    };
    Ok(match bytes.first() {
        Some(0) => HostSlot::Empty,
        Some(1) => HostSlot::F32(f32s(arr()?)),
        Some(2) => HostSlot::Bf16(u16s(arr()?)),
        Some(3) => HostSlot::Kahan {
            value: u16s(arr()?),
            comp: u16s(arr()?),
        },
        Some(4) => HostSlot::Split {
            hi: u16s(arr()?),
            rem: u16s(arr()?),
        },
        Some(5) => HostSlot::Quantized {
            codes: arr()?.to_vec(),
            absmax: f32s(arr()?),
        },
        Some(6) => HostSlot::Factored {
            row: f32s(arr()?),
            col: f32s(arr()?),
        },
        Some(7) => HostSlot::Rank1 {
            codes: arr()?.to_vec(),
            scales: f32s(arr()?),
        },
        _ => return Err(bad("unknown slot tag")),
    })
}
