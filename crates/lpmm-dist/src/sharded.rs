//! The sharded optimizer: each rank holds the optimizer state (and the parameter's stored copy)
//! of its shards only, and the step is bit-identical to the unsharded optimizer's.

use lpmm_optim::{Parts, PartsMut};
use std::ops::Range;
use std::path::Path;

use lpmm_optim::backend::SLOTS;
use lpmm_optim::{
    Cpu, LrRule, MemoryReport, NonFinitePolicy, Optimizer, OptimizerOptions, ParamConfig, ParamId,
    RuleState, SlotKind,
    backend::{Backend, ExactSum},
    checkpoint::{Canonical, CanonicalParam},
};

use crate::layout::{ParamSpec, ShardLayout};
use crate::slots;
use crate::{Collective, DistError};

/// How gradients reach the shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zero {
    /// ZeRO-1: gradients all-reduced (every rank gets the whole sum), each rank steps its shards,
    /// parameters all-gathered.
    One,
    /// ZeRO-2: gradients reduce-scattered (each rank gets the sum of its shards only), each rank
    /// steps its shards, parameters all-gathered.
    Two,
}

/// How sums over ranks are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// The collective library's all-reduce or reduce-scatter: its summation order (Open MPI's
    /// reduce-scatter and all-reduce add in different orders at 3+ ranks, so ZeRO-1 and ZeRO-2
    /// can differ in the last bit).
    Native,
    /// Every element summed in rank order (rank 0's value, plus rank 1's, ...) on the rank that
    /// owns it, then gathered: the same sums for ZeRO-1 and ZeRO-2 and whatever the library.
    FixedOrder,
}

/// Sharding options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardOptions {
    /// ZeRO stage.
    pub zero: Zero,
    /// Gradient reduction.
    pub reduction: Reduction,
}

impl Default for ShardOptions {
    fn default() -> Self {
        Self {
            zero: Zero::Two,
            reduction: Reduction::FixedOrder,
        }
    }
}

impl ShardOptions {
    /// With ZeRO stage `zero`.
    pub fn with_zero(self, zero: Zero) -> Self {
        Self { zero, ..self }
    }

    /// With gradient reduction `reduction`.
    pub fn with_reduction(self, reduction: Reduction) -> Self {
        Self { reduction, ..self }
    }
}

/// A parameter of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamDef {
    /// Name (unique).
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Parameter group.
    pub group: usize,
    /// Its own configuration (None: the group's).
    pub config: Option<ParamConfig>,
}

impl ParamDef {
    /// A parameter with its group's configuration.
    pub fn new(name: &str, shape: &[usize], group: usize) -> Self {
        Self {
            name: name.to_string(),
            shape: shape.to_vec(),
            group,
            config: None,
        }
    }
}

/// What a sharded step did (the same on every rank, except `local_non_finite`).
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct ShardedReport {
    /// Whether the whole step was skipped (a non-finite gradient anywhere, under SkipStep).
    pub skipped: bool,
    /// The global gradient norm, when computed (clipping or SkipStep).
    pub grad_norm: Option<f64>,
    /// Parameters (model indices) with a non-finite gradient in this rank's shards.
    pub local_non_finite: Vec<usize>,
}

/// A model's optimizer sharded over the ranks of `comm`, each rank's shards on backend `B` (the
/// CPU by default; any `Backend`, e.g. lpmm-wgpu's or lpmm-cuda's, with
/// [`ShardedOptimizer::with_backend`]).
#[derive(Debug)]
pub struct ShardedOptimizer<C: Collective, B: Backend = Cpu> {
    comm: C,
    opt: Optimizer<B>,
    shard: ShardOptions,
    groups: Vec<ParamConfig>,
    defs: Vec<ParamDef>,
    numels: Vec<usize>,
    layout: ShardLayout,
    /// Per model parameter: this rank's shards of it (local id, element range).
    local: Vec<Vec<(ParamId, Range<usize>)>>,
    /// Which model parameter each local id belongs to.
    owner: Vec<usize>,
    /// The whole parameters as stored, gathered after every step.
    params: Vec<Vec<f32>>,
}

fn len_err(what: &str, p: &str, want: usize, got: usize) -> DistError {
    DistError::Optim(lpmm_optim::OptimError::Length {
        param: p.to_string(),
        what: if what == "grad" {
            "gradient"
        } else {
            "initial values"
        },
        expected: want,
        actual: got,
    })
}

