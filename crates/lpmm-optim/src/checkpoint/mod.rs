//! Checkpoints: the complete optimizer state (every slot's bytes, scales and code maps, step and
//! accumulation counters that position the random streams, the configuration) as one safetensors
//! file, written atomically. Loading builds a new optimizer and validates everything before
//! anything live changes.
//!
//! The file is the checkpoint codec's output ([`codec`]: its metadata, tensor names, dtypes,
//! checksum and checks; version 1 of [`FORMAT`]) in a safetensors container: every tensor of
//! [`codec::Encoded`] as a 1-D safetensors tensor, and the metadata under the safetensors
//! metadata key `lpmm`. A file without that key is refused; a file holds exactly the codec's
//! tensors, code maps included ([`codec::Scheme::maps`]), and never a parameter whose value is
//! held outside it.
//!
//! The rule: whatever `save` accepts, `load` loads. Both run the same validation
//! ([`Canonical::check`]) — `save` before writing anything (a typed error, the old file kept),
//! `load` before allocating anything — and a successful load gives an optimizer whose `save`
//! writes the same tensors and hyperparameters bit for bit.

pub mod codec;

use std::collections::HashMap;
use std::path::Path;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, Metadata, TensorView};

use crate::backend::{Backend, ParamId, SlotKind};
use crate::config::ParamConfig;
use crate::error::OptimError;
use crate::optimizer::{Lender, Optimizer, Parts};

pub use codec::{Canonical, CanonicalParam};

/// The checkpoint format's name and version, checked on load.
pub const FORMAT: &str = "lpmm-optim-checkpoint";
/// Bumped whenever the layout changes; older versions get a typed error naming both.
pub const VERSION: u32 = 1;

/// The safetensors file's scheme: code maps included, errors about "the file".
const SCHEME: codec::Scheme = codec::Scheme {
    format: FORMAT,
    version: VERSION,
    maps: true,
    noun: "file",
};

/// The metadata key holding the codec's metadata.
const META_KEY: &str = "lpmm";

/// What [`Optimizer::load`] may change besides the state ([`Checkpoint::policy`]).
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
    /// As [`LoadPolicy::SameConfiguration`] but for the learning rates (of the groups and the
    /// parameters), which the checkpoint's replace: a run resumed after a schedule changed them
    /// (candle's `set_learning_rate` between steps; lpmm-candle's `load` takes this policy),
    /// where any other difference is still refused.
    TakeLearningRates,
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

/// A safetensors file's tensors, as the codec reads them.
struct Tensors<'a> {
    header: &'a Metadata,
    names: Vec<String>,
    data: &'a [u8],
    size: usize,
}

impl<'a> Tensors<'a> {
    /// The tensors of `bytes`, whose header (`header_len` bytes after the length word) is
    /// `header`.
    fn new(bytes: &'a [u8], header_len: usize, header: &'a Metadata) -> Self {
        Tensors {
            header,
            names: header.offset_keys(),
            data: &bytes[8 + header_len..],
            size: bytes.len(),
        }
    }
}

impl codec::Source for Tensors<'_> {
    fn names(&self) -> Vec<&str> {
        self.names.iter().map(String::as_str).collect()
    }

    fn get(&self, name: &str) -> Option<codec::Stored<'_>> {
        let info = self.header.info(name)?;
        let (a, b) = info.data_offsets;
        Some(codec::Stored {
            dtype: format!("{:?}", info.dtype),
            shape: &info.shape,
            bytes: self.data.get(a..b)?,
        })
    }

    fn size(&self) -> usize {
        self.size
    }
}

impl Canonical {
    /// The safetensors file, after [`Canonical::check`] (its error names what fails).
    pub fn to_bytes(&self) -> Result<Vec<u8>, String> {
        let encoded = self.encode(&SCHEME, &[])?;
        let views = encoded
            .tensors
            .iter()
            .map(|t| {
                TensorView::new(st_dtype(t.dtype), vec![t.len], &t.bytes)
                    .map(|v| (t.name.as_str(), v))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let info = HashMap::from([(META_KEY.to_string(), encoded.metadata)]);
        safetensors::tensor::serialize(views, Some(info)).map_err(|e| e.to_string())
    }

    /// Parses and validates a checkpoint file's bytes ([`Canonical::decode`]: format, version,
    /// checksum, the tensors, [`Canonical::check`]). Sizes are checked against the file before
    /// anything is copied, so a load costs time and memory linear in the file.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let (header_len, header) = SafeTensors::read_metadata(bytes)
            .map_err(|e| format!("not a readable safetensors file: {e}"))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_KEY))
            .ok_or("no lpmm metadata: not an lpmm checkpoint")?;
        let tensors = Tensors::new(bytes, header_len, &header);
        let decoded = Canonical::decode(&SCHEME, json, &tensors)?;
        if let Some(i) = decoded.outside.iter().position(|&o| o) {
            return Err(format!(
                "parameter {}: its value is held outside the file (an lpmm checkpoint holds every value)",
                decoded.canonical.params[i].name
            ));
        }
        Ok(decoded.canonical)
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
    /// [`LoadPolicy::SameConfiguration`]), if any; with `any_lr`, learning rates may differ.
    fn configuration_difference<B: Backend>(
        &self,
        opt: &Optimizer<B>,
        any_lr: bool,
    ) -> Option<String> {
        let same = |a: &ParamConfig, b: &ParamConfig| {
            let mut a = *a;
            if any_lr {
                a.hyper.set_lr(b.hyper.lr());
            }
            a == *b
        };
        if self.options != opt.options {
            return Some(format!(
                "its options {:?} differ from this optimizer's {:?}",
                self.options, opt.options
            ));
        }
        if self.groups.len() != opt.groups.len()
            || self
                .groups
                .iter()
                .zip(&opt.groups)
                .any(|(a, b)| !same(a, b))
        {
            return Some("its parameter groups differ from this optimizer's".into());
        }
        for (p, m) in self.params.iter().zip(&opt.states) {
            if p.group != m.group || !same(&p.requested, &m.requested) || p.lr_rule != m.lr_rule {
                return Some(format!(
                    "parameter {}: its group, configuration or learning-rate rule differs from this optimizer's",
                    p.name
                ));
            }
        }
        None
    }
}

