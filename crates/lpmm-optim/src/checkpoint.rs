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

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, HostSlot, SlotKind};
use crate::config::{MapKind, ParamConfig, Storage};
use crate::cpu::Cpu;
use crate::error::OptimError;
use crate::optimizer::{Optimizer, OptimizerOptions};

/// The checkpoint format's name and version, checked on load.
pub const FORMAT: &str = "lpmm-optim-checkpoint";
/// Bumped whenever the layout changes; older versions get a typed error naming both.
pub const VERSION: u32 = 1;

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
    #[serde(default)]
    lr_rule: crate::backend::LrRule,
}

fn err(path: &Path, reason: impl std::fmt::Display) -> OptimError {
    OptimError::Checkpoint {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// A slot's tensors: (suffix, dtype, element count, little-endian bytes).
fn host_tensors(host: &HostSlot) -> Vec<(&'static str, Dtype, usize, Vec<u8>)> {
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let u16s = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    match host {
        HostSlot::Empty => Vec::new(),
        HostSlot::F32(v) => vec![("", Dtype::F32, v.len(), f32s(v))],
        HostSlot::Bf16(v) => vec![("", Dtype::BF16, v.len(), u16s(v))],
        HostSlot::Kahan { value, comp } => {
            vec![
                ("", Dtype::BF16, value.len(), u16s(value)),
                (".comp", Dtype::BF16, comp.len(), u16s(comp)),
            ]
        }
        HostSlot::Split { hi, rem } => {
            vec![
                ("", Dtype::BF16, hi.len(), u16s(hi)),
                (".rem", Dtype::U16, rem.len(), u16s(rem)),
            ]
        }
        HostSlot::Quantized { codes, absmax } => {
            vec![
                ("", Dtype::U8, codes.len(), codes.clone()),
                (".absmax", Dtype::F32, absmax.len(), f32s(absmax)),
            ]
        }
        HostSlot::Factored { row, col } => {
            vec![
                (".row", Dtype::F32, row.len(), f32s(row)),
                (".col", Dtype::F32, col.len(), f32s(col)),
            ]
        }
        HostSlot::Rank1 { codes, scales } => {
            vec![
                ("", Dtype::U8, codes.len(), codes.clone()),
                (".scales", Dtype::F32, scales.len(), f32s(scales)),
            ]
        }
    }
}

/// Reads the tensors of slot `key` in the layout of `template` (the fresh slot's export).
fn read_host(st: &SafeTensors<'_>, key: &str, template: &HostSlot) -> Result<HostSlot, String> {
    let get = |k: &str, dtype: Dtype| -> Result<Vec<u8>, String> {
        let t = st.tensor(k).map_err(|_| format!("tensor {k} missing"))?;
        if t.dtype() != dtype {
            return Err(format!("tensor {k} is {:?}, expected {dtype:?}", t.dtype()));
        }
        Ok(t.data().to_vec())
    };
    let f32s = |b: Vec<u8>| {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect::<Vec<f32>>()
    };
    let u16s = |b: Vec<u8>| {
        b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect::<Vec<u16>>()
    };
    Ok(match template {
        HostSlot::Empty => HostSlot::Empty,
        HostSlot::F32(_) => HostSlot::F32(f32s(get(key, Dtype::F32)?)),
        HostSlot::Bf16(_) => HostSlot::Bf16(u16s(get(key, Dtype::BF16)?)),
        HostSlot::Kahan { .. } => HostSlot::Kahan {
            value: u16s(get(key, Dtype::BF16)?),
            comp: u16s(get(&format!("{key}.comp"), Dtype::BF16)?),
        },
        HostSlot::Split { .. } => HostSlot::Split {
            hi: u16s(get(key, Dtype::BF16)?),
            rem: u16s(get(&format!("{key}.rem"), Dtype::U16)?),
        },
        HostSlot::Quantized { .. } => HostSlot::Quantized {
            codes: get(key, Dtype::U8)?,
            absmax: f32s(get(&format!("{key}.absmax"), Dtype::F32)?),
        },
        HostSlot::Factored { .. } => HostSlot::Factored {
            row: f32s(get(&format!("{key}.row"), Dtype::F32)?),
            col: f32s(get(&format!("{key}.col"), Dtype::F32)?),
        },
        HostSlot::Rank1 { .. } => HostSlot::Rank1 {
            codes: get(key, Dtype::U8)?,
            scales: f32s(get(&format!("{key}.scales"), Dtype::F32)?),
        },
    })
}

/// One parameter in the canonical layout: the whole tensor, unsharded, every slot as
/// [`HostSlot`], with the counters that position its random streams.
#[derive(Debug, Clone, PartialEq)]
pub struct CanonicalParam {
    /// Name.
    pub name: String,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// Parameter group.
    pub group: usize,
    /// The configuration asked for (resolved again on `shape` when loaded).
    pub requested: ParamConfig,
    /// Steps taken.
    pub steps: u64,
    /// `accumulate` calls so far.
    pub accumulations: u64,
    /// Whether the accumulator holds gradients not yet consumed.
    pub pending: bool,
    /// How its learning rate follows its group's.
    pub lr_rule: crate::backend::LrRule,
    /// Param, grad, state1, state2.
    pub slots: [HostSlot; 4],
}

/// A whole checkpoint in the canonical layout: what [`Optimizer::save`] writes and
/// [`Optimizer::load`] reads, also assembled from (and cut into) shards by lpmm-dist.
#[derive(Debug, Clone, PartialEq)]
pub struct Canonical {
    /// The optimizer's options.
    pub options: OptimizerOptions,
    /// Steps taken by `step()`.
    pub global_steps: u64,
    /// Parameter groups.
    pub groups: Vec<ParamConfig>,
    /// Parameters, in registration order.
    pub params: Vec<CanonicalParam>,
}

/// The host layout a slot of `storage` exports as (an empty instance of it).
fn template(storage: Storage, used: bool) -> HostSlot {
    if !used {
        return HostSlot::Empty;
    }
    match storage {
        Storage::None => HostSlot::Empty,
        Storage::F32 => HostSlot::F32(Vec::new()),
        Storage::Bf16(_) => HostSlot::Bf16(Vec::new()),
        Storage::Bf16Kahan => HostSlot::Kahan {
            value: Vec::new(),
            comp: Vec::new(),
        },
        Storage::SplitF32 => HostSlot::Split {
            hi: Vec::new(),
            rem: Vec::new(),
        },
        Storage::Quantized { .. } => HostSlot::Quantized {
            codes: Vec::new(),
            absmax: Vec::new(),
        },
        Storage::Factorized => HostSlot::Factored {
            row: Vec::new(),
            col: Vec::new(),
        },
        Storage::Rank1 { .. } => HostSlot::Rank1 {
            codes: Vec::new(),
            scales: Vec::new(),
        },
    }
}

impl Canonical {
    /// Writes the safetensors checkpoint atomically (a temporary file, synced, renamed).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), OptimError> {
        let path = path.as_ref();
        let meta = CheckpointMeta {
            format: FORMAT.into(),
            version: VERSION,
            options: self.options,
            global_steps: self.global_steps,
            groups: self.groups.clone(),
            params: self
                .params
                .iter()
                .map(|m| ParamMeta {
                    name: m.name.clone(),
                    shape: m.shape.clone(),
                    group: m.group,
                    requested: m.requested,
                    steps: m.steps,
                    accumulations: m.accumulations,
                    pending: m.pending,
                    lr_rule: m.lr_rule,
                })
                .collect(),
        };
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut maps: Vec<MapKind> = Vec::new();
        for m in &self.params {
            for (slot, host) in SlotKind::ALL.iter().zip(&m.slots) {
                for (suffix, dtype, n, bytes) in host_tensors(host) {
                    tensors.push((
                        format!("{}/{}{suffix}", m.name, slot.name()),
                        dtype,
                        vec![n],
                        bytes,
                    ));
                }
            }
            let numel = m.shape.iter().product();
            let c = m.requested.resolve(numel, &m.shape);
            for storage in [c.param, c.grad, c.state1, c.state2] {
                if let Storage::Quantized { map, .. } | Storage::Rank1 { map, .. } = storage
                    && !maps.contains(&map)
                {
                    maps.push(map);
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

    /// Reads and validates a checkpoint (format, version, sizes against the file, counters,
    /// code maps, every slot's tensors present with the dtype its storage needs).
    pub fn read(path: impl AsRef<Path>) -> Result<Self, OptimError> {
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
        // Every storage takes at least 4 bits per element: a checkpoint cannot hold more than
        // 2 elements per byte, in all parameters together. Checked before allocating anything,
        // so a forged header cannot make us allocate for it.
        let mut total = 0usize;
        for p in &meta.params {
            let numel = p.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            total = match numel.and_then(|n| total.checked_add(n)) {
                Some(t) if t <= 2 * bytes.len() => t,
                _ => {
                    return Err(err(
                        path,
                        format!(
                            "parameter {} has shape {:?}: more elements than the file can hold",
                            p.name, p.shape
                        ),
                    ));
                }
            };
            // Counters beyond 2^53 are not exact in the f64 bias corrections (and would overflow).
            if p.steps > 1 << 53 || p.accumulations > 1 << 53 {
                return Err(err(
                    path,
                    format!(
                        "parameter {}: step or accumulation counter out of range",
                        p.name
                    ),
                ));
            }
        }
        if meta.global_steps > 1 << 53 {
            return Err(err(path, "step counter out of range"));
        }
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
        let mut params = Vec::with_capacity(meta.params.len());
        for p in meta.params {
            let numel: usize = p.shape.iter().product();
            p.requested.validate()?;
            let c = p.requested.resolve(numel, &p.shape);
            let states = c.hyper.states();
            let used = [true, true, states >= 1, states >= 2];
            let storages = [c.param, c.grad, c.state1, c.state2];
            let mut slots = Vec::with_capacity(4);
            for (k, slot) in SlotKind::ALL.into_iter().enumerate() {
                let key = format!("{}/{}", p.name, slot.name());
                slots.push(
                    read_host(&st, &key, &template(storages[k], used[k]))
                        .map_err(|reason| err(path, reason))?,
                );
            }
            let slots: [HostSlot; 4] = slots.try_into().expect("four slots");
            params.push(CanonicalParam {
                name: p.name,
                shape: p.shape,
                group: p.group,
                requested: p.requested,
                steps: p.steps,
                accumulations: p.accumulations,
                pending: p.pending,
                lr_rule: p.lr_rule,
                slots,
            });
        }
        Ok(Canonical {
            options: meta.options,
            global_steps: meta.global_steps,
            groups: meta.groups,
            params,
        })
    }
}

impl Optimizer<Cpu> {
    /// Reads a checkpoint written by [`Optimizer::save`] (on any backend) into a new optimizer on
    /// the CPU backend.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, OptimError> {
        Self::load_with(Cpu, path)
    }
}

impl<B: Backend> Optimizer<B> {
    /// Writes the complete state to `path` atomically: a temporary file in the same directory,
    /// flushed to disk, then renamed over `path`. A crash leaves the old file or the new one,
    /// never a partial one.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), OptimError> {
        self.canonical().write(path)
    }

    /// The whole optimizer in the canonical layout (what [`Optimizer::save`] writes).
    pub fn canonical(&self) -> Canonical {
        Canonical {
            options: self.options,
            global_steps: self.global_steps,
            groups: self.groups.clone(),
            params: self
                .metas
                .iter()
                .zip(&self.params)
                .map(|(m, p)| CanonicalParam {
                    name: m.name.clone(),
                    shape: m.shape.clone(),
                    group: m.group,
                    requested: m.requested,
                    steps: m.steps,
                    accumulations: m.accumulations,
                    pending: m.pending,
                    lr_rule: m.lr_rule,
                    slots: SlotKind::ALL.map(|slot| self.backend.export(p, m, slot)),
                })
                .collect(),
        }
    }

    /// Reads a checkpoint written by [`Optimizer::save`] (on any backend) into a new optimizer on
    /// `backend`.
    pub fn load_with(backend: B, path: impl AsRef<Path>) -> Result<Self, OptimError> {
        let path = path.as_ref();
        let canonical = Canonical::read(path)?;
        // Rebuild the structure, then overwrite every slot with the stored bytes.
        let mut opt = Optimizer::with_backend(backend, canonical.options)?;
        for g in &canonical.groups {
            opt.add_group(*g)?;
        }
        for p in &canonical.params {
            let numel = p.shape.iter().product();
            let zeros = vec![0f32; numel];
            opt.add_param_with(&p.name, &p.shape, &zeros, p.group, p.requested)?;
        }
        opt.global_steps = canonical.global_steps;
        for (i, p) in canonical.params.into_iter().enumerate() {
            let id = crate::optimizer::ParamId(i);
            opt.restore(id, p.steps, p.accumulations, p.pending, p.lr_rule)?;
            for (slot, host) in SlotKind::ALL.into_iter().zip(p.slots) {
                opt.import_slot(id, slot, host).map_err(|e| err(path, e))?;
            }
        }
        Ok(opt)
    }

    /// Replaces this optimizer's state with the checkpoint at `path`, which must hold the same
    /// parameters (names, shapes, order). On any error nothing changes.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<(), OptimError> {
        let path = path.as_ref();
        let loaded = Optimizer::load_with(self.backend.clone(), path)?;
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

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), OptimError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .ok_or_else(|| err(path, "not a file path"))?;
    // Unique per process and per call, created exclusively: concurrent saves never share it.
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{n}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
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