impl<C: Collective> ShardedOptimizer<C, Cpu> {
    /// Shards the model `defs` (with parameter groups `groups` and initial values `init`, the
    /// same on every rank) over the ranks of `comm`.
    pub fn new(
        comm: C,
        options: OptimizerOptions,
        shard: ShardOptions,
        groups: Vec<ParamConfig>,
        defs: Vec<ParamDef>,
        init: &[Vec<f32>],
    ) -> Result<Self, DistError> {
        Self::with_backend(Cpu, comm, options, shard, groups, defs, init)
    }

    /// Loads a canonical checkpoint (written unsharded or by [`ShardedOptimizer::save`] at any
    /// number of ranks) onto the ranks of `comm`, the shards on the CPU.
    pub fn load(comm: C, path: impl AsRef<Path>, shard: ShardOptions) -> Result<Self, DistError> {
        Self::load_with(Cpu, comm, path, shard)
    }
}

impl<C: Collective, B: Backend> ShardedOptimizer<C, B> {
    /// [`ShardedOptimizer::new`] with this rank's shards on `backend`.
    pub fn with_backend(
        backend: B,
        comm: C,
        options: OptimizerOptions,
        shard: ShardOptions,
        groups: Vec<ParamConfig>,
        defs: Vec<ParamDef>,
        init: &[Vec<f32>],
    ) -> Result<Self, DistError> {
        let mut s = Self::skeleton(backend, comm, options, shard, groups, defs)?;
        if init.len() != s.defs.len() {
            return Err(DistError::Collective(format!(
                "{} initial value vectors for {} parameters",
                init.len(),
                s.defs.len()
            )));
        }
        for (p, values) in init.iter().enumerate() {
            if values.len() != s.numels[p] {
                return Err(len_err("init", &s.defs[p].name, s.numels[p], values.len()));
            }
        }
        s.register(|p, range| init[p][range].to_vec())?;
        s.params = s.gather_params()?;
        Ok(s)
    }

    fn skeleton(
        backend: B,
        comm: C,
        options: OptimizerOptions,
        shard: ShardOptions,
        groups: Vec<ParamConfig>,
        defs: Vec<ParamDef>,
    ) -> Result<Self, DistError> {
        let mut opt = Optimizer::with_backend(backend, options)?;
        for g in &groups {
            opt.add_group(*g)?;
        }
        let mut numels = Vec::with_capacity(defs.len());
        let mut specs = Vec::with_capacity(defs.len());
        for d in &defs {
            let config = d
                .config
                .or_else(|| groups.get(d.group).copied())
                .ok_or(lpmm_optim::OptimError::UnknownGroup(d.group))?;
            let numel: usize = d.shape.iter().product();
            let resolved = config.resolve(numel, &d.shape);
            let splittable = resolved.splittable();
            numels.push(numel);
            specs.push(ParamSpec {
                numel,
                splittable,
                align: resolved.shard_alignment(),
            });
        }
        let layout = ShardLayout::new(&specs, comm.world());
        Ok(Self {
            comm,
            opt,
            shard,
            groups,
            defs,
            numels,
            layout,
            local: Vec::new(),
            owner: Vec::new(),
            params: Vec::new(),
        })
    }

    /// Registers this rank's shards with values from `init(param, range)`.
    fn register(
        &mut self,
        init: impl Fn(usize, Range<usize>) -> Vec<f32>,
    ) -> Result<(), DistError> {
        self.local = vec![Vec::new(); self.defs.len()];
        for s in self.layout.shards(self.comm.rank()) {
            let d = &self.defs[s.param];
            let config = d.config.unwrap_or(self.groups[d.group]);
            let id = PartsMut::of(&mut self.opt).add_param_shard(
                &format!("{}@{}", d.name, s.range.start),
                &d.shape,
                s.range.clone(),
                &init(s.param, s.range.clone()),
                d.group,
                config,
                s.param,
            )?;
            self.local[s.param].push((id, s.range));
            self.owner.push(s.param);
        }
        Ok(())
    }