/// How a checkpoint is written or read ([`Optimizer::save`], [`Optimizer::load`]): where lent
/// parameters' buffers come from, and what a load may change. `Checkpoint::new()` (or
/// `Default`): no lent parameters, [`LoadPolicy::SameConfiguration`].
pub struct Checkpoint<'s, B: Backend> {
    lender: Option<&'s mut dyn Lender<B>>,
    policy: LoadPolicy,
}

impl<B: Backend> Default for Checkpoint<'_, B> {
    fn default() -> Self {
        Checkpoint {
            lender: None,
            policy: LoadPolicy::default(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for Checkpoint<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("lender", &self.lender.is_some())
            .field("policy", &self.policy)
            .finish()
    }
}

impl<'s, B: Backend> Checkpoint<'s, B> {
    /// No lent parameters; a load keeps the configuration.
    pub fn new() -> Self {
        Self::default()
    }

    /// Lent parameters' buffers ([`Optimizer::add_lent_param`]), lent one at a time: a save
    /// reads their values (so the file loads anywhere), a load writes the saved values into
    /// them.
    pub fn lender(self, lender: &'s mut dyn Lender<B>) -> Self {
        Checkpoint {
            lender: Some(lender),
            ..self
        }
    }

    /// What a load may change besides the state ([`LoadPolicy`]).
    pub fn policy(self, policy: LoadPolicy) -> Self {
        Checkpoint { policy, ..self }
    }
}

impl Canonical {
    /// A new optimizer on `backend` holding this state (after [`Canonical::check`]): how a
    /// checkpoint file becomes an optimizer without registering its parameters first
    /// (`Canonical::read(path)?.into_optimizer(Cpu)`). Its canonical form
    /// ([`crate::Parts::canonical`]) equals `self`. Every error about the state is an
    /// [`OptimError::Checkpoint`].
    pub fn into_optimizer<B: Backend>(self, backend: B) -> Result<Optimizer<B>, OptimError> {
        let path = Path::new("(canonical)");
        self.check().map_err(|e| err(path, e))?;
        Optimizer::build(backend, self).map_err(|e| file_err(path, e))
    }
}

impl<B: Backend> Optimizer<B> {
    /// Writes the complete state to `path` atomically: a temporary file in the same directory,
    /// flushed to disk, then renamed over `path`. A crash leaves the old file or the new one,
    /// never a partial one; the temporary files a crash leaves behind are removed by the next
    /// save or load of `path`. A state that would not load is refused with a typed error
    /// ([`Canonical::check`]) and nothing is written. Lent parameters' values are read through
    /// `how`'s lender ([`Checkpoint::lender`]): without one, a lent parameter makes the save fail
    /// (a checkpoint holds every value).
    pub fn save(&self, path: impl AsRef<Path>, how: Checkpoint<'_, B>) -> Result<(), OptimError> {
        Parts::of(self).canonical(how.lender)?.write(path)
    }

    /// Replaces this optimizer's state with the checkpoint at `path`, written by
    /// [`Optimizer::save`] on any backend. It must hold the same parameters (names, shapes,
    /// order) and, under `how`'s [`LoadPolicy`] ([`Checkpoint::policy`]; by default
    /// [`LoadPolicy::SameConfiguration`]), the same configuration. Lent parameters' saved values
    /// go into their buffers ([`Checkpoint::lender`]; needed when the optimizer has lent
    /// parameters, which keep their layouts and step plans: the checkpoint must then be of the
    /// same update rule and storages). On any error nothing changes. The [`crate::Settings`] and
    /// which parameters expect a gradient are kept.
    pub fn load(
        &mut self,
        path: impl AsRef<Path>,
        how: Checkpoint<'_, B>,
    ) -> Result<(), OptimError> {
        let path = path.as_ref();
        let c = Canonical::read(path)?;
        self.check_same_parameters(path, &c, how.policy)?;
        match how.lender {
            None if self.layouts.iter().any(|l| l.lent) => Err(err(
                path,
                "this optimizer holds lent parameters: load with Checkpoint::lender",
            )),
            None => {
                let mut loaded =
                    Self::build(self.backend.clone(), c).map_err(|e| file_err(path, e))?;
                loaded.keep_settings(self);
                *self = loaded;
                Ok(())
            }
            Some(lender) => self.load_lent(path, c, lender),
        }
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
                opt.import_slot(id, slot, &host, None)?;
            }
        }
        Ok(opt)
    }

    /// The checkpoint holds this optimizer's parameters (names, shapes, order) and, under
    /// [`LoadPolicy::SameConfiguration`], its configuration.
    fn check_same_parameters(
        &self,
        path: &Path,
        c: &Canonical,
        policy: LoadPolicy,
    ) -> Result<(), OptimError> {
        let same = c.params.len() == self.states.len()
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
        let any_lr = match policy {
            LoadPolicy::ReplaceConfiguration => return Ok(()),
            LoadPolicy::SameConfiguration => false,
            LoadPolicy::TakeLearningRates => true,
        };
        if let Some(d) = c.configuration_difference(self, any_lr) {
            return Err(err(
                path,
                format!(
                    "{d}; load with LoadPolicy::ReplaceConfiguration to take the checkpoint's configuration"
                ),
            ));
        }
        Ok(())
    }

    /// [`Optimizer::load`] into an optimizer with lent parameters, whose saved values go into
    /// their buffers. The checkpoint must hold the same parameters with the same storages;
    /// every slot is checked before anything changes.
    fn load_lent(
        &mut self,
        path: &Path,
        c: Canonical,
        lender: &mut dyn Lender<B>,
    ) -> Result<(), OptimError> {
        // Everything is checked before anything changes: the storages and the step plan (a
        // lent parameter keeps its layout and plan, so another update rule is refused, not
        // stepped with this one's kernels), the counters, every slot, every lent buffer.
        for (i, p) in c.params.iter().enumerate() {
            let (m, layout) = (&self.states[i], &self.layouts[i]);
            let id = ParamId(i);
            let resolved = p.requested.resolve(layout.numel, &p.shape);
            if resolved.slots() != m.config.slots() {
                return Err(err(path, format!("parameter {} differs (storage)", m.name)));
            }
            if Self::compile(layout, &resolved) != m.step_plan {
                return Err(err(
                    path,
                    format!(
                        "parameter {} differs (update rule: the checkpoint's is {}, this optimizer's {}); an optimizer with lent parameters loads its own rule's checkpoints",
                        m.name,
                        p.requested.hyper.name(),
                        m.config.hyper.name()
                    ),
                ));
            }
            self.check_restore(id, p.steps, p.accumulations, p.pending, p.lr_rule)
                .map_err(|e| file_err(path, e))?;
            crate::optimizer::check_rule_state(p.rule_state).map_err(|e| file_err(path, e))?;
            for (slot, host) in SlotKind::ALL.into_iter().zip(&p.slots) {
                self.check_import(id, slot, host)
                    .map_err(|e| file_err(path, e))?;
            }
            if layout.lent {
                let backend = &self.backend;
                lender.lend_mut(id, &mut |buf| {
                    Ok(backend.check_lent(layout, backend.output_info(&buf))?)
                })?;
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
                    self.import_slot(id, slot, host, None)?;
                }
            }
        }
        Ok(())
    }
}

