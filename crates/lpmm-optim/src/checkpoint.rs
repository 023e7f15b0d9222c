//! Checkpoints: the complete optimizer state (every slot's bytes, scales and code maps, step and
//! accumulation counters that position the random streams, the configuration) as one safetensors
//! file with versioned metadata, written atomically. Loading builds a new optimizer and validates
//! everything before anything live changes.
//!
//! Layout (version 1): per parameter `p` and slot `s` in {param, grad, state1, state2}, one
//! tensor `p/s<suffix>` per saved region of the slot's format (`crate::backend::RegionSpec`: the
//! primary region's suffix is empty; `.comp` Kahan compensations, `.rem` split-f32 remainders,
//! `.absmax` block scales, `.scales` rank-1 maxima, `.row`/`.col` factorized statistics), the
//! whole tensor, unsharded, in the region's dtype; and `maps/<map name>` (F32) for every code map
//! in use. Metadata key `lpmm` holds the JSON of [`CheckpointMeta`].

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, Format, HostRegion, HostSlot, ParamId, SlotKind};
use crate::config::{MapKind, ParamConfig};
use crate::cpu::Cpu;
use crate::error::OptimError;
use crate::optimizer::{Lender, LrRule, Optimizer, OptimizerOptions};

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
    lr_rule: LrRule,
}

fn err(path: &Path, reason: impl std::fmt::Display) -> OptimError {
    OptimError::Checkpoint {
        path: path.display().to_string(),
        reason: reason.to_string(),
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

/// Reads the saved regions of slot `key` in the format `format` for a tensor of `shape`.
fn read_host(
    st: &SafeTensors<'_>,
    key: &str,
    format: Option<Format>,
    shape: &[usize],
) -> Result<HostSlot, String> {
    let Some(format) = format else {
        return Ok(HostSlot::empty());
    };
    let mut regions = Vec::new();
    for spec in format.regions(shape).into_iter().filter(|r| r.saved) {
        let k = format!("{key}{}", spec.suffix);
        let t = st.tensor(&k).map_err(|_| format!("tensor {k} missing"))?;
        let want = st_dtype(spec.dtype);
        if t.dtype() != want {
            return Err(format!("tensor {k} is {:?}, expected {want:?}", t.dtype()));
        }
        regions.push(HostRegion {
            spec,
            bytes: t.data().to_vec(),
        });
    }
    Ok(HostSlot { regions })
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
                for r in &host.regions {
                    tensors.push((
                        format!("{}/{}{}", m.name, slot.name(), r.spec.suffix),
                        st_dtype(r.spec.dtype),
                        vec![r.bytes.len() / r.spec.dtype.size()],
                        r.bytes.clone(),
                    ));
                }
            }
            let numel = m.shape.iter().product();
            let c = m.requested.resolve(numel, &m.shape);
            for map in c.slots().iter().filter_map(|s| s.format()?.map()) {
                if !maps.contains(&map) {
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
            let mut slots = Vec::with_capacity(4);
            for (k, slot) in SlotKind::ALL.into_iter().enumerate() {
                let key = format!("{}/{}", p.name, slot.name());
                let format = c.slots()[k].format().filter(|_| used[k]);
                slots.push(
                    read_host(&st, &key, format, &p.shape).map_err(|reason| err(path, reason))?,
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
            let mut slots: [HostSlot; 4] = Default::default();
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
                slots,
            });
        }
        Ok(Canonical {
            options: self.options,
            global_steps: self.global_steps,
            groups: self.groups.clone(),
            params,
        })
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
            let id = ParamId(i);
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
        let same = loaded.len() == self.len()
            && loaded
                .states
                .iter()
                .zip(&self.states)
                .zip(loaded.layouts.iter().zip(&self.layouts))
                .all(|((a, b), (la, lb))| a.name == b.name && la.shape == lb.shape);
        if !same {
            return Err(err(
                path,
                "the checkpoint holds other parameters (names or shapes differ)",
            ));
        }
        if self.layouts.iter().any(|l| l.lent) {
            return Err(err(
                path,
                "this optimizer holds lent parameters: use load_state_lent",
            ));
        }
        *self = loaded;
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
        let path = path.as_ref();
        let c = Canonical::read(path)?;
        if c.params.len() != self.len() {
            return Err(err(path, "the checkpoint holds other parameters"));
        }
        for (i, p) in c.params.iter().enumerate() {
            let (m, layout) = (&self.states[i], &self.layouts[i]);
            let numel = layout.numel;
            let resolved = p.requested.resolve(numel, &p.shape);
            if p.name != m.name || p.shape != layout.shape || resolved.slots() != m.config.slots() {
                return Err(err(
                    path,
                    format!("parameter {} differs (name, shape or storage)", m.name),
                ));
            }
            for (slot, host) in SlotKind::ALL.into_iter().zip(&p.slots) {
                match layout.format(slot) {
                    Some(f) => f
                        .validate(host, &layout.shape, numel, slot != SlotKind::Grad)
                        .map_err(|r| err(path, format!("{}/{}: {r}", m.name, slot.name())))?,
                    None if host.is_empty() => {}
                    None => {
                        return Err(err(path, format!("{}/{}: unexpected", m.name, slot.name())));
                    }
                }
            }
        }
        self.options = c.options;
        self.global_steps = c.global_steps;
        self.groups = c.groups;
        for (i, p) in c.params.into_iter().enumerate() {
            let id = ParamId(i);
            self.restore(id, p.steps, p.accumulations, p.pending, p.lr_rule)?;
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
