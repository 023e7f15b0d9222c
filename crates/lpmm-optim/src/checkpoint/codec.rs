//! The checkpoint codec: the complete optimizer state in the canonical layout ([`Canonical`]) as
//! a metadata string and a list of named tensors, and back, whatever container holds them
//! (lpmm-optim's safetensors checkpoint, lpmm-burn's burn record). A container stores what
//! [`Canonical::encode`] gives and hands [`Canonical::decode`] the metadata and a [`Source`] of
//! its tensors; the names, dtypes, checksum, the slots' regions and every check are the codec's.
//!
//! Layout: per parameter `p` and slot `s` in {param, grad, state1, state2, state3}, one tensor
//! `p/s<suffix>` per saved region of the slot's format (`crate::backend::RegionSpec`: the
//! primary region's suffix is empty; `.comp` Kahan compensations, `.rem` split-f32 remainders,
//! `.lo` bf16+8 corrections, `.absmax` block scales, `.scales` rank-1 maxima, `.row`/`.col`
//! factorized statistics), the whole tensor, unsharded, in the region's dtype, 1-D; and, where
//! the container carries them ([`Scheme::maps`]), `maps/<map name>` (F32) for every code map in
//! use. The metadata is the
//! JSON of `CheckpointMeta`: the container's format name and version ([`Scheme`]), the options,
//! the step counter, the groups, per parameter its shape, configuration, counters, learning-rate
//! rule and rule state, and `crc32`, the CRC-32 of that JSON without the field followed by every
//! tensor (name, dtype, shape, bytes) in name order. Metadata without a checksum is refused, and
//! so is a key this build does not know (read as absent, a newer writer's field or a corrupted
//! key would be dropped without a word: a renamed `crc32` would turn the checksum off). A
//! container holds exactly these tensors.
//!
//! A parameter's value may be held outside the checkpoint (`value_outside` in its metadata; the
//! `outside` flags of [`Canonical::encode`] and [`Decoded`]): its parameter slot's primary
//! region is not among the tensors, because its owner keeps it — a lent parameter's buffer
//! (`crate::optimizer::Lender`), a burn module's tensor, which the module's own record saves.
//! Its other regions (a Kahan compensation, a split-f32 remainder) and slots are stored as
//! usual. The decoded parameter slot then lacks its primary region; whoever joins the value to
//! the state checks the whole slot then (`PartsMut::import_slot` with the buffer).
//!
//! No name can collide with another: a parameter's tensors are `<name>/<slot><suffix>`, and
//! neither slot names nor suffixes contain `/`, so the text after the last `/` tells the slot and
//! the text before it the parameter; a code map's tensor `maps/<map>` would need a slot named
//! after a map. The decoder looks every tensor up by the exact name the configuration gives it.
//!
//! The rule: whatever `encode` accepts, `decode` decodes. Both run the same validation
//! ([`Canonical::check_outside`]) — `encode` before anything is written, `decode` before it
//! returns — and sizes are checked against the container before anything is copied, so a
//! decode costs time and memory linear in the container.

use std::borrow::Cow;
use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::backend::{Dtype, Format, HostRegion, HostSlot, RuleState, SLOTS, SlotKind};
use crate::config::ParamConfig;
use crate::format::MapKind;
use crate::optimizer::{LrRule, MAX_COUNTER, OptimizerOptions};

/// What a container asks of the codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheme {
    /// The format name the metadata carries and a decode requires.
    pub format: &'static str,
    /// The layout version the metadata carries and a decode requires.
    pub version: u32,
    /// Whether the tensors include the code maps in use (`maps/<map name>`; a decode then
    /// requires them, equal to this build's).
    pub maps: bool,
    /// What errors call the container (`"file"`, `"record"`).
    pub noun: &'static str,
}

