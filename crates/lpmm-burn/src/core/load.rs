//! Loading a state into the whole-module optimizer: a record or checkpoint attached to a module
//! (parameters registered in the checkpoint's order, every slot imported, values written into the
//! module's tensors), and the canonical layout of the whole state for saving.

use lpmm_optim::Out;
use std::collections::HashMap;

use burn_core::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId as BurnId};
use burn_core::tensor::Tensor;
use lpmm_optim::backend::{Dtype, HostRegion, HostSlot, HostValues};
use lpmm_optim::{Lender, OptimError, ParamId, SlotKind, backend::Backend, checkpoint::Canonical};

use super::{Core, Ctx, Pending, optimizer, to_optim};
use crate::BurnError;
use crate::lane::Lane;
use crate::persist;

impl<L: Lane> Core<L> {
    /// Replaces this (empty) optimizer's state with a loaded one, matched to `module`'s
    /// parameters by burn's `ParamId`s: registered in the checkpoint's order (which keys their
    /// random streams), every slot imported, values the record holds written into the module's
    /// tensors.
    pub fn attach<M: Module>(&mut self, module: M, pending: Pending) -> Result<M, BurnError> {
        if self.opt.status().params > self.external.len() {
            return Err(BurnError::Record(
                "the optimizer has stepped already: load a record into a new optimizer".into(),
            ));
        }
        let external = std::mem::take(&mut self.external);
        let Pending {
            canonical: c,
            from_module,
        } = pending;
        let mut collect = Collect::<L> {
            lane: &self.lane,
            prims: HashMap::new(),
            error: None,
        };
        module.visit(&mut collect);
        let Collect {
            mut prims, error, ..
        } = collect;
        if let Some(e) = error {
            return Err(e);
        }
        self.opt = optimizer(&self.lane, c.options)?;
        self.index.clear();
        self.burn_ids.clear();
        self.groups.clear();
        self.shapes.clear();
        self.held.clear();
        self.external.clear();
        let fresh = &mut *self;
        for g in &c.groups {
            fresh.opt.add_group(*g)?;
        }
        // Parameter-slot imports that write into the module's tensors.
        let mut writes: HashMap<BurnId, (ParamId, HostSlot)> = HashMap::new();
        for (p, &from_module) in c.params.iter().zip(&from_module) {
            let bad = |reason: String| BurnError::Record(format!("parameter {}: {reason}", p.name));
            let id: BurnId = p
                .name
                .parse::<u64>()
                .map_err(|_| bad("its name is not a burn ParamId".into()))?
                .into();
            if let Some(shape) = external.get(&id) {
                // A layer weight: held by lpmm, every slot in the record.
                if *shape != p.shape {
                    return Err(bad(format!(
                        "the record's shape {:?} is not the layer's {:?}",
                        p.shape, shape
                    )));
                }
                let zeros = vec![0f32; shape.iter().product()];
                let lid = fresh
                    .opt
                    .add_param_with(&p.name, shape, &zeros, p.group, p.requested)?;
                fresh.index.insert(id, lid);
                fresh.burn_ids.push(id);
                fresh.groups.push(p.group);
                fresh.shapes.push(shape.clone());
                fresh.held.push(true);
                fresh.external.insert(id, shape.clone());
                persist::restore_counters(&mut fresh.opt, lid, p)?;
                for (slot, host) in SlotKind::ALL.into_iter().zip(&p.slots) {
                    persist::import_slot(&mut fresh.opt, lid, slot, host, None)?;
                }
                continue;
            }
            let (shape, prim) = prims
                .get_mut(&id)
                .ok_or_else(|| bad("the module has no parameter with this ParamId".into()))?;
            if *shape != p.shape {
                return Err(bad(format!(
                    "the record's shape {:?} is not the module's {:?}",
                    p.shape, shape
                )));
            }
            let lid = fresh.add(id, prim, &p.shape, p.group, p.requested)?;
            let held = fresh.held[lid.index()];
            if held && from_module {
                return Err(bad(
                    "the record leaves its value to the module's tensor, whose dtype does not hold its storage"
                        .into(),
                ));
            }
            persist::restore_counters(&mut fresh.opt, lid, p)?;
            for (slot, host) in SlotKind::ALL.into_iter().zip(&p.slots) {
                match slot {
                    SlotKind::Param if !held => {
                        let primary = host.region("").is_some();
                        let others = host.regions.iter().any(|r| !r.spec.suffix.is_empty());
                        // A primary region the record holds, or other regions (a Kahan
                        // compensation, a split remainder), are written; the module's own value
                        // alone needs nothing.
                        if primary || others {
                            writes.insert(id, (lid, host.clone()));
                        }
                    }
                    _ => persist::import_slot(&mut fresh.opt, lid, slot, host, None)?,
                }
            }
        }
        persist::set_global_steps(&mut fresh.opt, c.global_steps)?;
        drop(prims);
        if let Some(id) = external.keys().find(|id| !fresh.external.contains_key(id)) {
            return Err(BurnError::Record(format!(
                "the record has no state for layer weight {}: it is another model's",
                id.val()
            )));
        }
        let module = if writes.is_empty() {
            module
        } else {
            let mut apply = Apply {
                core: self,
                work: Work::Import(writes),
                parts: HashMap::new(),
                error: None,
            };
            let module = module.map(&mut apply);
            if let Some(e) = apply.error {
                return Err(e);
            }
            module
        };
        let held: HashMap<BurnId, ParamId> = self
            .burn_ids
            .iter()
            .zip(&self.held)
            .filter(|(b, h)| **h && !self.external.contains_key(b))
            .map(|(b, _)| (*b, self.index[b]))
            .collect();
        if held.is_empty() {
            Ok(module)
        } else {
            self.write_back(module, held)
        }
    }