    /// Sets every group's learning rate (as `Optimizer::set_lr`); call it on every rank.
    pub fn set_lr(&mut self, lr: f64) -> Result<(), DistError> {
        self.opt.set_lr(lr)?;
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The layout in force.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// The model memory this rank holds (its shards' slots).
    pub fn memory_report(&self) -> MemoryReport {
        self.opt.memory_report()
    }

    /// The optimizer of this rank's shards.
    pub fn local(&self) -> &Optimizer<B> {
        &self.opt
    }

    /// Every parameter's values as stored (decoded), gathered from the ranks after the last
    /// step: what the next forward pass uses.
    pub fn params(&self) -> &[Vec<f32>] {
        &self.params
    }

    /// One step from this rank's gradients of every parameter (`grads[p]`, the whole tensor):
    /// summed over ranks, accumulated into the shards, the shards stepped with the global norm
    /// and non-finite decision, the parameters gathered.
    pub fn step(&mut self, grads: &[&[f32]]) -> Result<ShardedReport, DistError> {
        if grads.len() != self.defs.len() {
            return Err(DistError::Collective(format!(
                "{} gradients for {} parameters",
                grads.len(),
                self.defs.len()
            )));
        }
        for (p, g) in grads.iter().enumerate() {
            if g.len() != self.numels[p] {
                return Err(len_err("grad", &self.defs[p].name, self.numels[p], g.len()));
            }
        }
        let reduced = self.reduce(grads)?;
        for (p, shards) in self.local.iter().enumerate() {
            for (id, range) in shards {
                self.opt.accumulate(*id, reduced.get(p, range.clone()))?;
            }
        }
        let options = self.opt_options();
        let mut report = ShardedReport::default();
        let local =
            if options.max_grad_norm.is_some() || options.non_finite == NonFinitePolicy::SkipStep {
                let summary = PartsMut::of(&mut self.opt).gradient_summary()?;
                // The exact sums add as integers: any all-reduce gives the unsharded model's sum.
                let mut words = summary.sum.to_words().to_vec();
                words.push(summary.non_finite.len() as i64);
                self.comm.all_reduce_sum_i64(&mut words)?;
                let any = words.pop().unwrap_or(0) != 0;
                let w: [i64; lpmm_optim::backend::EXACT_WORDS] = words
                    .try_into()
                    .map_err(|_| DistError::Collective("exact-sum words".into()))?;
                let sum = ExactSum::from_words(&w);
                self.opt.step(lpmm_optim::Step::summarized(
                    Some((sum, any)),
                    summary.non_finite,
                ))?
            } else {
                self.opt.step(lpmm_optim::Accumulated)?
            };
        report.skipped = local.skipped;
        report.grad_norm = local.grad_norm;
        report.local_non_finite = local
            .non_finite
            .iter()
            .map(|id| self.owner[id.index()])
            .collect();
        report.local_non_finite.dedup();
        self.params = self.gather_params()?;
        Ok(report)
    }

    fn opt_options(&self) -> OptimizerOptions {
        self.opt.status().options
    }

    /// Every parameter's gradient summed over ranks, for the ranges this rank holds.
    fn reduce(&self, grads: &[&[f32]]) -> Result<Reduced, DistError> {
        let l = &self.layout;
        let (world, rank, per) = (l.world(), self.comm.rank(), l.per_rank());
        let mut flat = vec![0f32; l.flat_len()];
        let mut whole: Vec<f32> = Vec::new();
        let mut whole_at = vec![0usize; self.defs.len()];
        for (p, g) in grads.iter().enumerate() {
            match l.flat_offset(p) {
                Some(o) => flat[o..o + g.len()].copy_from_slice(g),
                None => {
                    whole_at[p] = whole.len();
                    whole.extend_from_slice(g);
                }
            }
        }
        // Whole parameters (tensor-wide states): summed everywhere.
        self.all_reduce(&mut whole)?;
        // The flat space: this rank's range, summed.
        let mine: Vec<f32> = match self.shard.zero {
            Zero::One => {
                self.all_reduce(&mut flat)?;
                flat[rank * per..(rank + 1) * per].to_vec()
            }
            Zero::Two => {
                let mut out = vec![0f32; per];
                match self.shard.reduction {
                    Reduction::Native => {
                        self.comm
                            .reduce_scatter_sum_f32(&flat, &mut out, &vec![per; world])?
                    }
                    Reduction::FixedOrder => out = fixed_reduce_scatter(&self.comm, &flat, per)?,
                }
                out
            }
        };
        Ok(Reduced {
            mine,
            base: rank * per,
            whole,
            whole_at,
            flat: (0..self.defs.len()).map(|p| l.flat_offset(p)).collect(),
        })
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), DistError> {
        match self.shard.reduction {
            Reduction::Native => self.comm.all_reduce_sum_f32(buf),
            Reduction::FixedOrder => fixed_all_reduce(&self.comm, buf),
        }
    }

    /// The whole parameters from the shards' stored values.
    fn gather_params(&self) -> Result<Vec<Vec<f32>>, DistError> {
        let l = &self.layout;
        let (world, rank, per) = (l.world(), self.comm.rank(), l.per_rank());
        let mut mine = vec![0f32; per];
        let mut out: Vec<Vec<f32>> = self.numels.iter().map(|&n| vec![0f32; n]).collect();
        for (p, shards) in self.local.iter().enumerate() {
            for (id, range) in shards {
                let mut v = vec![0f32; range.len()];
                self.opt.read(*id, SlotKind::Param, &mut v)?;
                match l.flat_offset(p) {
                    Some(o) => {
                        let at = o + range.start - rank * per;
                        mine[at..at + v.len()].copy_from_slice(&v);
                    }
                    None => out[p] = v,
                }
            }
        }
        let mut flat = vec![0f32; l.flat_len()];
        self.comm
            .all_gather_f32(&mine, &mut flat, &vec![per; world])?;
        for (p, values) in out.iter_mut().enumerate() {
            match l.flat_offset(p) {
                Some(o) => {
                    let n = values.len();
                    values.copy_from_slice(&flat[o..o + n]);
                }
                None => {
                    // Its owner's values, to everyone.
                    let owner = l.owners(p)[0].0;
                    let mut counts = vec![0usize; world];
                    counts[owner] = values.len();
                    let send = if rank == owner {
                        values.clone()
                    } else {
                        Vec::new()
                    };
                    self.comm.all_gather_f32(&send, values, &counts)?;
                }
            }
        }
        Ok(out)
    }

    /// Writes the canonical, unsharded checkpoint (the format `Optimizer::save` writes, readable
    /// by `Optimizer::load` and `Canonical::read`) from every rank's shards; rank 0 writes the
    /// file. Every rank must call it.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), DistError> {
        let local = Parts::of(&self.opt).canonical(None)?;
        // This rank's shards: (param, start, counters, rule state, the slots).
        let mut blob = Vec::new();
        for (k, c) in local.params.iter().enumerate() {
            let p = self.owner[k];
            let start = self.local[p]
                .iter()
                .find(|(id, _)| id.index() == k)
                .map(|(_, r)| r.start)
                .unwrap_or(0);
            blob.extend((p as u64).to_le_bytes());
            blob.extend((start as u64).to_le_bytes());
            blob.extend(c.steps.to_le_bytes());
            blob.extend(c.accumulations.to_le_bytes());
            blob.push(u8::from(c.pending));
            let (tag, factor) = match c.lr_rule {
                LrRule::Group => (0u8, 0.0),
                LrRule::Scaled(f) => (1, f),
                LrRule::Fixed => (2, 0.0),
            };
            blob.push(tag);
            blob.extend(factor.to_le_bytes());
            for x in c.rule_state.0 {
                blob.extend(x.to_le_bytes());
            }
            for s in &c.slots {
                let bytes = slots::encode(s);
                blob.extend((bytes.len() as u64).to_le_bytes());
                blob.extend(bytes);
            }
        }
        let all = self.gather_bytes(&blob)?;
        let mut result = Ok(());
        if self.comm.rank() == 0 {
            result = self
                .assemble(&all)
                .and_then(|c| c.write(path.as_ref()).map_err(DistError::from));
        }
        // Every rank learns whether the file was written.
        let mut failed = [i64::from(result.is_err())];
        self.comm.all_reduce_sum_i64(&mut failed)?;
        match result {
            Err(e) => Err(e),
            Ok(()) if failed[0] != 0 => Err(DistError::Checkpoint(
                "rank 0 could not write the checkpoint".into(),
            )),
            Ok(()) => Ok(()),
        }
    }