/// One tensor of an encoded checkpoint: 1-D, little-endian.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedTensor<'a> {
    /// Its name (module documentation).
    pub name: String,
    /// The dtype of its values.
    pub dtype: Dtype,
    /// Its length in values.
    pub len: usize,
    /// Its bytes (`len` values of `dtype`).
    pub bytes: Cow<'a, [u8]>,
    /// The parameter whose slot it belongs to (its index in [`Canonical::params`]); `None` for a
    /// code map.
    pub param: Option<usize>,
}

/// What [`Canonical::encode`] gives a container to store.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded<'a> {
    /// The metadata (JSON, with its checksum).
    pub metadata: String,
    /// The tensors, in name order.
    pub tensors: Vec<EncodedTensor<'a>>,
}

/// A tensor as a container holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored<'a> {
    /// Its dtype's name, as safetensors and burn spell theirs (`F32`, `BF16`, `U16`, `U8`,
    /// `U32`; any other is refused).
    pub dtype: String,
    /// Its shape.
    pub shape: &'a [usize],
    /// Its bytes.
    pub bytes: &'a [u8],
}

/// A container's tensors, as [`Canonical::decode`] reads them.
pub trait Source {
    /// The names of every tensor it holds.
    fn names(&self) -> Vec<&str>;
    /// The tensor named `name`, if it holds one.
    fn get(&self, name: &str) -> Option<Stored<'_>>;
    /// Its size in bytes. No storage takes less than 4 bits per element, so a checkpoint holds
    /// at most 2 elements per byte; checked before anything is allocated.
    fn size(&self) -> usize;
}

/// What [`Canonical::decode`] gives: the state, and per parameter whether its value is held
/// outside the checkpoint (then its parameter slot lacks its primary region).
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The state.
    pub canonical: Canonical,
    /// Per parameter: its value is held outside the checkpoint.
    pub outside: Vec<bool>,
}

/// What the metadata holds besides the tensors (module documentation). A key the decoder does
/// not know is refused, not skipped.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckpointMeta {
    format: String,
    version: u32,
    options: OptimizerOptions,
    global_steps: u64,
    groups: Vec<ParamConfig>,
    params: Vec<ParamMeta>,
    /// Whether the parameters hold their evaluation point (`Optimizer::set_mode`, `Mode::Eval`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    eval: bool,
    /// The checksum (module documentation). Every checkpoint carries one; `None` only while it
    /// is computed (the JSON it covers is the metadata without it), and metadata without it is
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
    /// Its value is held outside the checkpoint (module documentation).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    value_outside: bool,
}

fn is_default(s: &RuleState) -> bool {
    *s == RuleState::default()
}

/// The name safetensors and burn give `d`.
fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "F32",
        Dtype::Bf16 => "BF16",
        Dtype::U16 => "U16",
        Dtype::U8 => "U8",
        Dtype::U32 => "U32",
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

/// The tensor of a parameter's region.
fn tensor_name(param: &str, slot: SlotKind, suffix: &str) -> String {
    format!("{param}/{}{suffix}", slot.name())
}

/// The tensor of a code map.
fn map_name(map: MapKind) -> String {
    format!("maps/{}", map.name())
}