    /// Read-only primitives of `module`'s parameters (prepared for reading), by burn id.
    pub fn collect<M: Module>(&self, module: &M) -> Result<HashMap<BurnId, L::Prim>, BurnError> {
        let mut collect = Collect::<L> {
            lane: &self.lane,
            prims: HashMap::new(),
            error: None,
        };
        module.visit(&mut collect);
        if let Some(e) = collect.error {
            return Err(e);
        }
        let mut prims = HashMap::new();
        for (id, (_, mut prim)) in collect.prims {
            self.lane.prepare(&mut prim, false)?;
            prims.insert(id, prim);
        }
        Ok(prims)
    }

    /// The whole state in the canonical layout. With the module's `prims`, lent parameters'
    /// values are read from its tensors; without, their primary regions are zeros (the module
    /// record holds them).
    pub fn canonical(
        &self,
        prims: Option<HashMap<BurnId, L::Prim>>,
    ) -> Result<Canonical, BurnError> {
        let mut lender = ModuleLender::<L> {
            core: self,
            prims: prims.unwrap_or_default(),
        };
        Ok(persist::canonical_lent(&self.opt, &mut lender)?)
    }
}

/// Lends the module's tensors (or zeros without a module) to `Optimizer::canonical_lent`.
struct ModuleLender<'a, L: Lane> {
    core: &'a Core<L>,
    prims: HashMap<BurnId, L::Prim>,
}