    /// Every rank's bytes, in rank order.
    fn gather_bytes(&self, blob: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let world = self.comm.world();
        let mut lens = vec![0i64; world];
        lens[self.comm.rank()] = blob.len() as i64;
        self.comm.all_reduce_sum_i64(&mut lens)?;
        let counts: Vec<usize> = lens.iter().map(|&n| n as usize).collect();
        let mut all = vec![0u8; counts.iter().sum()];
        self.comm.all_gather_u8(blob, &mut all, &counts)?;
        let mut out = Vec::with_capacity(world);
        let mut at = 0;
        for c in counts {
            out.push(all[at..at + c].to_vec());
            at += c;
        }
        Ok(out)
    }

    fn assemble(&self, blobs: &[Vec<u8>]) -> Result<Canonical, DistError> {
        struct Part {
            start: usize,
            steps: u64,
            accumulations: u64,
            pending: bool,
            lr_rule: LrRule,
            rule_state: RuleState,
            slots: Vec<lpmm_optim::HostSlot>,
        }
        let mut parts: Vec<Vec<Part>> = (0..self.defs.len()).map(|_| Vec::new()).collect();
        let bad = || DistError::Checkpoint("truncated shard bytes".into());
        for blob in blobs {
            let mut at = 0usize;
            let u64_at = |at: &mut usize| -> Result<u64, DistError> {
                let v = blob.get(*at..*at + 8).ok_or_else(bad)?;
                *at += 8;
                Ok(u64::from_le_bytes(v.try_into().expect("8 bytes")))
            };
            while at < blob.len() {
                let p = u64_at(&mut at)? as usize;
                let start = u64_at(&mut at)? as usize;
                let steps = u64_at(&mut at)?;
                let accumulations = u64_at(&mut at)?;
                let pending = *blob.get(at).ok_or_else(bad)? != 0;
                let tag = *blob.get(at + 1).ok_or_else(bad)?;
                at += 2;
                let factor = f64::from_bits(u64_at(&mut at)?);
                let lr_rule = match tag {
                    0 => LrRule::Group,
                    1 => LrRule::Scaled(factor),
                    _ => LrRule::Fixed,
                };
                let rule_state = RuleState([
                    f64::from_bits(u64_at(&mut at)?),
                    f64::from_bits(u64_at(&mut at)?),
                ]);
                let mut s = Vec::with_capacity(SLOTS);
                for k in 0..SLOTS {
                    let n = u64_at(&mut at)? as usize;
                    let specs = self.saved_regions(p, k).ok_or_else(bad)?;
                    s.push(slots::decode(
                        blob.get(at..at + n).ok_or_else(bad)?,
                        &specs,
                    )?);
                    at += n;
                }
                parts.get_mut(p).ok_or_else(bad)?.push(Part {
                    start,
                    steps,
                    accumulations,
                    pending,
                    lr_rule,
                    rule_state,
                    slots: s,
                });
            }
        }
        let mut params = Vec::with_capacity(self.defs.len());
        for (p, mut ps) in parts.into_iter().enumerate() {
            ps.sort_by_key(|x| x.start);
            let first = ps.first().ok_or_else(|| {
                DistError::Checkpoint(format!("no rank holds {}", self.defs[p].name))
            })?;
            let (steps, accumulations, pending, lr_rule, rule_state) = (
                first.steps,
                first.accumulations,
                first.pending,
                first.lr_rule,
                first.rule_state,
            );
            let mut per_slot: [Vec<lpmm_optim::HostSlot>; SLOTS] = Default::default();
            for part in ps {
                for (k, s) in part.slots.into_iter().enumerate() {
                    per_slot[k].push(s);
                }
            }
            let mut joined = Vec::with_capacity(SLOTS);
            for v in per_slot {
                joined.push(slots::join(v)?);
            }
            let d = &self.defs[p];
            params.push(CanonicalParam {
                name: d.name.clone(),
                shape: d.shape.clone(),
                group: d.group,
                requested: d.config.unwrap_or(self.groups[d.group]),
                steps,
                accumulations,
                pending,
                lr_rule,
                rule_state,
                slots: joined.try_into().map_err(|_| bad())?,
            });
        }
        Ok(Canonical {
            options: self.opt_options(),
            global_steps: self.opt.status().steps,
            groups: self.groups.clone(),
            params,
            eval: false,
        })
    }

