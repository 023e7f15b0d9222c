//! Checkpoints: the complete optimizer state (every slot's bytes, scales and code maps, step and
//! accumulation counters that position the random streams, the configuration) as one safetensors
//! file with versioned metadata and a checksum, written atomically. Loading builds a new optimizer
//! and validates everything before anything live changes.
//!
//! Layout (version 1): per parameter `p` and slot `s` in {param, grad, state1, state2}, one
//! tensor `p/s<suffix>` per saved region of the slot's format (`crate::backend::RegionSpec`: the
//! primary region's suffix is empty; `.comp` Kahan compensations, `.rem` split-f32 remainders,
//! `.absmax` block scales, `.scales` rank-1 maxima, `.row`/`.col` factorized statistics), the
//! whole tensor, unsharded, in the region's dtype, 1-D; and `maps/<map name>` (F32) for every code
//! map in use. Metadata key `lpmm` holds the JSON of `CheckpointMeta`, whose `crc32` is the
//! CRC-32 of that JSON without the field followed by every tensor (name, dtype, shape, bytes) in
//! name order; a file without it is refused, and so is one whose metadata has a key this build
//! does not know. A file holds exactly these tensors.
//!
//! No name can collide with another: a parameter's tensors are `<name>/<slot><suffix>`, and
//! neither slot names nor suffixes contain `/`, so the text after the last `/` tells the slot and
//! the text before it the parameter; a code map's tensor `maps/<map>` would need a slot named
//! after a map. The loader looks every tensor up by the exact name the configuration gives it.
//!
//! The rule: whatever `save` accepts, `load` loads. Both run the same validation
//! ([`Canonical::check`]) — `save` before writing anything (a typed error, the old file kept),
//! `load` before allocating anything — and a successful load gives an optimizer whose `save`
//! writes the same tensors and hyperparameters bit for bit.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, Format, HostRegion, HostSlot, ParamId, RuleState, SLOTS, SlotKind};
use crate::config::ParamConfig;
use crate::cpu::Cpu;
use crate::error::OptimError;
use crate::format::MapKind;
use crate::optimizer::{Lender, LrRule, MAX_COUNTER, Optimizer, OptimizerOptions};

/// The checkpoint format's name and version, checked on load.
pub const FORMAT: &str = "lpmm-optim-checkpoint";
/// Bumped whenever the layout changes; older versions get a typed error naming both.
pub const VERSION: u32 = 1;

/// What the metadata holds besides the tensors. A key the loader does not know is refused, not
/// skipped: a file from a newer writer, or one whose key was corrupted, must not load as if the
/// key were absent (a renamed `crc32` would turn the checksum off).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckpointMeta {
    format: String,
    version: u32,
    options: OptimizerOptions,
    global_steps: u64,
    groups: Vec<ParamConfig>,
    params: Vec<ParamMeta>,
    /// Whether the parameters hold their evaluation point ([`Optimizer::eval`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    eval: bool,
    /// The checksum (module documentation). Every file carries one; `None` only while it is
    /// computed (the JSON it covers is the metadata without it), and a file without it is
    /// refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ParamMeta {
    name: String,
    shape: Vec<usize>,
    group: usize,
    requested: ParamConfig,
    steps: u64,
    accumulations: u64,
    pending: bool,
    #[serde(default)]
    lr_rule: LrRule,
    #[serde(default, skip_serializing_if = "is_default")]
    rule_state: RuleState,
}

fn is_default(s: &RuleState) -> bool {
    *s == RuleState::default()
}

/// What [`Optimizer::load_state_with`] may change besides the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadPolicy {
    /// The checkpoint must hold this optimizer's configuration: the options (seed, clipping,
    /// non-finite policy), the groups, and for every parameter its group, configuration
    /// (storages and hyperparameters, the learning rate included) and learning-rate rule. A
    /// difference is an [`OptimError::Checkpoint`] naming it, and nothing changes. The default:
    /// resuming never silently changes a run's configuration.
    #[default]
    SameConfiguration,
    /// The checkpoint's configuration replaces this optimizer's (e.g. a learning rate that a
    /// schedule had changed when it was saved). Names, shapes and order must still match.
    ReplaceConfiguration,
}

