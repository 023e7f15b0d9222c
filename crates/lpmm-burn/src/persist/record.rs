//! The whole-module optimizer's canonical state inside a burn record (burnpack): the container only. The layout, the
//! metadata, the checksum and every check are lpmm's checkpoint codec's (`lpmm_optim::checkpoint::codec`).
//!
//! Layout (version 2): every tensor of the codec's encoding as a 1-D burnpack tensor in the
//! burn dtype of its region (u8 codes, f32 scales, bf16 values, ...), named as the codec names it
//! (`{param_id}/{slot}{suffix}`, the parameter named by its burn `ParamId`) and carrying the
//! parameter's burn id; no code maps ([`lpmm_optim::checkpoint::codec::Scheme::maps`]); and burnpack
//! metadata key `lpmm` holding the codec's metadata (format [`FORMAT`], version [`VERSION`]).
//! A parameter whose value is the module's tensor is held outside the record (`value_outside`:
//! its parameter slot's primary region is not in the record; the module record holds it). A
//! metadata key this build does not know, a record without its checksum, or one whose contents
//! do not give it, is refused, so a flipped byte in a state's codes is an error, not a wrong step.
//!
//! Version 1 records (lpmm-burn's own layout before the codec: tensors `{param_id}.{slot}{suffix}`,
//! a `from_module` flag per parameter, a CRC-32 over the metadata and the tensors' names and
//! bytes only) still load: [`v1`] checks their checksum, then hands the codec the same state in
//! today's layout.

use burn_core::tensor::Bytes;
use burn_optim::OptimizerRecord;
use lpmm_optim::checkpoint::Canonical;
use lpmm_optim::checkpoint::codec::{self, Decoded, Scheme, Source, Stored};
use serde::Deserialize;
use std::collections::BTreeMap;

use super::burn_dtype;
use crate::BurnError;
use crate::core::Pending;

/// The record format's name and version, checked on load.
pub const FORMAT: &str = "lpmm-burn-record";
/// Bumped when the layout changes (version 1 records still load).
pub const VERSION: u32 = 2;
const META_KEY: &str = "lpmm";

/// The codec's scheme for burn records: no code maps (lpmm's own), errors about "the record".
const SCHEME: Scheme = Scheme {
    format: FORMAT,
    version: VERSION,
    maps: false,
    noun: "record",
};

fn err(e: impl std::fmt::Display) -> BurnError {
    BurnError::Record(e.to_string())
}

/// The burn `ParamId` a parameter is named by.
fn burn_id(name: &str) -> Result<u64, BurnError> {
    name.parse()
        .map_err(|_| err(format!("parameter {name} is not named by a burn ParamId")))
}

/// The record of `pending` (an empty record for an optimizer that has not stepped).
pub(crate) fn encode(pending: Option<&Pending>) -> Result<OptimizerRecord, BurnError> {
    let Some(Pending {
        canonical: c,
        from_module,
    }) = pending
    else {
        return OptimizerRecord::from_bytes(
            burn_pack::Writer::new(Vec::new())
                .into_bytes()
                .map_err(err)?,
        )
        .map_err(err);
    };
    let ids = c
        .params
        .iter()
        .map(|p| burn_id(&p.name))
        .collect::<Result<Vec<_>, _>>()?;
    let encoded = c.encode(&SCHEME, from_module).map_err(err)?;
    let tensors = encoded
        .tensors
        .into_iter()
        .map(|t| {
            burn_pack::Tensor::new(
                t.name,
                burn_dtype(t.dtype),
                vec![t.len],
                t.param.map(|i| ids[i]),
                Bytes::from_bytes_vec(t.bytes.into_owned()),
            )
        })
        .collect();
    let bytes = burn_pack::Writer::new(tensors)
        .with_metadata(META_KEY, &encoded.metadata)
        .into_bytes()
        .map_err(err)?;
    OptimizerRecord::from_bytes(bytes).map_err(err)
}