    /// The saved regions of slot `k` of parameter `p` (None for an unknown parameter).
    fn saved_regions(&self, p: usize, k: usize) -> Option<Vec<lpmm_optim::backend::RegionSpec>> {
        let d = self.defs.get(p)?;
        let config = d
            .config
            .unwrap_or(*self.groups.get(d.group)?)
            .resolve(self.numels[p], &d.shape);
        Some(
            config.formats()[k]
                .map(|f| {
                    f.regions(&d.shape)
                        .into_iter()
                        .filter(|r| r.saved)
                        .collect()
                })
                .unwrap_or_default(),
        )
    }

    /// [`ShardedOptimizer::load`] with this rank's shards on `backend`.
    pub fn load_with(
        backend: B,
        comm: C,
        path: impl AsRef<Path>,
        shard: ShardOptions,
    ) -> Result<Self, DistError> {
        let c = Canonical::read(path.as_ref())?;
        if c.eval {
            return Err(DistError::Checkpoint(
                "the checkpoint holds the parameters at their evaluation point (schedule-free Mode::Eval): the sharded optimizer steps in training mode; load it with Canonical::read(path)?.into_optimizer(Cpu), call set_mode(Mode::Train, ..) and save it again".into(),
            ));
        }
        let defs: Vec<ParamDef> = c
            .params
            .iter()
            .map(|p| ParamDef {
                name: p.name.clone(),
                shape: p.shape.clone(),
                group: p.group,
                config: (Some(p.requested) != c.groups.get(p.group).copied())
                    .then_some(p.requested),
            })
            .collect();
        let mut s = Self::skeleton(backend, comm, c.options, shard, c.groups.clone(), defs)?;
        s.register(|_, range| vec![0f32; range.len()])?;
        PartsMut::of(&mut s.opt).set_steps(c.global_steps)?;
        for (p, cp) in c.params.iter().enumerate() {
            for (id, range) in s.local[p].clone() {
                PartsMut::of(&mut s.opt).restore(
                    id,
                    cp.steps,
                    cp.accumulations,
                    cp.pending,
                    cp.lr_rule,
                )?;
                PartsMut::of(&mut s.opt).restore_rule_state(id, cp.rule_state)?;
                for (k, slot) in SlotKind::ALL.into_iter().enumerate() {
                    let host = slots::slice(&cp.slots[k], range.clone(), s.numels[p])?;
                    PartsMut::of(&mut s.opt).import_slot(id, slot, &host, None)?;
                }
            }
        }
        s.params = s.gather_params()?;
        Ok(s)
    }
}

