//! The optimizer over one lane: registration of a module's parameters, the whole-module step
//! (gradients accumulated, the global decision, then each parameter stepped in its own tensor),
//! and attaching a loaded state to a module.

use lpmm_optim::{Out, Parts, PartsMut};
use std::collections::{HashMap, HashSet};

use burn_core::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId as BurnId};
use burn_core::tensor::{GradientCheckpointingStrategy, Tensor};
use burn_optim::GradientsParams;
use burn_optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use lpmm_optim::backend::{Dtype, HostRegion, HostSlot, HostValues};
use lpmm_optim::{
    Gradients, Lender, MissingGradientPolicy, OptimError, Optimizer, ParamConfig, ParamId,
    SlotKind, StepReport, Storage, WithGradient, backend::Backend, checkpoint::Canonical,
};

use crate::BurnError;
use crate::lane::Lane;

mod visit;
pub(crate) use visit::Uncovered;
use visit::*;

/// A loaded state waiting for its module: the canonical layout, where the parameter slot of a
/// parameter that lives in the module's tensor may lack its primary region (burn records leave it
/// to the module record).
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub canonical: Canonical,
    /// Per parameter: its primary region is the module tensor's (not in the record).
    pub from_module: Vec<bool>,
}

/// The lpmm optimizer on one lane, with the map from burn's parameter ids.
pub(crate) struct Core<L: Lane> {
    pub lane: L,
    pub opt: Optimizer<L::B>,
    pub index: HashMap<BurnId, ParamId>,
    pub burn_ids: Vec<BurnId>,
    /// The lpmm group of each parameter (one per parameter, so each takes its own learning rate).
    pub groups: Vec<usize>,
    /// The shape of each parameter.
    pub shapes: Vec<Vec<usize>>,
    /// lpmm holds the parameter in its own storage; the module's tensor gets its decoded value
    /// after each step.
    pub held: Vec<bool>,
    /// Private copies made because a tensor was shared or not contiguous.
    pub copies: u64,
    /// Weights of [`crate::LpmmLinear`] layers: held by lpmm, not module parameters, with
    /// their shapes.
    pub external: HashMap<BurnId, Vec<usize>>,
}

/// The id of the `n`th layer weight an optimizer holds: deterministic, so the same model built
/// in another process names its weights alike (module records cannot: they are not module
/// parameters).
pub(crate) fn external_id(n: usize) -> BurnId {
    BurnId::from(0x4C50_4D4D_0000_0000 | n as u64)
}

impl<L: Lane> std::fmt::Debug for Core<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("lane", &self.lane.name())
            .field("params", &self.burn_ids.len())
            .field("copies", &self.copies)
            .finish()
    }
}

/// The autodiff state a parameter carries, put back on its updated value (as burn's own
/// optimizers do).
struct Ctx {
    require_grad: bool,
    checkpointing: Option<GradientCheckpointingStrategy>,
    distributed: bool,
}

impl Ctx {
    fn capture<const D: usize>(t: &Tensor<D>) -> Self {
        Ctx {
            require_grad: t.is_require_grad(),
            checkpointing: t.gradient_checkpointing_strategy(),
            distributed: t.is_distributed(),
        }
    }

    fn restore<const D: usize>(self, t: Tensor<D>, id: BurnId) -> Tensor<D> {
        let mut p = Tensor::from_inner(t);
        if let Some(s) = self.checkpointing {
            p = p.with_gradient_checkpointing_strategy(s);
        }
        if self.require_grad {
            p = p.require_grad();
        }
        if self.distributed {
            p = p.set_distributed(id);
        }
        p
    }
}

fn label(id: BurnId, path: &str) -> String {
    if path.is_empty() {
        format!("{}", id.val())
    } else {
        format!("{} ({path})", id.val())
    }
}

/// The optimizer core on `lane`. Its own missing-gradient check is off: it sees only the
/// parameters registered (at their first gradient), so lpmm-burn checks the module's instead
/// ([`Uncovered`]).
fn optimizer<L: Lane>(
    lane: &L,
    options: lpmm_optim::OptimizerOptions,
) -> Result<Optimizer<L::B>, BurnError> {
    let mut opt = Optimizer::with_backend(lane.backend().clone(), options)?;
    opt.settings_mut().missing_gradient = MissingGradientPolicy::Ignore;
    Ok(opt)
}

impl<L: Lane> Core<L> {
    pub fn new(lane: L, options: lpmm_optim::OptimizerOptions) -> Result<Self, BurnError> {
        let opt = optimizer(&lane, options)?;
        Ok(Core {
            lane,
            opt,
            index: HashMap::new(),
            burn_ids: Vec::new(),
            groups: Vec::new(),
            shapes: Vec::new(),
            held: Vec::new(),
            copies: 0,
            external: HashMap::new(),
        })
    }

