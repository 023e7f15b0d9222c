//! lpmm's canonical state inside a burn record (burnpack).
//!
//! Layout (version 1): one tensor per saved region of every allocated slot, named
//! `{param_id}.{slot}{suffix}` (`slot` in `param`, `grad`, `state1`, `state2`, `state3`; `suffix` the
//! region's, as in lpmm's safetensors checkpoint: `""`, `.absmax`, `.comp`, `.rem`, ...) and
//! carrying the parameter's burn id, in the region's dtype (u8 codes, f32 scales, bf16 values,
//! ...), 1-D; and metadata key `lpmm` holding the JSON of [`Meta`]: options, step counter,
//! groups, whether the parameters hold their evaluation point, and per parameter its shape,
//! configuration, counters, rule state and whether its value is the module's (then its parameter
//! slot's primary region is not in the record: the module record holds it). Fields added after
//! version 1 was first written (`state3` tensors, `rule_state`, `eval`) default to nothing, so
//! older records still load. A metadata key this build does not know is refused: read as absent,
//! a newer writer's field or a corrupted key would be dropped without a word. Metadata key `crc32`
//! is the CRC-32 of the metadata (as this build writes it, without the checksum) and of every
//! tensor in the record, in name order ([`checksum`]); a record without it, or whose contents do
//! not give it, is refused, so a flipped byte in a state's codes is an error, not a wrong step.

use burn_core::tensor::{Bytes, DType};
use burn_optim::OptimizerRecord;
use lpmm_optim::backend::SLOTS;
use lpmm_optim::backend::{Dtype, HostRegion, HostSlot};
use lpmm_optim::{
    Canonical, CanonicalParam, LrRule, OptimizerOptions, ParamConfig, RuleState, SlotKind,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::BurnError;
use crate::core::Pending;

/// The record format's name and version, checked on load.
pub const FORMAT: &str = "lpmm-burn-record";
/// Bumped when the layout changes.
pub const VERSION: u32 = 1;
const META_KEY: &str = "lpmm";

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
    /// [`checksum`] of the rest; `None` only while it is computed (and in a corrupt record).
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
    /// The parameter's value is the module's tensor (not in this record).
    from_module: bool,
}

fn burn_dtype(d: Dtype) -> DType {
    match d {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
        Dtype::U16 => DType::U16,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
    }
}

fn err(e: impl std::fmt::Display) -> BurnError {
    BurnError::Record(e.to_string())
}

/// The CRC-32 of `json` (the metadata without its checksum) and of every tensor, in name order:
/// each length (8 bytes, little-endian) before its bytes, so the hashed stream reads one way only
/// (a name cannot pass for data).
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
    let mut tensors = Vec::new();
    let mut hashed: Vec<(String, &[u8])> = Vec::new();
    let mut params = Vec::with_capacity(c.params.len());
    for (p, &from_module) in c.params.iter().zip(from_module) {
        let id: u64 = p.name.parse().map_err(|_| {
            err(format!(
                "parameter {} is not named by a burn ParamId",
                p.name
            ))
        })?;
        for (slot, host) in SlotKind::ALL.into_iter().zip(&p.slots) {
            for r in &host.regions {
                if from_module && slot == SlotKind::Param && r.spec.suffix.is_empty() {
                    continue;
                }
                let n = r.bytes.len() / r.spec.dtype.size();
                let name = format!("{id}.{}{}", slot.name(), r.spec.suffix);
                hashed.push((name.clone(), &r.bytes));
                tensors.push(burn_pack::Tensor::new(
                    name,
                    burn_dtype(r.spec.dtype),
                    vec![n],
                    Some(id),
                    Bytes::from_bytes_vec(r.bytes.clone()),
                ));
            }
        }
        params.push(ParamMeta {
            name: p.name.clone(),
            shape: p.shape.clone(),
            group: p.group,
            requested: p.requested,
            steps: p.steps,
            accumulations: p.accumulations,
            pending: p.pending,
            lr_rule: p.lr_rule,
            rule_state: p.rule_state,
            from_module,
        });
    }
    let mut meta = Meta {
        format: FORMAT.into(),
        version: VERSION,
        options: c.options,
        global_steps: c.global_steps,
        groups: c.groups.clone(),
        params,
        eval: c.eval,
        crc32: None,
    };
    hashed.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let json = serde_json::to_string(&meta).map_err(err)?;
    meta.crc32 = Some(checksum(
        &json,
        hashed.iter().map(|(n, b)| (n.as_str(), *b)),
    ));
    let json = serde_json::to_string(&meta).map_err(err)?;
    let bytes = burn_pack::Writer::new(tensors)
        .with_metadata(META_KEY, &json)
        .into_bytes()
        .map_err(err)?;
    OptimizerRecord::from_bytes(bytes).map_err(err)
}

