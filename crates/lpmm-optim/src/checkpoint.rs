//! Checkpoints: the complete optimizer state (every slot's bytes, scales and code maps, step and
//! accumulation counters that position the random streams, the configuration) as one safetensors
//! file with versioned metadata, written atomically. Loading builds a new optimizer and validates
//! everything before anything live changes.
//!
//! Layout (version 1): per parameter `p` and slot `s` in {param, grad, state1, state2}:
//! `p/s` (F32, BF16 or U8 codes; the whole tensor, unsharded), `p/s.comp` (BF16, Kahan
//! compensation), `p/s.rem` (U16, split-f32 remainder), `p/s.absmax` (F32 block scales); and
//! `maps/<map name>` (F32) for every code map in use. Metadata key `lpmm` holds the JSON of
//! [`CheckpointMeta`].

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use lpmm_formats::{SplitF32, bf16};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::config::{MapKind, ParamConfig, Storage};
use crate::error::OptimError;
use crate::optimizer::{Optimizer, OptimizerOptions};
use crate::slot::SlotData;

/// The checkpoint format's name and version, checked on load.
pub const FORMAT: &str = "lpmm-optim-checkpoint";
/// Bumped whenever the layout changes; older versions get a typed error naming both.
pub const VERSION: u32 = 1;

const SLOTS: [&str; 4] = ["param", "grad", "state1", "state2"];

/// What the metadata holds besides the tensors.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CheckpointMeta {
    format: String,
    version: u32,
    options: OptimizerOptions,
    global_steps: u64,
    groups: Vec<ParamConfig>,
    params: Vec<ParamMeta>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ParamMeta {
    name: String,
    shape: Vec<usize>,
    group: usize,
    requested: ParamConfig,
    steps: u64,
    accumulations: u64,
    pending: bool,
}