fn err(path: &Path, reason: impl std::fmt::Display) -> OptimError {
    OptimError::Checkpoint {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// Every error of a load is about the file ([`OptimError::Checkpoint`]), except the backend's own
/// (a device lost or out of memory), which is passed on.
fn file_err(path: &Path, e: OptimError) -> OptimError {
    match e {
        OptimError::Checkpoint { .. } | OptimError::Backend(_) => e,
        other => err(path, other),
    }
}

fn st_dtype(d: crate::backend::Dtype) -> Dtype {
    use crate::backend::Dtype as D;
    match d {
        D::F32 => Dtype::F32,
        D::Bf16 => Dtype::BF16,
        D::U16 => Dtype::U16,
        D::U8 => Dtype::U8,
        D::U32 => Dtype::U32,
    }
}

/// The element count of a valid shape (no zero dimension, no overflow, at most `usize::MAX / 8`).
fn numel(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n > 0 && n <= usize::MAX / 8)
}

/// The format of each slot of a parameter with this requested configuration and shape (`None`
/// where the slot is not allocated).
fn slot_formats(requested: &ParamConfig, shape: &[usize], numel: usize) -> [Option<Format>; SLOTS] {
    requested.resolve(numel, shape).formats()
}

fn map_tensor(map: MapKind) -> Vec<u8> {
    map.shared()
        .values()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// The CRC-32 of the metadata JSON (without its checksum) and of every tensor, in name order.
fn checksum<'a>(
    json: &str,
    tensors: impl Iterator<Item = (&'a str, Dtype, &'a [usize], &'a [u8])>,
) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let word = |h: &mut crc32fast::Hasher, x: usize| h.update(&(x as u64).to_le_bytes());
    word(&mut h, json.len());
    h.update(json.as_bytes());
    for (name, dtype, shape, bytes) in tensors {
        word(&mut h, name.len());
        h.update(name.as_bytes());
        let dtype = format!("{dtype:?}");
        word(&mut h, dtype.len());
        h.update(dtype.as_bytes());
        word(&mut h, shape.len());
        for &d in shape {
            word(&mut h, d);
        }
        word(&mut h, bytes.len());
        h.update(bytes);
    }
    h.finalize()
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
    pub lr_rule: LrRule,
    /// The rule's host state ([`RuleState`]: schedule-free AdamW's averaging weights).
    pub rule_state: RuleState,
    /// Param, grad, state1, state2, state3.
    pub slots: [HostSlot; SLOTS],
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
    /// Whether the parameters hold their evaluation point ([`Optimizer::eval`]).
    pub eval: bool,
}

impl Canonical {
    /// Everything a checkpoint must satisfy to load, checked without allocating model memory:
    /// the options, every group's configuration, unique names, valid shapes and groups, counters
    /// at most [`MAX_COUNTER`], learning-rate rules, a pending gradient only with an
    /// accumulator, and every slot's contents against its format (layout, lengths, finite scales;
    /// values finite and within the format's range, except the gradient accumulator's, which
    /// the step's non-finite policy handles). `save` refuses what fails it, so every file `save`
    /// writes loads.
    pub fn check(&self) -> Result<(), String> {
        if let Some(n) = self.options.max_grad_norm
            && !(n.is_finite() && n > 0.0)
        {
            return Err(format!("max_grad_norm {n} is not finite and positive"));
        }
        if self.global_steps > MAX_COUNTER {
            return Err("the step counter is beyond 2^53".into());
        }
        for (k, g) in self.groups.iter().enumerate() {
            g.validate().map_err(|e| format!("group {k}: {e}"))?;
        }
        let mut names = HashSet::with_capacity(self.params.len());
        for p in &self.params {
            let name = &p.name;
            if !names.insert(name.as_str()) {
                return Err(format!("two parameters are named {name:?}"));
            }
            if p.group >= self.groups.len() {
                return Err(format!(
                    "parameter {name}: group {} does not exist",
                    p.group
                ));
            }
            let n = numel(&p.shape)
                .ok_or_else(|| format!("parameter {name}: shape {:?} is invalid", p.shape))?;
            p.requested
                .validate()
                .map_err(|e| format!("parameter {name}: {e}"))?;
            if p.steps > MAX_COUNTER || p.accumulations > MAX_COUNTER {
                return Err(format!(
                    "parameter {name}: step or accumulation counter beyond 2^53"
                ));
            }
            if let LrRule::Scaled(k) = p.lr_rule
                && !(k.is_finite() && k > 0.0)
            {
                return Err(format!("parameter {name}: learning-rate scale {k}"));
            }
            if !p.rule_state.valid() {
                return Err(format!(
                    "parameter {name}: rule state {:?} is not finite and non-negative",
                    p.rule_state.0
                ));
            }
            let formats = slot_formats(&p.requested, &p.shape, n);
            if p.pending && formats[1].is_none() {
                return Err(format!(
                    "parameter {name}: a pending gradient without an accumulator"
                ));
            }
            for ((slot, format), host) in SlotKind::ALL.into_iter().zip(formats).zip(&p.slots) {
                let what = |r: String| format!("{name}/{}: {r}", slot.name());
                match format {
                    Some(f) => f
                        .validate(host, &p.shape, n, slot != SlotKind::Grad)
                        .map_err(what)?,
                    None if host.is_empty() => {}
                    None => return Err(what("the configuration has no such slot".into())),
                }
            }
        }
        Ok(())
    }

    /// The safetensors file, after [`Canonical::check`] (its error names what fails).
    pub fn to_bytes(&self) -> Result<Vec<u8>, String> {
        self.check()?;
        let mut tensors: Vec<(String, Dtype, Vec<usize>, &[u8])> = Vec::new();
        let mut maps: Vec<(MapKind, Vec<u8>)> = Vec::new();
        for m in &self.params {
            for (slot, host) in SlotKind::ALL.iter().zip(&m.slots) {
                for r in &host.regions {
                    tensors.push((
                        format!("{}/{}{}", m.name, slot.name(), r.spec.suffix),
                        st_dtype(r.spec.dtype),
                        vec![r.bytes.len() / r.spec.dtype.size()],
                        &r.bytes,
                    ));
                }
            }
            let n = numel(&m.shape).unwrap_or(0);
            for f in slot_formats(&m.requested, &m.shape, n).iter().flatten() {
                if let Some(map) = f.map()
                    && !maps.iter().any(|(k, _)| *k == map)
                {
                    maps.push((map, map_tensor(map)));
                }
            }
        }
        for (map, bytes) in &maps {
            tensors.push((
                format!("maps/{}", map.name()),
                Dtype::F32,
                vec![bytes.len() / 4],
                bytes,
            ));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let mut meta = CheckpointMeta {
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
                    rule_state: m.rule_state,
                })
                .collect(),
            eval: self.eval,
            crc32: None,
        };
        let json = serde_json::to_string(&meta).map_err(|e| e.to_string())?;
        meta.crc32 = Some(checksum(
            &json,
            tensors
                .iter()
                .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), *b)),
        ));
        let json = serde_json::to_string(&meta).map_err(|e| e.to_string())?;
        let views = tensors
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map(|v| (name.as_str(), v))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let info = HashMap::from([("lpmm".to_string(), json)]);
        safetensors::tensor::serialize(views, Some(info)).map_err(|e| e.to_string())
    }

    /// Parses and validates a checkpoint file's bytes: format, version, checksum, the tensors
    /// (exactly those the configuration names, each with its dtype, shape and length, the code
    /// maps equal to this build's) and [`Canonical::check`]. Sizes are checked against the file
    /// before anything is copied, so a load costs time and memory linear in the file.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let (header_len, header) = SafeTensors::read_metadata(bytes)
            .map_err(|e| format!("not a readable safetensors file: {e}"))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("lpmm"))
            .ok_or("no lpmm metadata: not an lpmm checkpoint")?;
        let mut meta: CheckpointMeta =
            serde_json::from_str(json).map_err(|e| format!("metadata: {e}"))?;
        if meta.format != FORMAT {
            return Err(format!("format {:?}, expected {FORMAT:?}", meta.format));
        }
        if meta.version != VERSION {
            return Err(format!(
                "version {}, this lpmm reads version {VERSION}",
                meta.version
            ));
        }
        let data = &bytes[8 + header_len..];
        let tensor = |name: &str| {
            header.info(name).map(|info| {
                let (a, b) = info.data_offsets;
                (info.dtype, info.shape.as_slice(), &data[a..b])
            })
        };
        let mut names = header.offset_keys();
        {
            let want = meta.crc32.take().ok_or(
                "no checksum in the metadata (every lpmm checkpoint has one): the file is corrupt",
            )?;
            names.sort_unstable();
            let json = serde_json::to_string(&meta).map_err(|e| format!("metadata: {e}"))?;
            let got = checksum(
                &json,
                names.iter().filter_map(|n| {
                    let (d, s, b) = tensor(n)?;
                    Some((n.as_str(), d, s, b))
                }),
            );
            if got != want {
                return Err(format!(
                    "checksum mismatch (the file says {want:#010x}, its contents give {got:#010x}): the file is corrupt"
                ));
            }
        }
        // Every storage takes at least 4 bits per element: a checkpoint cannot hold more than
        // 2 elements per byte, in all parameters together. Checked before anything else, so a
        // forged header cannot make us allocate for it.
        let mut total = 0usize;
        for p in &meta.params {
            total = match numel(&p.shape).and_then(|n| total.checked_add(n)) {
                Some(t) if t <= 2 * bytes.len() => t,
                _ => {
                    return Err(format!(
                        "parameter {} has shape {:?}: empty, or more elements than the file can hold",
                        p.name, p.shape
                    ));
                }
            };
        }
        // Exactly the tensors the configuration names, each with its dtype and length, checked
        // before anything is copied.
        let mut expected = 0usize;
        let mut maps: Vec<MapKind> = Vec::new();
        let mut formats = Vec::with_capacity(meta.params.len());
        for p in &meta.params {
            p.requested
                .validate()
                .map_err(|e| format!("parameter {}: {e}", p.name))?;
            let n = numel(&p.shape).unwrap_or(0);
            let slots = slot_formats(&p.requested, &p.shape, n);
            for (slot, format) in SlotKind::ALL.into_iter().zip(slots) {
                let Some(format) = format else { continue };
                if let Some(map) = format.map()
                    && !maps.contains(&map)
                {
                    maps.push(map);
                }
                for spec in format.regions(&p.shape).into_iter().filter(|r| r.saved) {
                    let key = format!("{}/{}{}", p.name, slot.name(), spec.suffix);
                    let (dtype, shape, data) =
                        tensor(&key).ok_or_else(|| format!("tensor {key} missing"))?;
                    let want = st_dtype(spec.dtype);
                    if dtype != want {
                        return Err(format!("tensor {key} is {dtype:?}, expected {want:?}"));
                    }
                    let len = spec.len(n);
                    if shape != [len] || data.len() != spec.bytes(n) {
                        return Err(format!(
                            "tensor {key} has shape {shape:?}, expected [{len}]"
                        ));
                    }
                    expected += 1;
                }
            }
            formats.push(slots);
        }
        for &map in &maps {
            let key = format!("maps/{}", map.name());
            let (dtype, shape, data) =
                tensor(&key).ok_or_else(|| format!("code map {} missing", map.name()))?;
            let want = map_tensor(map);
            if dtype != Dtype::F32 || shape != [want.len() / 4] || data != want.as_slice() {
                return Err(format!("code map {} differs from this build's", map.name()));
            }
            expected += 1;
        }
        if names.len() != expected {
            return Err(format!(
                "{} tensors, of which {expected} belong to the configuration: unexpected tensors",
                names.len()
            ));
        }
        drop(names);
        let mut params = Vec::with_capacity(meta.params.len());
        for (p, slots) in meta.params.into_iter().zip(formats) {
            let mut hosts: [HostSlot; SLOTS] = Default::default();
            for ((slot, format), host) in SlotKind::ALL.into_iter().zip(slots).zip(&mut hosts) {
                let Some(format) = format else { continue };
                let specs: Vec<_> = format
                    .regions(&p.shape)
                    .into_iter()
                    .filter(|r| r.saved)
                    .collect();
                host.regions.reserve_exact(specs.len());
                for spec in specs {
                    let key = format!("{}/{}{}", p.name, slot.name(), spec.suffix);
                    let (_, _, data) =
                        tensor(&key).ok_or_else(|| format!("tensor {key} missing"))?;
                    host.regions.push(HostRegion {
                        spec,
                        bytes: data.to_vec(),
                    });
                }
            }
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
                slots: hosts,
            });
        }
        let c = Canonical {
            options: meta.options,
            global_steps: meta.global_steps,
            groups: meta.groups,
            params,
            eval: meta.eval,
        };
        c.check()?;
        Ok(c)
    }

    /// Writes the safetensors checkpoint atomically (a temporary file, synced, renamed) after
    /// [`Canonical::check`]; a refused state leaves the old file as it was. Stale temporary files
    /// of `path` (a save killed midway) are removed first.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), OptimError> {
        let path = path.as_ref();
        let bytes = self
            .to_bytes()
            .map_err(|e| err(path, format!("not saved: {e}")))?;
        write_atomically(path, &bytes)
    }

    /// Reads and validates a checkpoint ([`Canonical::from_bytes`]); every error is an
    /// [`OptimError::Checkpoint`]. Stale temporary files of `path` are removed first.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, OptimError> {
        let path = path.as_ref();
        temp::clean_stale(path);
        let bytes = std::fs::read(path).map_err(|e| err(path, e))?;
        Self::from_bytes(&bytes).map_err(|e| err(path, e))
    }

    /// The first difference between this checkpoint's configuration and `opt`'s (see
    /// [`LoadPolicy::SameConfiguration`]), if any.
    fn configuration_difference<B: Backend>(&self, opt: &Optimizer<B>) -> Option<String> {
        if self.options != opt.options {
            return Some(format!(
                "its options {:?} differ from this optimizer's {:?}",
                self.options, opt.options
            ));
        }
        if self.groups != opt.groups {
            return Some("its parameter groups differ from this optimizer's".into());
        }
        for (p, m) in self.params.iter().zip(&opt.states) {
            if p.group != m.group || p.requested != m.requested || p.lr_rule != m.lr_rule {
                return Some(format!(
                    "parameter {}: its group, configuration or learning-rate rule differs from this optimizer's",
                    p.name
                ));
            }
        }
        None
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
    /// never a partial one; the temporary files a crash leaves behind are removed by the next
    /// save or load of `path`. A state that would not load is refused with a typed error
    /// ([`Canonical::check`]) and nothing is written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), OptimError> {
        self.canonical()?.write(path)
    }

    /// [`Optimizer::save`] with the buffers of lent parameters (their values are saved too, so
    /// the file loads anywhere).
    pub fn save_lent(
        &self,
        path: impl AsRef<Path>,
        lender: &mut dyn Lender<B>,
    ) -> Result<(), OptimError> {
        self.canonical_lent(Some(lender))?.write(path)
    }

    /// The whole optimizer in the canonical layout (what [`Optimizer::save`] writes).
    pub fn canonical(&self) -> Result<Canonical, OptimError> {
        self.canonical_lent(None)
    }

    /// [`Optimizer::canonical`] with the buffers of lent parameters.
    pub fn canonical_lent(
        &self,
        mut lender: Option<&mut dyn Lender<B>>,
    ) -> Result<Canonical, OptimError> {
        let mut params = Vec::with_capacity(self.len());
        for (i, m) in self.states.iter().enumerate() {
            let (layout, p) = (&self.layouts[i], &self.params[i]);
            let mut slots: [HostSlot; SLOTS] = Default::default();
            for (slot, out) in SlotKind::ALL.into_iter().zip(slots.iter_mut()) {
                *out = match (&mut lender, slot == SlotKind::Param && layout.lent) {
                    (Some(lender), true) => {
                        let mut got = None;
                        lender.lend(ParamId(i), &mut |buf| {
                            got = Some(self.backend.export(p, layout, slot, Some(buf))?);
                            Ok(())
                        })?;
                        got.unwrap_or_default()
                    }
                    _ => self.backend.export(p, layout, slot, None)?,
                };
            }
            params.push(CanonicalParam {
                name: m.name.clone(),
                shape: layout.shape.clone(),
                group: m.group,
                requested: m.requested,
                steps: m.steps,
                accumulations: m.accumulations,
                pending: m.pending,
                lr_rule: m.lr_rule,
                rule_state: m.rule_state,
                slots,
            });
        }
        Ok(Canonical {
            options: self.options,
            global_steps: self.global_steps,
            groups: self.groups.clone(),
            params,
            eval: self.eval,
        })
    }

    /// Reads a checkpoint written by [`Optimizer::save`] (on any backend) into a new optimizer on
    /// `backend`. Every error about the file is an [`OptimError::Checkpoint`].
    pub fn load_with(backend: B, path: impl AsRef<Path>) -> Result<Self, OptimError> {
        let path = path.as_ref();
        let canonical = Canonical::read(path)?;
        Self::build(backend, canonical).map_err(|e| file_err(path, e))
    }

    /// A new optimizer on `backend` holding `canonical` (after [`Canonical::check`]): what
    /// [`Optimizer::load_with`] builds from a file. Its [`Optimizer::canonical`] equals
    /// `canonical`.
    pub fn from_canonical(backend: B, canonical: Canonical) -> Result<Self, OptimError> {
        let path = Path::new("(canonical)");
        canonical.check().map_err(|e| err(path, e))?;
        Self::build(backend, canonical).map_err(|e| file_err(path, e))
    }

    /// Builds from a checked canonical state, one parameter at a time (its slots allocated fresh,
    /// then imported and their host copies dropped), so a load holds little more than the file.
    fn build(backend: B, canonical: Canonical) -> Result<Self, OptimError> {
        let mut opt = Optimizer::with_backend(backend, canonical.options)?;
        for g in &canonical.groups {
            opt.add_group(*g)?;
        }
        opt.set_steps(canonical.global_steps)?;
        opt.eval = canonical.eval;
        for p in canonical.params {
            let id = opt.add_param_fresh(&p.name, &p.shape, p.group, p.requested)?;
            opt.restore(id, p.steps, p.accumulations, p.pending, p.lr_rule)?;
            opt.restore_rule_state(id, p.rule_state)?;
            for (slot, host) in SlotKind::ALL.into_iter().zip(p.slots) {
                opt.import_slot(id, slot, host)?;
            }
        }
        Ok(opt)
    }

    /// Replaces this optimizer's state with the checkpoint at `path`, which must hold the same
    /// parameters (names, shapes, order) and the same configuration
    /// ([`LoadPolicy::SameConfiguration`]; [`Optimizer::load_state_with`] chooses). On any error
    /// nothing changes.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<(), OptimError> {
        self.load_state_with(path, LoadPolicy::default())
    }

    /// [`Optimizer::load_state`] with an explicit [`LoadPolicy`].
    pub fn load_state_with(
        &mut self,
        path: impl AsRef<Path>,
        policy: LoadPolicy,
    ) -> Result<(), OptimError> {
        let path = path.as_ref();
        let c = Canonical::read(path)?;
        self.check_same_parameters(path, &c, policy)?;
        if self.layouts.iter().any(|l| l.lent) {
            return Err(err(
                path,
                "this optimizer holds lent parameters: use load_state_lent",
            ));
        }
        let mut loaded = Self::build(self.backend.clone(), c).map_err(|e| file_err(path, e))?;
        loaded.keep_settings(self);
        *self = loaded;
        Ok(())
    }

    /// The checkpoint holds this optimizer's parameters (names, shapes, order) and, under
    /// [`LoadPolicy::SameConfiguration`], its configuration.
    fn check_same_parameters(
        &self,
        path: &Path,
        c: &Canonical,
        policy: LoadPolicy,
    ) -> Result<(), OptimError> {
        let same = c.params.len() == self.len()
            && c.params
                .iter()
                .zip(&self.states)
                .zip(&self.layouts)
                .all(|((p, m), l)| p.name == m.name && p.shape == l.shape);
        if !same {
            return Err(err(
                path,
                "the checkpoint holds other parameters (names or shapes differ)",
            ));
        }
        if policy == LoadPolicy::SameConfiguration
            && let Some(d) = c.configuration_difference(self)
        {
            return Err(err(
                path,
                format!(
                    "{d}; load with LoadPolicy::ReplaceConfiguration to take the checkpoint's configuration"
                ),
            ));
        }
        Ok(())
    }

    /// [`Optimizer::load_state`] into an optimizer with lent parameters, whose saved values go
    /// into their buffers. The checkpoint must hold the same parameters with the same storages;
    /// every slot is checked before anything changes.
    pub fn load_state_lent(
        &mut self,
        path: impl AsRef<Path>,
        lender: &mut dyn Lender<B>,
    ) -> Result<(), OptimError> {
        self.load_state_lent_with(path, lender, LoadPolicy::default())
    }

    /// [`Optimizer::load_state_lent`] with an explicit [`LoadPolicy`].
    pub fn load_state_lent_with(
        &mut self,
        path: impl AsRef<Path>,
        lender: &mut dyn Lender<B>,
        policy: LoadPolicy,
    ) -> Result<(), OptimError> {
        let path = path.as_ref();
        let c = Canonical::read(path)?;
        self.check_same_parameters(path, &c, policy)?;
        for (i, p) in c.params.iter().enumerate() {
            let (m, layout) = (&self.states[i], &self.layouts[i]);
            let resolved = p.requested.resolve(layout.numel, &p.shape);
            if resolved.slots() != m.config.slots() {
                return Err(err(path, format!("parameter {} differs (storage)", m.name)));
            }
        }
        self.options = c.options;
        self.global_steps = c.global_steps;
        self.groups = c.groups;
        self.eval = c.eval;
        for (i, p) in c.params.into_iter().enumerate() {
            let id = ParamId(i);
            self.restore(id, p.steps, p.accumulations, p.pending, p.lr_rule)?;
            self.restore_rule_state(id, p.rule_state)?;
            self.states[i].group = p.group;
            self.states[i].requested = p.requested;
            self.states[i].config = p.requested.resolve(self.layouts[i].numel, &p.shape);
            for (slot, host) in SlotKind::ALL.into_iter().zip(&p.slots) {
                if slot == SlotKind::Param && self.layouts[i].lent {
                    let (backend, layout, param) =
                        (&self.backend, &self.layouts[i], &mut self.params[i]);
                    lender.lend_mut(id, &mut |buf| {
                        Ok(backend.import(param, layout, slot, host, Some(buf))?)
                    })?;
                } else {
                    self.import_slot_lent(id, slot, host, None)?;
                }
            }
        }
        Ok(())
    }
}