/// A record's tensors by name, as the codec reads them.
struct Tensors {
    map: BTreeMap<String, (String, Vec<usize>, Bytes)>,
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

/// The version a record's metadata names (its other keys are the codec's to check).
#[derive(Deserialize)]
struct Version {
    version: u32,
}

/// The state a record holds (`None` for the record of an optimizer that had not stepped).
pub(crate) fn decode(record: OptimizerRecord) -> Result<Option<Pending>, BurnError> {
    let bytes = record.into_bytes().map_err(err)?;
    let size = bytes.len();
    let reader = burn_pack::Reader::from_bytes(bytes).map_err(err)?;
    let Some(json) = reader.metadata().get(META_KEY).cloned() else {
        if reader.tensor_names().is_empty() {
            return Ok(None);
        }
        return Err(err(
            "not an lpmm-burn record (no lpmm metadata): a record of burn's own optimizers?",
        ));
    };
    let version = serde_json::from_str::<Version>(&json)
        .map_err(|e| err(format!("metadata: {e}")))?
        .version;
    let mut map = BTreeMap::new();
    for t in reader.into_tensors().map_err(err)? {
        let (name, dtype, shape, _, bytes) = t.into_parts().map_err(err)?;
        map.insert(name, (format!("{dtype:?}"), shape.to_vec(), bytes));
    }
    let tensors = Tensors { map, size };
    let Decoded { canonical, outside } = match version {
        1 => v1::decode(&json, tensors),
        VERSION => Canonical::decode(&SCHEME, &json, &tensors),
        v => Err(format!(
            "version {v}, this lpmm-burn reads versions 1 and {VERSION}"
        )),
    }
    .map_err(err)?;
    if canonical.eval {
        // lpmm-burn steps in training mode only (it has no evaluation-point switch).
        return Err(err(
            "the record was saved with the parameters at their evaluation point (schedule-free eval())",
        ));
    }
    Ok(Some(Pending {
        canonical,
        from_module: outside,
    }))
}

/// Version 1 records: lpmm-burn's layout before the codec.
pub(crate) mod v1 {
    use super::*;
    use lpmm_optim::{LrRule, OptimizerOptions, ParamConfig, RuleState};
    use serde::Serialize;

    #[derive(Debug, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Meta {
        format: String,
        version: u32,
        options: OptimizerOptions,
        global_steps: u64,
        groups: Vec<ParamConfig>,
        params: Vec<ParamMeta>,
        #[serde(default)]
        eval: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        crc32: Option<u32>,
    }

    #[derive(Debug, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct ParamMeta {
        name: String,
        shape: Vec<usize>,
        group: usize,
        requested: ParamConfig,
        steps: u64,
        accumulations: u64,
        pending: bool,
        lr_rule: LrRule,
        #[serde(default)]
        rule_state: RuleState,
        /// The parameter's value is the module's tensor (not in the record).
        from_module: bool,
    }

    /// Version 1's CRC-32 of `json` (the metadata without its checksum) and of every tensor's
    /// name and bytes, in name order, each length (8 bytes, little-endian) before its bytes.
    fn checksum<'a>(json: &str, tensors: impl Iterator<Item = (&'a str, &'a [u8])>) -> u32 {
        let mut h = crc32fast::Hasher::new();
        let mut put = |bytes: &[u8]| {
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        put(json.as_bytes());
        for (name, bytes) in tensors {
            put(name.as_bytes());
            put(bytes);
        }
        h.finalize()
    }

    /// Checks a version 1 record's own checksum, then decodes the same state in today's layout
    /// through the codec: tensors renamed (`{id}.{slot}` to `{id}/{slot}`), `from_module` as
    /// `value_outside`, the version this build writes, and the codec's checksum.
    pub(super) fn decode(json: &str, tensors: Tensors) -> Result<Decoded, String> {
        let mut meta: Meta = serde_json::from_str(json).map_err(|e| format!("metadata: {e}"))?;
        if meta.format != FORMAT {
            return Err(format!("format {:?}, expected {FORMAT:?}", meta.format));
        }
        let want = meta.crc32.take().ok_or(
            "no checksum in the metadata (every lpmm-burn record has one): the record is corrupt",
        )?;
        let got = checksum(
            &serde_json::to_string(&meta).map_err(|e| format!("metadata: {e}"))?,
            tensors
                .map
                .iter()
                .map(|(n, (_, _, b))| (n.as_str(), &b[..])),
        );
        if got != want {
            return Err(format!(
                "checksum mismatch (the record says {want:#010x}, its contents give {got:#010x}): the record is corrupt"
            ));
        }
        let mut today = serde_json::to_value(&meta).map_err(|e| format!("metadata: {e}"))?;
        today["version"] = VERSION.into();
        for p in today["params"].as_array_mut().into_iter().flatten() {
            if let Some(p) = p.as_object_mut()
                && let Some(outside) = p.remove("from_module")
            {
                p.insert("value_outside".into(), outside);
            }
        }
        let Tensors { map, size } = tensors;
        // Version 1 names have no `/`, so renamed they cannot collide.
        if let Some(name) = map.keys().find(|n| n.contains('/')) {
            return Err(format!("tensor {name}: not a version 1 tensor name"));
        }
        let map = map
            .into_iter()
            .map(|(name, t)| (name.replacen('.', "/", 1), t))
            .collect();
        let tensors = Tensors { map, size };
        let json = codec::seal(&today.to_string(), &tensors)?;
        Canonical::decode(&SCHEME, &json, &tensors)
    }
}