/// Recomputes a checkpoint file's checksum as the writer would ([`codec::seal`]; for tests and
/// fuzzing: a forged or mutated file then reaches the checks behind the checksum). `None` if the
/// file's header or metadata does not parse.
#[cfg(feature = "testing")]
pub(crate) fn reseal(bytes: &[u8]) -> Option<Vec<u8>> {
    use codec::Source;
    let (header_len, header) = SafeTensors::read_metadata(bytes).ok()?;
    let json = header.metadata().as_ref()?.get(META_KEY)?;
    let tensors = Tensors::new(bytes, header_len, &header);
    let json = codec::seal(json, &tensors).ok()?;
    let mut names = tensors.names();
    names.sort_unstable();
    let views = names
        .iter()
        .filter_map(|&n| {
            let info = header.info(n)?;
            let t = tensors.get(n)?;
            Some(TensorView::new(info.dtype, t.shape.to_vec(), t.bytes).map(|v| (n, v)))
        })
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let info = HashMap::from([(META_KEY.to_string(), json)]);
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
        // The rename replaces whatever is at `path`: never a device, a FIFO, a socket or a
        // directory (run as root, a save to `/dev/null` would put the checkpoint in its place).
        // A link to a regular file is replaced by the checkpoint, as any atomic save does.
        if let Ok(meta) = fs::metadata(path)
            && !meta.is_file()
        {
            return Err(std::io::Error::other(
                "the path is not a regular file (a device, FIFO, socket or directory): a \
                 checkpoint replaces a file",
            ));
        }
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