/// Recomputes a checkpoint file's checksum as the writer would (for tests and fuzzing: a forged
/// or mutated file then reaches the checks behind the checksum). `None` if the file's header or
/// metadata does not parse.
#[cfg(feature = "testing")]
pub(crate) fn reseal(bytes: &[u8]) -> Option<Vec<u8>> {
    let (header_len, header) = SafeTensors::read_metadata(bytes).ok()?;
    let mut meta: CheckpointMeta =
        serde_json::from_str(header.metadata().as_ref()?.get("lpmm")?).ok()?;
    meta.crc32 = None;
    let data = &bytes[8 + header_len..];
    let mut names = header.offset_keys();
    names.sort_unstable();
    let tensors: Vec<(&str, Dtype, &[usize], &[u8])> = names
        .iter()
        .filter_map(|n| {
            let info = header.info(n)?;
            let (a, b) = info.data_offsets;
            Some((n.as_str(), info.dtype, info.shape.as_slice(), &data[a..b]))
        })
        .collect();
    let json = serde_json::to_string(&meta).ok()?;
    meta.crc32 = Some(checksum(&json, tensors.iter().copied()));
    let json = serde_json::to_string(&meta).ok()?;
    let views = tensors
        .iter()
        .map(|&(n, d, s, b)| TensorView::new(d, s.to_vec(), b).map(|v| (n, v)))
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let info = HashMap::from([("lpmm".to_string(), json)]);
    safetensors::tensor::serialize(views, Some(info)).ok()
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), OptimError> {
    temp::write(path, bytes).map_err(|e| err(path, e))
}