impl<L: Lane> Lender<L::B> for ModuleLender<'_, L> {
    fn lend(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(<L::B as Backend>::Input<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError> {
        let burn = self
            .core
            .burn_ids
            .get(id.index())
            .ok_or_else(|| OptimError::UnknownParam(format!("#{}", id.index())))?;
        if let Some(prim) = self.prims.get(burn) {
            let input = self.core.lane.input(prim).map_err(to_optim)?;
            return f(input);
        }
        // No module: zeros of the parameter's dtype stand in for its primary region.
        let config = self.core.opt.param(id)?.config;
        let numel = self
            .core
            .shapes
            .get(id.index())
            .map_or(0, |s| s.iter().product());
        let backend = self.core.lane.backend();
        match config.param.format().and_then(|f| f.lendable()) {
            Some(Dtype::Bf16) => {
                let zeros = vec![lpmm_formats::bf16::ZERO; numel];
                f(backend.host_input(HostValues::Bf16(&zeros)))
            }
            _ => {
                let zeros = vec![0f32; numel];
                f(backend.host_input(HostValues::F32(&zeros)))
            }
        }
    }

    fn lend_mut(
        &mut self,
        id: ParamId,
        _f: &mut dyn FnMut(<L::B as Backend>::Output<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError> {
        Err(OptimError::Lent {
            param: format!("#{}", id.index()),
            reason: "lpmm-burn lends parameters read-only here".into(),
        })
    }
}

/// What [`Apply`] does to each parameter it maps.
pub(super) enum Work {
    /// Writes the decoded value of a parameter lpmm holds into its tensor.
    Decode,
    /// Imports a loaded parameter slot, whose primary region goes into the tensor.
    Import(HashMap<BurnId, (ParamId, HostSlot)>),
}

/// Each parameter's tensor, taken out of the module (so it is not shared), lent to lpmm for
/// writing, and put back with its autodiff state.
pub(super) struct Apply<'a, L: Lane> {
    pub core: &'a mut Core<L>,
    pub work: Work,
    pub parts: HashMap<BurnId, ParamId>,
    pub error: Option<BurnError>,
}

impl<L: Lane> Apply<'_, L> {
    fn apply<const D: usize>(
        &mut self,
        lid: ParamId,
        host: Option<HostSlot>,
        t: Tensor<D>,
    ) -> Result<Tensor<D>, BurnError> {
        let core = &mut *self.core;
        let mut p = core.lane.take(t)?;
        if core.lane.prepare(&mut p, true)? {
            core.copies += 1;
        }
        match (&self.work, host) {
            (Work::Decode, _) => {
                let out = core.lane.output(&mut p)?;
                core.opt.read(lid, SlotKind::Param, Out::Backend(out))?;
            }
            (Work::Import(_), Some(mut host)) => {
                if host.region("").is_none() {
                    // The module's value is the primary region.
                    let bytes = core.lane.to_host_bytes(&p)?;
                    let spec = core
                        .opt
                        .param(lid)?
                        .config
                        .param
                        .format()
                        .and_then(|f| {
                            let shape = &core.shapes[lid.index()];
                            f.regions(shape).into_iter().find(|r| r.suffix.is_empty())
                        })
                        .ok_or_else(|| BurnError::Record("no primary region".into()))?;
                    host.regions.insert(0, HostRegion { spec, bytes });
                }
                let out = core.lane.output(&mut p)?;
                persist::import_slot(&mut core.opt, lid, SlotKind::Param, &host, Some(out))?;
            }
            (Work::Import(_), None) => {}
        }
        core.lane.settle()?;
        Ok(core.lane.give(p))
    }
}

impl<L: Lane> ModuleMapper for Apply<'_, L> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let (lid, host) = match &mut self.work {
            Work::Import(writes) => match writes.remove(&param.id) {
                Some((lid, host)) => (lid, Some(host)),
                None => return param,
            },
            Work::Decode => match self.parts.remove(&param.id) {
                Some(lid) => (lid, None),
                None => return param,
            },
        };
        let (id, tensor, mapper) = param.consume();
        let ctx = Ctx::capture(&tensor);
        let (dims, device) = (tensor.dims(), tensor.device().inner());
        let out = match self.apply(lid, host, tensor.inner()) {
            Ok(t) => t,
            Err(e) => {
                self.error = Some(e);
                // The step fails and the module is dropped; any value will do.
                Tensor::zeros(dims, &device)
            }
        };
        Param::from_mapped_value(id, ctx.restore(out, id), mapper)
    }
}

/// Read-only primitives of every float parameter, by burn id.
struct Collect<'a, L: Lane> {
    lane: &'a L,
    prims: HashMap<BurnId, (Vec<usize>, L::Prim)>,
    error: Option<BurnError>,
}

impl<L: Lane> ModuleVisitor for Collect<'_, L> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() || self.prims.contains_key(&param.id) {
            return;
        }
        let t = param.val().inner();
        if !self.lane.owns(&t.device()) {
            return;
        }
        let shape = t.dims().to_vec();
        match self.lane.take(t) {
            Ok(p) => {
                self.prims.insert(param.id, (shape, p));
            }
            Err(e) => self.error = Some(e),
        }
    }
}
