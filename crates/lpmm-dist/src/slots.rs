//! Cutting a slot's canonical host contents ([`HostSlot`]) into shards and joining shards back,
//! and the bytes a shard travels as between ranks. Everything works on the format's regions
//! (`lpmm_optim::backend::RegionSpec`): element regions are cut by element range, tensor-wide
//! ones only travel whole.

use std::ops::Range;

use lpmm_optim::HostSlot;
use lpmm_optim::backend::{HostRegion, RegionSpec};

use crate::DistError;

fn bad(what: &str) -> DistError {
    DistError::Checkpoint(what.to_string())
}

/// Elements `range` of a whole tensor's slot (`range.start` a multiple of the shard alignment, so
/// packed codes and block scales cut cleanly). Tensor-wide regions only as a whole.
pub fn slice(host: &HostSlot, range: Range<usize>, numel: usize) -> Result<HostSlot, DistError> {
    if range.start == 0 && range.end == numel {
        return Ok(host.clone());
    }
    let regions = host
        .regions
        .iter()
        .map(|r| {
            if !r.spec.per_element() {
                return Err(bad("a tensor-wide state cannot be cut"));
            }
            let bytes = r
                .bytes
                .get(r.spec.byte_range(range.start, range.end))
                .ok_or_else(|| bad("slot contents too short for the shard"))?;
            Ok(HostRegion {
                spec: r.spec,
                bytes: bytes.to_vec(),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(HostSlot { regions })
}

/// The whole slot from its shards' contents, in element order.
pub fn join(parts: Vec<HostSlot>) -> Result<HostSlot, DistError> {
    let mut it = parts.into_iter();
    let Some(mut acc) = it.next() else {
        return Ok(HostSlot::empty());
    };
    for p in it {
        if p.regions.len() != acc.regions.len()
            || p.regions
                .iter()
                .zip(&acc.regions)
                .any(|(a, b)| a.spec != b.spec)
        {
            return Err(bad("shards of one slot hold different layouts"));
        }
        for (a, b) in acc.regions.iter_mut().zip(p.regions) {
            if !a.spec.per_element() {
                return Err(bad("a tensor-wide state was split"));
            }
            a.bytes.extend(b.bytes);
        }
    }
    Ok(acc)
}

/// A slot's contents as bytes: the region count, then each region's length-prefixed bytes.
pub fn encode(host: &HostSlot) -> Vec<u8> {
    let mut out = vec![host.regions.len() as u8];
    for r in &host.regions {
        out.extend((r.bytes.len() as u64).to_le_bytes());
        out.extend(&r.bytes);
    }
    out
}

/// The inverse of [`encode`], for a slot whose saved regions are `specs`.
pub fn decode(bytes: &[u8], specs: &[RegionSpec]) -> Result<HostSlot, DistError> {
    let count = *bytes.first().ok_or_else(|| bad("truncated slot bytes"))? as usize;
    if count != specs.len() {
        return Err(bad("slot bytes of another layout"));
    }
    let mut at = 1usize;
    let mut regions = Vec::with_capacity(count);
    for &spec in specs {
        let len = bytes
            .get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| bad("truncated slot bytes"))?;
        let data = bytes
            .get(at + 8..at + 8 + len)
            .ok_or_else(|| bad("truncated slot bytes"))?;
        regions.push(HostRegion {
            spec,
            bytes: data.to_vec(),
        });
        at += 8 + len;
    }
    Ok(HostSlot { regions })
}