fn map_tensor(map: MapKind) -> Vec<u8> {
    map.shared()
        .values()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// Whether the region is the primary region of an outside parameter's parameter slot (not
/// stored).
fn left_out(outside: bool, slot: SlotKind, suffix: &str) -> bool {
    outside && slot == SlotKind::Param && suffix.is_empty()
}

/// The CRC-32 of the metadata JSON (without its checksum) and of every tensor (name, dtype name,
/// shape, bytes), in name order: each length (8 bytes, little-endian) before its bytes, so the
/// hashed stream reads one way only.
struct Checksum(crc32fast::Hasher);

impl Checksum {
    fn new(json: &str) -> Self {
        let mut c = Checksum(crc32fast::Hasher::new());
        c.word(json.len());
        c.0.update(json.as_bytes());
        c
    }

    fn word(&mut self, x: usize) {
        self.0.update(&(x as u64).to_le_bytes());
    }

    fn tensor(&mut self, name: &str, dtype: &str, shape: &[usize], bytes: &[u8]) {
        self.word(name.len());
        self.0.update(name.as_bytes());
        self.word(dtype.len());
        self.0.update(dtype.as_bytes());
        self.word(shape.len());
        for &d in shape {
            self.word(d);
        }
        self.word(bytes.len());
        self.0.update(bytes);
    }

    fn finish(self) -> u32 {
        self.0.finalize()
    }
}

/// The checksum of `meta` (without its own) over every tensor of `source`, in name order.
fn source_checksum(meta: &CheckpointMeta, source: &dyn Source) -> Result<u32, String> {
    let json = serde_json::to_string(meta).map_err(|e| format!("metadata: {e}"))?;
    let mut names = source.names();
    names.sort_unstable();
    let mut c = Checksum::new(&json);
    for n in names {
        if let Some(t) = source.get(n) {
            c.tensor(n, &t.dtype, t.shape, t.bytes);
        }
    }
    Ok(c.finish())
}

/// `metadata` with the checksum a writer would give it over `source`'s tensors (for containers
/// that translate an older layout into this one, and for tests and fuzzing: a forged or mutated
/// checkpoint then reaches the checks behind the checksum). An error if the metadata does not
/// parse.
pub fn seal(metadata: &str, source: &dyn Source) -> Result<String, String> {
    let mut meta: CheckpointMeta =
        serde_json::from_str(metadata).map_err(|e| format!("metadata: {e}"))?;
    meta.crc32 = None;
    meta.crc32 = Some(source_checksum(&meta, source)?);
    serde_json::to_string(&meta).map_err(|e| format!("metadata: {e}"))
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

/// A whole checkpoint in the canonical layout: what `Optimizer::save` writes and
/// `Optimizer::load` (or `Canonical::read(path)?.into_optimizer(backend)`) reads, what
/// lpmm-burn's records hold, also assembled from (and cut into) shards by lpmm-dist.
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
    /// Whether the parameters hold their evaluation point (`Optimizer::set_mode`, `Mode::Eval`).
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
        self.check_outside(&[])
    }

    /// [`Canonical::check`] where `outside[i]` says that parameter `i`'s value is held outside
    /// the checkpoint (empty: none is): its parameter slot need not hold its primary region, and
    /// of that slot only the layout and lengths of the other regions are checked (the contents
    /// are checked when the value joins them).
    pub fn check_outside(&self, outside: &[bool]) -> Result<(), String> {
        if !outside.is_empty() && outside.len() != self.params.len() {
            return Err(format!(
                "{} outside flags for {} parameters",
                outside.len(),
                self.params.len()
            ));
        }
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
        for (i, p) in self.params.iter().enumerate() {
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
            let outside = outside.get(i).copied().unwrap_or(false);
            for ((slot, format), host) in SlotKind::ALL.into_iter().zip(formats).zip(&p.slots) {
                let what = |r: String| format!("{name}/{}: {r}", slot.name());
                match format {
                    Some(f) if left_out(outside, slot, "") => {
                        // The regions besides the primary one, in the format's order.
                        let kept = |s: &str| !left_out(outside, slot, s);
                        let specs = f.regions(&p.shape).into_iter().filter(|s| s.saved);
                        let specs: Vec<_> = specs.filter(|s| kept(s.suffix)).collect();
                        let held: Vec<&HostRegion> = host
                            .regions
                            .iter()
                            .filter(|r| kept(r.spec.suffix))
                            .collect();
                        if held.len() != specs.len()
                            || held
                                .iter()
                                .zip(&specs)
                                .any(|(h, s)| h.spec != *s || h.bytes.len() != s.bytes(n))
                        {
                            return Err(what(
                                "stored layout or length does not match the configuration".into(),
                            ));
                        }
                    }
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

    /// The metadata and tensors a container stores, after [`Canonical::check_outside`] (its error
    /// names what fails). `outside[i]` (empty: none) leaves out parameter `i`'s value: its
    /// parameter slot's primary region, which its owner holds (module documentation); the slot
    /// may hold it or not.
    pub fn encode(&self, scheme: &Scheme, outside: &[bool]) -> Result<Encoded<'_>, String> {
        self.check_outside(outside)?;
        let is_outside = |i: usize| outside.get(i).copied().unwrap_or(false);
        let mut tensors = Vec::new();
        let mut maps: Vec<MapKind> = Vec::new();
        for (i, m) in self.params.iter().enumerate() {
            for (slot, host) in SlotKind::ALL.into_iter().zip(&m.slots) {
                for r in &host.regions {
                    if left_out(is_outside(i), slot, r.spec.suffix) {
                        continue;
                    }
                    tensors.push(EncodedTensor {
                        name: tensor_name(&m.name, slot, r.spec.suffix),
                        dtype: r.spec.dtype,
                        len: r.bytes.len() / r.spec.dtype.size(),
                        bytes: Cow::Borrowed(&r.bytes),
                        param: Some(i),
                    });
                }
            }
            if scheme.maps {
                let n = numel(&m.shape).unwrap_or(0);
                for f in slot_formats(&m.requested, &m.shape, n).iter().flatten() {
                    if let Some(map) = f.map()
                        && !maps.contains(&map)
                    {
                        maps.push(map);
                    }
                }
            }
        }
        for map in maps {
            let bytes = map_tensor(map);
            tensors.push(EncodedTensor {
                name: map_name(map),
                dtype: Dtype::F32,
                len: bytes.len() / 4,
                bytes: Cow::Owned(bytes),
                param: None,
            });
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let mut meta = CheckpointMeta {
            format: scheme.format.into(),
            version: scheme.version,
            options: self.options,
            global_steps: self.global_steps,
            groups: self.groups.clone(),
            params: self
                .params
                .iter()
                .enumerate()
                .map(|(i, m)| ParamMeta {
                    name: m.name.clone(),
                    shape: m.shape.clone(),
                    group: m.group,
                    requested: m.requested,
                    steps: m.steps,
                    accumulations: m.accumulations,
                    pending: m.pending,
                    lr_rule: m.lr_rule,
                    rule_state: m.rule_state,
                    value_outside: is_outside(i),
                })
                .collect(),
            eval: self.eval,
            crc32: None,
        };
        let json = serde_json::to_string(&meta).map_err(|e| e.to_string())?;
        let mut c = Checksum::new(&json);
        for t in &tensors {
            c.tensor(&t.name, dtype_name(t.dtype), &[t.len], &t.bytes);
        }
        meta.crc32 = Some(c.finish());
        let metadata = serde_json::to_string(&meta).map_err(|e| e.to_string())?;
        Ok(Encoded { metadata, tensors })
    }

    /// Parses and validates a container's metadata and tensors: format and version (`scheme`'s),
    /// checksum, the tensors (exactly those the configuration names, each with its dtype, shape
    /// and length, the code maps equal to this build's where the scheme carries them) and
    /// [`Canonical::check_outside`]. Sizes are checked against the container before anything is
    /// copied, so a decode costs time and memory linear in the container.
    pub fn decode(scheme: &Scheme, metadata: &str, source: &dyn Source) -> Result<Decoded, String> {
        let noun = scheme.noun;
        let mut meta: CheckpointMeta =
            serde_json::from_str(metadata).map_err(|e| format!("metadata: {e}"))?;
        if meta.format != scheme.format {
            return Err(format!(
                "format {:?}, expected {:?}",
                meta.format, scheme.format
            ));
        }
        if meta.version != scheme.version {
            return Err(format!(
                "version {}, this lpmm reads version {}",
                meta.version, scheme.version
            ));
        }
        let want = meta.crc32.take().ok_or_else(|| {
            format!(
                "no checksum in the metadata (every lpmm checkpoint has one): the {noun} is corrupt"
            )
        })?;
        let got = source_checksum(&meta, source)?;
        if got != want {
            return Err(format!(
                "checksum mismatch (the {noun} says {want:#010x}, its contents give {got:#010x}): the {noun} is corrupt"
            ));
        }
        // Every storage takes at least 4 bits per element: a checkpoint cannot hold more than
        // 2 elements per byte, in all parameters together. Checked before anything else, so a
        // forged header cannot make us allocate for it. A parameter whose value is held outside
        // needs a valid shape; nothing is allocated for it but the regions stored.
        let mut total = 0usize;
        for p in &meta.params {
            let n = numel(&p.shape);
            total = match (p.value_outside, n) {
                (true, Some(_)) => continue,
                (false, Some(n)) => total.checked_add(n).filter(|&t| t <= 2 * source.size()),
                (_, None) => None,
            }
            .ok_or_else(|| {
                format!(
                    "parameter {} has shape {:?}: empty, or more elements than the {noun} can hold",
                    p.name, p.shape
                )
            })?;
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
                    && scheme.maps
                    && !maps.contains(&map)
                {
                    maps.push(map);
                }
                for spec in format.regions(&p.shape).into_iter().filter(|r| r.saved) {
                    if left_out(p.value_outside, slot, spec.suffix) {
                        continue;
                    }
                    let key = tensor_name(&p.name, slot, spec.suffix);
                    let t = source
                        .get(&key)
                        .ok_or_else(|| format!("tensor {key} missing"))?;
                    let want = dtype_name(spec.dtype);
                    if t.dtype != want {
                        return Err(format!("tensor {key} is {}, expected {want}", t.dtype));
                    }
                    let len = spec.len(n);
                    if t.shape != [len] || t.bytes.len() != spec.bytes(n) {
                        return Err(format!(
                            "tensor {key} has shape {:?}, expected [{len}]",
                            t.shape
                        ));
                    }
                    expected += 1;
                }
            }
            formats.push(slots);
        }
        for &map in &maps {
            let t = source
                .get(&map_name(map))
                .ok_or_else(|| format!("code map {} missing", map.name()))?;
            let want = map_tensor(map);
            if t.dtype != dtype_name(Dtype::F32)
                || t.shape != [want.len() / 4]
                || t.bytes != want.as_slice()
            {
                return Err(format!("code map {} differs from this build's", map.name()));
            }
            expected += 1;
        }
        let count = source.names().len();
        if count != expected {
            return Err(format!(
                "{count} tensors, of which {expected} belong to the configuration: unexpected tensors"
            ));
        }
        let mut params = Vec::with_capacity(meta.params.len());
        let mut outside = Vec::with_capacity(meta.params.len());
        for (p, slots) in meta.params.into_iter().zip(formats) {
            let mut hosts: [HostSlot; SLOTS] = Default::default();
            for ((slot, format), host) in SlotKind::ALL.into_iter().zip(slots).zip(&mut hosts) {
                let Some(format) = format else { continue };
                let specs: Vec<_> = format
                    .regions(&p.shape)
                    .into_iter()
                    .filter(|r| r.saved && !left_out(p.value_outside, slot, r.suffix))
                    .collect();
                host.regions.reserve_exact(specs.len());
                for spec in specs {
                    let key = tensor_name(&p.name, slot, spec.suffix);
                    let t = source
                        .get(&key)
                        .ok_or_else(|| format!("tensor {key} missing"))?;
                    host.regions.push(HostRegion {
                        spec,
                        bytes: t.bytes.to_vec(),
                    });
                }
            }
            outside.push(p.value_outside);
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
        let canonical = Canonical {
            options: meta.options,
            global_steps: meta.global_steps,
            groups: meta.groups,
            params,
            eval: meta.eval,
        };
        canonical.check_outside(&outside)?;
        Ok(Decoded { canonical, outside })
    }
}