fn err(path: &Path, reason: impl std::fmt::Display) -> OptimError {
    OptimError::Checkpoint {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// One slot's bytes over all pieces, as (suffix, dtype, element count, bytes).
fn slot_tensors(data: &[&SlotData]) -> Vec<(&'static str, Dtype, usize, Vec<u8>)> {
    let mut main = Vec::new();
    let mut extra = Vec::new();
    let mut absmax = Vec::new();
    let mut kind = None;
    for d in data {
        match d {
            SlotData::Empty => return Vec::new(),
            SlotData::F32(v) => {
                kind = Some(Dtype::F32);
                main.extend(v.iter().flat_map(|x| x.to_le_bytes()));
            }
            SlotData::Bf16(v) => {
                kind = Some(Dtype::BF16);
                main.extend(v.iter().flat_map(|x| x.to_bits().to_le_bytes()));
            }
            SlotData::Kahan { value, comp } => {
                kind = Some(Dtype::BF16);
                main.extend(value.iter().flat_map(|x| x.to_bits().to_le_bytes()));
                extra.extend(comp.iter().flat_map(|x| x.to_bits().to_le_bytes()));
            }
            SlotData::Split(v) => {
                kind = Some(Dtype::BF16);
                main.extend(v.iter().flat_map(|s| s.hi.to_bits().to_le_bytes()));
                extra.extend(v.iter().flat_map(|s| s.rem.to_le_bytes()));
            }
            SlotData::Quantized { codes, absmax: a } => {
                kind = Some(Dtype::U8);
                main.extend_from_slice(codes);
                absmax.extend(a.iter().flat_map(|x| x.to_le_bytes()));
            }
            // The tensor-wide scales are saved by the caller.
            SlotData::Rank1(codes) => {
                kind = Some(Dtype::U8);
                main.extend_from_slice(codes);
            }
        }
    }
    let Some(kind) = kind else { return Vec::new() };
    let size = |d: Dtype| match d {
        Dtype::F32 => 4,
        Dtype::BF16 | Dtype::U16 => 2,
        _ => 1,
    };
    let mut out = vec![("", kind, main.len() / size(kind), main)];
    match data.first() {
        Some(SlotData::Kahan { .. }) => out.push((".comp", Dtype::BF16, extra.len() / 2, extra)),
        Some(SlotData::Split(_)) => out.push((".rem", Dtype::U16, extra.len() / 2, extra)),
        Some(SlotData::Quantized { .. }) => {
            out.push((".absmax", Dtype::F32, absmax.len() / 4, absmax))
        }
        _ => {}
    }
    out
}

impl Optimizer {
    /// Writes the complete state to `path` atomically: a temporary file in the same directory,
    /// flushed to disk, then renamed over `path`. A crash leaves the old file or the new one,
    /// never a partial one.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), OptimError> {
        let path = path.as_ref();
        let meta = CheckpointMeta {
            format: FORMAT.into(),
            version: VERSION,
            options: self.options,
            global_steps: self.global_steps,
            groups: self.groups.clone(),
            params: self
                .metas
                .iter()
                .map(|m| ParamMeta {
                    name: m.name.clone(),
                    shape: m.shape.clone(),
                    group: m.group,
                    requested: m.requested,
                    steps: m.steps,
                    accumulations: m.accumulations,
                    pending: m.pending,
                })
                .collect(),
        };
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut maps: Vec<MapKind> = Vec::new();
        for m in &self.metas {
            let pieces = &self.pieces[m.first_piece..m.first_piece + m.pieces];
            for (s, slot_name) in SLOTS.iter().enumerate() {
                let data: Vec<&SlotData> = pieces
                    .iter()
                    .map(|p| [&p.param.data, &p.grad.data, &p.state1.data, &p.state2.data][s])
                    .collect();
                for (suffix, dtype, n, bytes) in slot_tensors(&data) {
                    tensors.push((
                        format!("{}/{slot_name}{suffix}", m.name),
                        dtype,
                        vec![n],
                        bytes,
                    ));
                }
            }
            if let Some(r) = &m.rank1 {
                let bytes = r
                    .scales
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>();
                tensors.push((
                    format!("{}/state2.scales", m.name),
                    Dtype::F32,
                    vec![r.scales.len()],
                    bytes,
                ));
            }
            let c = m.config;
            for storage in [c.param, c.grad, c.state1, c.state2] {
                if let Storage::Quantized { map, .. } | Storage::Rank1 { map, .. } = storage {
                    if !maps.contains(&map) {
                        maps.push(map);
                    }
                }
            }
        }
        for map in maps {
            let bytes = map
                .shared()
                .values()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>();
            tensors.push((
                format!("maps/{}", map.name()),
                Dtype::F32,
                vec![bytes.len() / 4],
                bytes,
            ));
        }
        let views = tensors
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| err(path, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let json = serde_json::to_string(&meta).map_err(|e| err(path, e))?;
        let info = HashMap::from([("lpmm".to_string(), json)]);
        let bytes = safetensors::tensor::serialize(views, Some(info)).map_err(|e| err(path, e))?;
        write_atomically(path, &bytes)
    }

    /// Reads a checkpoint written by [`Optimizer::save`] into a new optimizer.
    pub fn load(path: impl AsRef<Path>) -> Result<Optimizer, OptimError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| err(path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| err(path, format!("not a readable safetensors file: {e}")))?;
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| err(path, e))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("lpmm"))
            .ok_or_else(|| err(path, "no lpmm metadata: not an lpmm checkpoint"))?;
        let meta: CheckpointMeta =
            serde_json::from_str(json).map_err(|e| err(path, format!("metadata: {e}")))?;
        if meta.format != FORMAT {
            return Err(err(
                path,
                format!("format {:?}, expected {FORMAT:?}", meta.format),
            ));
        }
        if meta.version != VERSION {
            return Err(err(
                path,
                format!(
                    "version {}, this lpmm reads version {VERSION}",
                    meta.version
                ),
            ));
        }
        // Rebuild the structure, then overwrite every slot with the stored bytes.
        let mut opt = Optimizer::new(meta.options)?;
        for g in &meta.groups {
            opt.add_group(*g)?;
        }
        for p in &meta.params {
            let numel = p
                .shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .unwrap_or(usize::MAX);
            // Every storage takes at least 4 bits per element: a larger shape cannot be in this
            // file (and must not make us allocate for it).
            if numel > 2 * bytes.len() {
                return Err(err(
                    path,
                    format!(
                        "parameter {} has shape {:?}, larger than the file",
                        p.name, p.shape
                    ),
                ));
            }
            let zeros = vec![0f32; numel];
            opt.add_param_with(&p.name, &p.shape, &zeros, p.group, p.requested)?;
        }
        for (i, p) in meta.params.iter().enumerate() {
            let m = &mut opt.metas[i];
            m.steps = p.steps;
            m.accumulations = p.accumulations;
            m.pending = p.pending;
        }
        opt.global_steps = meta.global_steps;
        // Code maps must be the ones this build constructs.
        for (name, view) in st.tensors() {
            if let Some(map_name) = name.strip_prefix("maps/") {
                let kind = MapKind::from_name(map_name)
                    .ok_or_else(|| err(path, format!("unknown code map {map_name}")))?;
                let want: Vec<u8> = kind
                    .shared()
                    .values()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                if view.data() != want.as_slice() {
                    return Err(err(
                        path,
                        format!("code map {map_name} differs from this build's"),
                    ));
                }
            }
        }
        for i in 0..opt.metas.len() {
            let (name, first, count) = (
                opt.metas[i].name.clone(),
                opt.metas[i].first_piece,
                opt.metas[i].pieces,
            );
            for (s, slot_name) in SLOTS.iter().enumerate() {
                let mut pieces: Vec<&mut SlotData> = opt.pieces[first..first + count]
                    .iter_mut()
                    .map(|p| match s {
                        0 => &mut p.param.data,
                        1 => &mut p.grad.data,
                        2 => &mut p.state1.data,
                        _ => &mut p.state2.data,
                    })
                    .collect();
                fill_slot(&st, &format!("{name}/{slot_name}"), &mut pieces)
                    .map_err(|reason| err(path, reason))?;
            }
            if let Some(r) = &mut opt.metas[i].rank1 {
                let key = format!("{name}/state2.scales");
                let t = st
                    .tensor(&key)
                    .map_err(|_| err(path, format!("tensor {key} missing")))?;
                if t.dtype() != Dtype::F32 || t.data().len() != 4 * r.scales.len() {
                    return Err(err(
                        path,
                        format!("tensor {key} has the wrong type or length"),
                    ));
                }
                for (x, c) in r.scales.iter_mut().zip(t.data().chunks_exact(4)) {
                    *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    if !x.is_finite() || *x < 0.0 {
                        return Err(err(path, format!("tensor {key} holds {x}")));
                    }
                }
            }
        }
        Ok(opt)
    }

    /// Replaces this optimizer's state with the checkpoint at `path`, which must hold the same
    /// parameters (names, shapes, order). On any error nothing changes.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<(), OptimError> {
        let path = path.as_ref();
        let loaded = Optimizer::load(path)?;
        let same = loaded.metas.len() == self.metas.len()
            && loaded
                .metas
                .iter()
                .zip(&self.metas)
                .all(|(a, b)| a.name == b.name && a.shape == b.shape);
        if !same {
            return Err(err(
                path,
                "the checkpoint holds other parameters (names or shapes differ)",
            ));
        }
        *self = loaded;
        Ok(())
    }
}