/// The state a record holds (`None` for the record of an optimizer that had not stepped).
pub(crate) fn decode(record: OptimizerRecord) -> Result<Option<Pending>, BurnError> {
    let bytes = record.into_bytes().map_err(err)?;
    let reader = burn_pack::Reader::from_bytes(bytes).map_err(err)?;
    let Some(json) = reader.metadata().get(META_KEY) else {
        if reader.tensor_names().is_empty() {
            return Ok(None);
        }
        return Err(err(
            "not an lpmm-burn record (no lpmm metadata): a record of burn's own optimizers?",
        ));
    };
    let mut meta: Meta = serde_json::from_str(json).map_err(|e| err(format!("metadata: {e}")))?;
    if meta.format != FORMAT || meta.version != VERSION {
        return Err(err(format!(
            "{} version {}, this lpmm-burn reads {FORMAT} version {VERSION}",
            meta.format, meta.version
        )));
    }
    let want = meta.crc32.take().ok_or_else(|| {
        err("no checksum in the metadata (every lpmm-burn record has one): the record is corrupt")
    })?;
    // Every tensor, read once: the checksum covers them all, and the slots take theirs from here.
    let mut data = BTreeMap::new();
    for name in reader.tensor_names() {
        let bytes = reader
            .tensor_data(name)
            .map_err(|e| err(format!("tensor {name}: {e}")))?;
        data.insert(name.to_string(), bytes);
    }
    let got = checksum(
        &serde_json::to_string(&meta).map_err(err)?,
        data.iter().map(|(n, b)| (n.as_str(), b.as_slice())),
    );
    if got != want {
        return Err(err(format!(
            "checksum mismatch (the record says {want:#010x}, its contents give {got:#010x}): the record is corrupt"
        )));
    }
    if meta.eval {
        // lpmm-burn steps in training mode only (it has no evaluation-point switch).
        return Err(err(
            "the record was saved with the parameters at their evaluation point (schedule-free eval())",
        ));
    }
    let mut params = Vec::with_capacity(meta.params.len());
    let mut from_module = Vec::with_capacity(meta.params.len());
    for p in meta.params {
        let numel = p
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| err(format!("parameter {}: shape {:?}", p.name, p.shape)))?;
        p.requested.validate()?;
        let formats = p.requested.resolve(numel, &p.shape).formats();
        let mut slots: [HostSlot; SLOTS] = Default::default();
        for (k, slot) in SlotKind::ALL.into_iter().enumerate() {
            let Some(format) = formats[k] else {
                continue;
            };
            for spec in format.regions(&p.shape).into_iter().filter(|r| r.saved) {
                if p.from_module && slot == SlotKind::Param && spec.suffix.is_empty() {
                    continue;
                }
                let name = format!("{}.{}{}", p.name, slot.name(), spec.suffix);
                let bytes = data
                    .remove(&name)
                    .ok_or_else(|| err(format!("tensor {name}: not in the record")))?;
                slots[k].regions.push(HostRegion { spec, bytes });
            }
        }
        from_module.push(p.from_module);
        params.push(CanonicalParam {
            name: p.name,
            shape: p.shape,
            group: p.group,
            requested: p.requested,
            steps: p.steps,
            accumulations: p.accumulations,
            pending: p.pending,
            lr_rule: p.lr_rule,
            rule_state: p.rule_state,
            slots,
        });
    }
    if params.iter().any(|p| p.group >= meta.groups.len()) {
        return Err(err("a parameter's group is not in the record"));
    }
    Ok(Some(Pending {
        canonical: Canonical {
            options: meta.options,
            global_steps: meta.global_steps,
            groups: meta.groups,
            params,
            eval: meta.eval,
        },
        from_module,
    }))
}