/// Temporary files of atomic saves: named after the target (a prefix the next save or load of
/// the same target recognises), unique per process and call, created exclusively, and locked
/// (an advisory `flock`-style lock) for as long as their save runs. The kernel releases the lock
/// when the process dies, so a temporary file nobody holds a lock on is a leftover of a killed
/// save, and is removed.
mod temp {
    use std::fs::{self, File, OpenOptions};
    use std::io::Write;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// The longest file name (bytes) on the file systems lpmm targets.
    const NAME_MAX: usize = 255;
    /// Room for `<pid>-<counter>` (two u64s and a dash).
    const TAIL: usize = 41;

    /// FNV-1a, 64 bits: stable across builds, for the names of long targets' temporary files.
    fn fnv(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// `.<file name>.tmp-`, or for a name too long to leave room for the tail within
    /// `NAME_MAX`, `.<its start>~<hash>.tmp-`.
    pub(super) fn prefix(path: &Path) -> Option<(PathBuf, String)> {
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let name = path.file_name()?.to_string_lossy().into_owned();
        let plain = format!(".{name}.tmp-");
        if plain.len() + TAIL <= NAME_MAX {
            return Some((dir, plain));
        }
        let mut cut = NAME_MAX - TAIL - ".~0123456789abcdef.tmp-".len();
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        Some((
            dir,
            format!(".{}~{:016x}.tmp-", &name[..cut], fnv(name.as_bytes())),
        ))
    }

    /// Whether `rest` is `<digits>-<digits>`.
    fn is_tail(rest: &str) -> bool {
        let mut parts = rest.splitn(2, '-');
        let digits = |s: Option<&str>| {
            s.is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        };
        digits(parts.next()) && digits(parts.next())
    }

    /// Removes `path`'s temporary files that no running save holds (leftovers of killed saves).
    /// Best effort: a file that cannot be opened, locked or removed is left.
    pub(super) fn clean_stale(path: &Path) {
        let Some((dir, prefix)) = prefix(path) else {
            return;
        };
        let Ok(entries) = fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
                continue;
            };
            if !is_tail(rest) {
                continue;
            }
            let Ok(file) = File::open(entry.path()) else {
                continue;
            };
            if file.try_lock().is_ok() {
                let _ = fs::remove_file(entry.path());
            }
        }
    }

    /// Whether `file` is still the file at `path` (a cleaner may have removed the name between
    /// its creation and its lock).
    fn still_named(file: &File, path: &Path) -> bool {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            match (file.metadata(), fs::metadata(path)) {
                (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
                _ => false,
            }
        }
        #[cfg(not(unix))]
        {
            let _ = file;
            path.exists()
        }
    }

    /// Creates, locks and returns a fresh temporary file for `path`.
    fn create(dir: &Path, prefix: &str) -> std::io::Result<(File, PathBuf)> {
        static SAVES: AtomicU64 = AtomicU64::new(0);
        let mut last = None;
        for _ in 0..64 {
            let n = SAVES.fetch_add(1, Ordering::Relaxed);
            let tmp = dir.join(format!("{prefix}{}-{n}", std::process::id()));
            let file = match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    last = Some(e);
                    continue;
                }
                Err(e) => return Err(e),
            };
            // Where locks are unsupported the file is simply never cleaned by others.
            let locked = file.lock().is_ok();
            if locked && !still_named(&file, &tmp) {
                continue;
            }
            return Ok((file, tmp));
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no temporary file name is free")))
    }

    /// Writes `bytes` to `path` atomically: a temporary file in the same directory, written,
    /// synced, renamed over `path`, the directory synced. Stale temporary files of `path` are
    /// removed first.
    pub(super) fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let (dir, prefix) = prefix(path).ok_or_else(|| std::io::Error::other("not a file path"))?;
        clean_stale(path);
        let (mut file, tmp) = create(&dir, &prefix)?;
        let result = (|| {
            file.write_all(bytes)?;
            file.sync_all()?;
            fs::rename(&tmp, path)?;
            // Make the rename itself durable.
            if let Ok(d) = File::open(&dir) {
                let _ = d.sync_all();
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }
}