    /// Counts the layer weights ([`crate::LpmmLinear`]) in `checked` and adds those that
    /// received no gradient in the backward pass to `missing` (in id order); returns the number
    /// of the next step.
    pub fn uncovered_weights(
        &self,
        checked: &mut usize,
        missing: &mut Vec<String>,
    ) -> Result<u64, BurnError> {
        let mut weights: Vec<BurnId> = self.external.keys().copied().collect();
        weights.sort_by_key(|id| id.val());
        for id in weights {
            *checked += 1;
            if !self
                .opt
                .param(self.index[&id])
                .map(|p| p.received_gradient)?
            {
                missing.push(format!("{} (an LpmmLinear weight)", id.val()));
            }
        }
        Ok(self.opt.status().steps + 1)
    }

    /// Registers a layer weight (held by lpmm in `config`'s storage) from `t`'s values. Its
    /// gradient is added into lpmm's accumulator during the backward pass, so a configuration
    /// without one (gradient storage `None`: burn's gradients read in place) gets an f32
    /// accumulator for layer weights.
    pub fn add_external(
        &mut self,
        t: Tensor<2>,
        mut config: ParamConfig,
    ) -> Result<BurnId, BurnError> {
        if config.grad == Storage::None {
            config.grad = Storage::F32;
        }
        let id = external_id(self.external.len());
        let shape = t.dims().to_vec();
        let prim = self.lane.take(t)?;
        let host = self.lane.to_host(&prim)?;
        drop(prim);
        let group = self.opt.add_group(config)?;
        let lid = self
            .opt
            .add_param_with(&id.val().to_string(), &shape, &host, group, config)?;
        self.index.insert(id, lid);
        self.burn_ids.push(id);
        self.groups.push(group);
        self.shapes.push(shape.clone());
        self.held.push(true);
        self.external.insert(id, shape);
        Ok(id)
    }

    /// A layer weight's value, decoded into a new tensor on `device`.
    pub fn decode_external(
        &mut self,
        id: BurnId,
        device: &burn_core::tensor::Device,
    ) -> Result<Tensor<2>, BurnError> {
        let (lid, shape) = self.external_lid(id)?;
        let t = Tensor::<2>::empty([shape[0], shape[1]], device);
        let mut p = self.lane.take(t)?;
        self.lane.prepare(&mut p, true)?;
        {
            let out = self.lane.output(&mut p)?;
            self.opt.read(lid, SlotKind::Param, Out::Backend(out))?;
        }
        self.lane.settle()?;
        Ok(self.lane.give(p))
    }

    /// Adds a layer weight's gradient to its accumulator.
    pub fn accumulate_external(&mut self, id: BurnId, grad: Tensor<2>) -> Result<(), BurnError> {
        let (lid, _) = self.external_lid(id)?;
        let mut g = self.lane.take(grad)?;
        self.lane.prepare(&mut g, false)?;
        self.opt
            .accumulate(lid, lpmm_optim::Grad::Input(self.lane.input(&g)?))?;
        self.lane.settle()?;
        Ok(())
    }

    fn external_lid(&self, id: BurnId) -> Result<(ParamId, Vec<usize>), BurnError> {
        match (self.index.get(&id), self.external.get(&id)) {
            (Some(&lid), Some(shape)) if shape.len() == 2 => Ok((lid, shape.clone())),
            _ => Err(BurnError::param(
                id.val(),
                "not a layer weight of this optimizer",
            )),
        }
    }

    /// Whether `config`'s parameter storage lives in a tensor of `dtype`.
    fn lends(config: &ParamConfig, numel: usize, shape: &[usize], dtype: Option<Dtype>) -> bool {
        let want = config
            .resolve(numel, shape)
            .param
            .format()
            .and_then(|f| f.lendable());
        want.is_some() && want == dtype
    }

    /// Registers `prim` (the tensor of parameter `id`, read-only) under `group` with `config`.
    fn add(
        &mut self,
        id: BurnId,
        prim: &mut L::Prim,
        shape: &[usize],
        group: usize,
        config: ParamConfig,
    ) -> Result<ParamId, BurnError> {
        let numel: usize = shape.iter().product();
        let name = id.val().to_string();
        let lent = Self::lends(&config, numel, shape, self.lane.dtype(prim));
        let lid = if lent {
            self.lane.prepare(prim, false)?;
            let values = self.lane.input(prim)?;
            let lid = self
                .opt
                .add_lent_param(&name, shape, values, group, config)?;
            self.lane.settle()?;
            lid
        } else {
            let host = self.lane.to_host(prim)?;
            self.opt
                .add_param_with(&name, shape, &host, group, config)?
        };
        self.index.insert(id, lid);
        self.burn_ids.push(id);
        self.groups.push(group);
        self.shapes.push(shape.to_vec());
        self.held.push(!lent);
        Ok(lid)
    }