/// Reads `key` (and its side tensors) into the pieces of one slot, checking dtype and length.
fn fill_slot(st: &SafeTensors<'_>, key: &str, pieces: &mut [&mut SlotData]) -> Result<(), String> {
    let get = |k: &str, dtype: Dtype| -> Result<Vec<u8>, String> {
        let t = st.tensor(k).map_err(|_| format!("tensor {k} missing"))?;
        if t.dtype() != dtype {
            return Err(format!("tensor {k} is {:?}, expected {dtype:?}", t.dtype()));
        }
        Ok(t.data().to_vec())
    };
    fn take<'a>(bytes: &'a [u8], at: &mut usize, n: usize, key: &str) -> Result<&'a [u8], String> {
        let s = bytes
            .get(*at..*at + n)
            .ok_or_else(|| format!("tensor {key} is too short"))?;
        *at += n;
        Ok(s)
    }
    if matches!(pieces.first().map(|p| &**p), None | Some(SlotData::Empty)) {
        return Ok(());
    }
    let (mut a, mut b) = (0usize, 0usize);
    let main_dtype = match pieces[0] {
        SlotData::F32(_) => Dtype::F32,
        SlotData::Quantized { .. } | SlotData::Rank1(_) => Dtype::U8,
        _ => Dtype::BF16,
    };
    let main = get(key, main_dtype)?;
    let side = match pieces[0] {
        SlotData::Kahan { .. } => Some(get(&format!("{key}.comp"), Dtype::BF16)?),
        SlotData::Split(_) => Some(get(&format!("{key}.rem"), Dtype::U16)?),
        SlotData::Quantized { .. } => Some(get(&format!("{key}.absmax"), Dtype::F32)?),
        _ => None,
    };
    let side = side.unwrap_or_default();
    let bf = |c: &[u8]| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]));
    for piece in pieces.iter_mut() {
        match &mut **piece {
            SlotData::Empty => {}
            SlotData::F32(v) => {
                let bytes = take(&main, &mut a, 4 * v.len(), key)?;
                v.iter_mut()
                    .zip(bytes.chunks_exact(4))
                    .for_each(|(x, c)| *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }
            SlotData::Bf16(v) => {
                let bytes = take(&main, &mut a, 2 * v.len(), key)?;
                v.iter_mut()
                    .zip(bytes.chunks_exact(2))
                    .for_each(|(x, c)| *x = bf(c));
            }
            SlotData::Kahan { value, comp } => {
                let bytes = take(&main, &mut a, 2 * value.len(), key)?;
                value
                    .iter_mut()
                    .zip(bytes.chunks_exact(2))
                    .for_each(|(x, c)| *x = bf(c));
                let bytes = take(&side, &mut b, 2 * comp.len(), key)?;
                comp.iter_mut()
                    .zip(bytes.chunks_exact(2))
                    .for_each(|(x, c)| *x = bf(c));
            }
            SlotData::Split(v) => {
                let hi = take(&main, &mut a, 2 * v.len(), key)?;
                let rem = take(&side, &mut b, 2 * v.len(), key)?;
                for ((s, h), r) in v
                    .iter_mut()
                    .zip(hi.chunks_exact(2))
                    .zip(rem.chunks_exact(2))
                {
                    *s = SplitF32 {
                        hi: bf(h),
                        rem: u16::from_le_bytes([r[0], r[1]]),
                    };
                }
            }
            SlotData::Rank1(codes) => {
                let bytes = take(&main, &mut a, codes.len(), key)?;
                codes.copy_from_slice(bytes);
            }
            SlotData::Quantized { codes, absmax } => {
                let bytes = take(&main, &mut a, codes.len(), key)?;
                codes.copy_from_slice(bytes);
                let bytes = take(&side, &mut b, 4 * absmax.len(), key)?;
                for (x, c) in absmax.iter_mut().zip(bytes.chunks_exact(4)) {
                    *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    if !x.is_finite() || *x < 0.0 {
                        return Err(format!("tensor {key}.absmax holds {x}"));
                    }
                }
            }
        }
    }
    if a != main.len() || b != side.len() {
        return Err(format!("tensor {key} has the wrong length"));
    }
    Ok(())
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), OptimError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .ok_or_else(|| err(path, "not a file path"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok::<(), std::io::Error>(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(path, e));
    }
    Ok(())
}
