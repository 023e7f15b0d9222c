//! One parameter's lpmm state in the records burn's `ModuleOptimizer` writes: lpmm's checkpoint
//! codec (`lpmm_optim::checkpoint::codec`) over a one-parameter canonical state, its tensors
//! pushed as the parameter's record tensors.
//!
//! Layout (format [`FORMAT`], version [`VERSION`]), under the parameter's prefix (its burn
//! `ParamId`, which `ModuleOptimizer` puts before every name):
//!
//! - `{id}.lpmm`: the codec's metadata (JSON, u8): the parameter's shape, configuration, step
//!   counter, rule state and random-stream index (the codec's parameter name, `stream{k}`), and
//!   the CRC-32 of the metadata and of every tensor below (name, dtype, shape, bytes);
//! - `{id}.{slot}{region}` for every saved region of every slot: `state1` (the first moment's
//!   codes), `state1.absmax` (its block scales), `state2`, `state2.absmax`, `param.comp` (a Kahan
//!   compensation), `param.rem` (a split-f32 remainder), `param` (the value, where lpmm holds it;
//!   where the value is the parameter's tensor the module record has it), ... in the region's dtype
//!   (u8 codes, f32 scales, bf16 values), 1-D.
//!
//! A load checks all of it (the checksum, every tensor's dtype and size, the configuration's
//! regions) before the state is used; whatever fails is a reason the state is re-initialised.

use burn_core::tensor::{DType, TensorData};
use burn_optim::{StateSink, StateSource};
use lpmm_optim::checkpoint::codec::{Decoded, Scheme, Source, Stored};
use lpmm_optim::checkpoint::{Canonical, CanonicalParam};
use lpmm_optim::{ParamConfig, SlotKind};
use serde::Deserialize;
use std::collections::BTreeMap;

use super::burn_dtype;
use crate::BurnError;
use crate::tensor::state::Loaded;

/// The per-parameter state format's name and version, checked on load.
pub const FORMAT: &str = "lpmm-burn-state";
/// Bumped when the layout changes.
pub const VERSION: u32 = 1;
/// The leaf of the metadata tensor.
const META: &str = "lpmm";

const SCHEME: Scheme = Scheme {
    format: FORMAT,
    version: VERSION,
    maps: false,
    noun: "record",
};

/// The codec's name of the parameter at stream `k`.
fn param_name(stream: u64) -> String {
    format!("stream{stream}")
}

/// Pushes `loaded` (the state of a parameter of rank `rank`) under `prefix`.
pub(crate) fn flatten(
    loaded: &Loaded,
    rank: usize,
    prefix: &str,
    out: &mut StateSink,
) -> Result<(), BurnError> {
    if loaded.param.shape.len() != rank {
        return Err(BurnError::Record(format!(
            "internal: a state of shape {:?} for a rank-{rank} parameter",
            loaded.param.shape
        )));
    }
    let name = param_name(loaded.stream);
    let canonical = Canonical {
        options: loaded.options,
        global_steps: 0,
        groups: vec![loaded.param.requested],
        params: vec![CanonicalParam {
            name: name.clone(),
            group: 0,
            ..loaded.param.clone()
        }],
        eval: false,
    };
    let encoded = canonical
        .encode(&SCHEME, &[loaded.outside])
        .map_err(BurnError::Record)?;
    let head = format!("{name}/");
    for t in encoded.tensors {
        let Some(leaf) = t.name.strip_prefix(&head) else {
            return Err(BurnError::Record(format!(
                "internal: the codec gave tensor {} for {name}",
                t.name
            )));
        };
        let data =
            TensorData::try_from_bytes_vec(t.bytes.into_owned(), vec![t.len], burn_dtype(t.dtype))
                .map_err(|e| BurnError::Record(format!("tensor {leaf}: {e}")))?;
        out.push_tensor(prefix, leaf, data);
    }
    let meta = encoded.metadata.into_bytes();
    let len = meta.len();
    let data = TensorData::try_from_bytes_vec(meta, vec![len], DType::U8)
        .map_err(|e| BurnError::Record(format!("metadata: {e}")))?;
    out.push_tensor(prefix, META, data);
    Ok(())
}

/// The metadata fields that name the tensors to take (the codec checks everything else).
#[derive(Deserialize)]
struct Head {
    params: Vec<HeadParam>,
}

#[derive(Deserialize)]
struct HeadParam {
    name: String,
    shape: Vec<usize>,
    requested: ParamConfig,
    #[serde(default)]
    value_outside: bool,
}

/// A parameter's record tensors by the codec's names.
struct Tensors {
    map: BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
    size: usize,
}

impl Source for Tensors {
    fn names(&self) -> Vec<&str> {
        self.map.keys().map(String::as_str).collect()
    }

    fn get(&self, name: &str) -> Option<Stored<'_>> {
        self.map.get(name).map(|(dtype, shape, bytes)| Stored {
            dtype: dtype.clone(),
            shape,
            bytes,
        })
    }

    fn size(&self) -> usize {
        self.size
    }
}

/// The state of a rank-`rank` parameter under `prefix`, or why there is none that can be used.
pub(crate) fn unflatten(
    prefix: &str,
    rank: usize,
    src: &mut StateSource,
) -> Result<Loaded, String> {
    let Some(meta) = src.take_tensor(prefix, META) else {
        return Err(
            "the record holds no lpmm state for it (a record of another optimizer, or of none)"
                .into(),
        );
    };
    if meta.dtype() != DType::U8 {
        return Err(format!("its metadata is {:?}, not u8", meta.dtype()));
    }
    let json = String::from_utf8(meta.as_bytes().to_vec())
        .map_err(|_| "its metadata is not UTF-8 (a damaged record)".to_string())?;
    let head: Head =
        serde_json::from_str(&json).map_err(|e| format!("its metadata does not parse: {e}"))?;
    let [p] = head.params.as_slice() else {
        return Err(format!(
            "its metadata holds {} parameters, not one",
            head.params.len()
        ));
    };
    let stream: u64 = p
        .name
        .strip_prefix("stream")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("its parameter is named {:?}, not stream<k>", p.name))?;
    if p.shape.len() != rank {
        return Err(format!(
            "the record's state is for shape {:?}, the parameter has rank {rank}",
            p.shape
        ));
    }
    let numel = p
        .shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("shape {:?} overflows", p.shape))?;
    // The tensors the configuration gives this parameter (the codec refuses missing ones).
    let formats = p.requested.resolve(numel, &p.shape).formats();
    let mut map = BTreeMap::new();
    let mut size = meta.as_bytes().len();
    for (slot, format) in SlotKind::ALL.into_iter().zip(formats) {
        let Some(format) = format else { continue };
        for region in format.regions(&p.shape) {
            if slot == SlotKind::Param && region.suffix.is_empty() && p.value_outside {
                continue;
            }
            let leaf = format!("{}{}", slot.name(), region.suffix);
            if let Some(t) = src.take_tensor(prefix, &leaf) {
                size += t.as_bytes().len();
                map.insert(
                    format!("{}/{leaf}", p.name),
                    (
                        format!("{:?}", t.dtype()),
                        t.shape().to_vec(),
                        t.as_bytes().to_vec(),
                    ),
                );
            }
        }
    }
    let Decoded { canonical, outside } = Canonical::decode(&SCHEME, &json, &Tensors { map, size })?;
    let (Some(param), Some(&outside)) = (canonical.params.into_iter().next(), outside.first())
    else {
        return Err("the record's state holds no parameter".into());
    };
    Ok(Loaded {
        param,
        stream,
        outside,
        options: canonical.options,
        label: format!("parameter {prefix}"),
    })
}