    /// One step of the whole module with `grads`, taken straight from burn's gradient tensors
    /// (`Optimizer::step` with `Step::given`): the global decision (clipping, skip) over all of them and
    /// the layer weights' accumulated gradients, then each parameter stepped in its own tensor,
    /// each gradient dropped as soon as its parameter has stepped.
    pub fn step<M: Module>(
        &mut self,
        base: &ParamConfig,
        lr: &ModuleLearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<(M, StepReport), BurnError> {
        let mut gather = Gather {
            core: self,
            grads: &mut grads,
            lr,
            base,
            path: Vec::new(),
            given: HashMap::new(),
            error: None,
        };
        module.visit(&mut gather);
        let Gather { given, error, .. } = gather;
        if let Some(e) = error {
            return Err(e);
        }
        // Gradients of tensors that are not the module's parameters (none in a plain loop).
        drop(grads);
        for id in self.external.keys() {
            let lid = self.index[id];
            self.opt
                .set_group_lr(self.groups[lid.index()], lr.lr_from_param(*id, None))?;
        }
        let (mut lent, mut held) = (HashMap::new(), HashMap::new());
        for &lid in given.keys() {
            let id = self.burn_ids[lid.index()];
            if self.held[lid.index()] {
                held.insert(id, lid);
            } else {
                lent.insert(id, lid);
            }
        }
        // The lent parameters' tensors, taken out of the module for the step.
        let mut take = Take {
            core: self,
            parts: lent,
            prims: HashMap::new(),
            shared: true,
            error: None,
        };
        let module = module.map(&mut take);
        let Take {
            prims,
            shared,
            error,
            ..
        } = take;
        if let Some(e) = error {
            return Err(e);
        }
        let mut gradients = GivenGrads::<L> {
            lane: &self.lane,
            prims: given,
        };
        let mut lender = StepLender::<L> {
            lane: &self.lane,
            prims,
        };
        let result = self.opt.step(
            lpmm_optim::Step::given(&mut gradients).lent(lpmm_optim::Lent::Lender(&mut lender)),
        );
        drop(gradients);
        self.lane.settle()?;
        let report = result?;
        let module = if shared {
            // The module holds tensors sharing the memory lpmm wrote.
            drop(lender);
            module
        } else {
            let mut put = Restore::<L> {
                lane: &self.lane,
                prims: lender
                    .prims
                    .into_iter()
                    .map(|(lid, p)| (self.burn_ids[lid.index()], p))
                    .collect(),
            };
            module.map(&mut put)
        };
        let module = if !report.skipped && !held.is_empty() {
            self.write_back(module, held)?
        } else {
            module
        };
        Ok((module, report))
    }

    /// Writes the decoded values of the parameters lpmm holds into the module's tensors.
    fn write_back<M: Module>(
        &mut self,
        module: M,
        parts: HashMap<BurnId, ParamId>,
    ) -> Result<M, BurnError> {
        let mut apply = Apply {
            core: self,
            work: Work::Decode,
            parts,
            error: None,
        };
        let module = module.map(&mut apply);
        match apply.error {
            Some(e) => Err(e),
            None => Ok(module),
        }
    }

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
                PartsMut::of(&mut fresh.opt).restore(
                    lid,
                    p.steps,
                    p.accumulations,
                    p.pending,
                    p.lr_rule,
                )?;
                PartsMut::of(&mut fresh.opt).restore_rule_state(lid, p.rule_state)?;
                for (slot, host) in SlotKind::ALL.into_iter().zip(&p.slots) {
                    PartsMut::of(&mut fresh.opt).import_slot(lid, slot, host, None)?;
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
            PartsMut::of(&mut fresh.opt).restore(
                lid,
                p.steps,
                p.accumulations,
                p.pending,
                p.lr_rule,
            )?;
            PartsMut::of(&mut fresh.opt).restore_rule_state(lid, p.rule_state)?;
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
                    _ => PartsMut::of(&mut fresh.opt).import_slot(lid, slot, host, None)?,
                }
            }
        }
        PartsMut::of(&mut fresh.opt).set_steps(c.global_steps)?;
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
        Ok(Parts::of(&self.opt).canonical(Some(&mut lender))?)
    }
}

/// Lends the module's tensors (or zeros without a module) to `Parts::canonical`.
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

fn to_optim(e: BurnError) -> OptimError {
    match e {
        BurnError::Optim(o) => o,
        other => OptimError::Lent {
            param: String::new(),
            reason: other.to_string(),
        },
    }
}