/// The summed gradients a rank needs: its part of the flat space, and the whole parameters.
struct Reduced {
    mine: Vec<f32>,
    base: usize,
    whole: Vec<f32>,
    whole_at: Vec<usize>,
    flat: Vec<Option<usize>>,
}

impl Reduced {
    /// Elements `r` of parameter `p` (a range this rank holds).
    fn get(&self, p: usize, r: Range<usize>) -> &[f32] {
        match self.flat[p] {
            Some(o) => &self.mine[o + r.start - self.base..o + r.end - self.base],
            None => &self.whole[self.whole_at[p] + r.start..self.whole_at[p] + r.end],
        }
    }
}

/// Rank `q` sends `send[r * per .. (r + 1) * per]` to rank `r`; each rank sums what it receives in
/// rank order (rank 0's value first). Deterministic whatever the library.
pub fn fixed_reduce_scatter<C: Collective + ?Sized>(
    comm: &C,
    send: &[f32],
    per: usize,
) -> Result<Vec<f32>, DistError> {
    let world = comm.world();
    if send.len() != world * per {
        return Err(DistError::Collective(format!(
            "reduce-scatter of {} elements in {world} parts of {per}",
            send.len()
        )));
    }
    let counts = vec![vec![per; world]; world];
    let mut recv = vec![0f32; world * per];
    comm.all_to_all_f32(send, &mut recv, &counts)?;
    let mut out = recv[..per].to_vec();
    for q in 1..world {
        for (o, x) in out.iter_mut().zip(&recv[q * per..(q + 1) * per]) {
            *o += x;
        }
    }
    Ok(out)
}

/// [`fixed_reduce_scatter`] then an all-gather: every element summed in rank order.
pub fn fixed_all_reduce<C: Collective + ?Sized>(
    comm: &C,
    buf: &mut [f32],
) -> Result<(), DistError> {
    let world = comm.world();
    let per = buf.len().div_ceil(world.max(1));
    let mut padded = buf.to_vec();
    padded.resize(per * world, 0.0);
    let mine = fixed_reduce_scatter(comm, &padded, per)?;
    let mut all = vec![0f32; per * world];
    comm.all_gather_f32(&mine, &mut all, &vec![per; world])?;
    buf.copy_from_slice(&all[..buf.len()]);
    Ok(())
}

/// The sum in rank order that [`Reduction::FixedOrder`] forms: `parts[0] + parts[1] + ...`.
pub fn rank_order_sum(parts: &[&[f32]]) -> Vec<f32> {
    let mut out = parts.first().map(|p| p.to_vec()).unwrap_or_default();
    for p in &parts[1.min(parts.len())..] {
        for (o, x) in out.iter_mut().zip(p.iter()) {
            *o += x;
        }
    }
    out
}
