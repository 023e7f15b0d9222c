//! The optimizer over one lane: registration of a module's parameters, the whole-module step
//! (gradients accumulated, the global decision, then each parameter stepped in its own tensor),
//! and attaching a loaded state to a module.

use lpmm_optim::Out;
use std::collections::{HashMap, HashSet};

use burn_core::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId as BurnId};
use burn_core::tensor::{GradientCheckpointingStrategy, Tensor};
use burn_optim::GradientsParams;
use burn_optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use lpmm_optim::backend::Dtype;
use lpmm_optim::{
    Gradients, Lender, MissingGradientPolicy, OptimError, Optimizer, ParamConfig, ParamId,
    SlotKind, StepReport, Storage, WithGradient, backend::Backend, checkpoint::Canonical,
};

use crate::BurnError;
use crate::lane::Lane;

mod load;

use load::{Apply, Work};

/// A loaded state waiting for its module: the canonical layout, where the parameter slot of a
/// parameter that lives in the module's tensor may lack its primary region (burn records leave it
/// to the module record).
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub canonical: Canonical,
    /// Per parameter: its primary region is the module tensor's (not in the record).
    pub from_module: Vec<bool>,
}

/// The configuration each parameter is registered with: `base`, or the route `hybrid` gives its
/// module path and shape.
#[derive(Debug, Clone)]
pub(crate) struct Routing {
    pub base: ParamConfig,
    pub hybrid: Option<lpmm_optim::Hybrid>,
}

impl Routing {
    pub fn config_for(&self, path: &str, shape: &[usize]) -> ParamConfig {
        match &self.hybrid {
            Some(h) => h.config_for(path, shape),
            None => self.base,
        }
    }
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
pub(crate) struct Ctx {
    require_grad: bool,
    checkpointing: Option<GradientCheckpointingStrategy>,
    distributed: bool,
}

impl Ctx {
    pub fn capture<const D: usize>(t: &Tensor<D>) -> Self {
        Ctx {
            require_grad: t.is_require_grad(),
            checkpointing: t.gradient_checkpointing_strategy(),
            distributed: t.is_distributed(),
        }
    }

    pub fn restore<const D: usize>(self, t: Tensor<D>, id: BurnId) -> Tensor<D> {
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
pub(crate) fn optimizer<L: Lane>(
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
        let lent = lends(&config, numel, shape, self.lane.dtype(prim));
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
        routing: &Routing,
        lr: &ModuleLearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<(M, StepReport), BurnError> {
        let mut gather = Gather {
            core: self,
            grads: &mut grads,
            lr,
            routing,
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
}

/// Whether `config`'s parameter storage lives in a tensor of `dtype` (the tensor is then the
/// parameter, lent to lpmm; otherwise lpmm holds it).
pub(crate) fn lends(
    config: &ParamConfig,
    numel: usize,
    shape: &[usize],
    dtype: Option<Dtype>,
) -> bool {
    let want = config
        .resolve(numel, shape)
        .param
        .format()
        .and_then(|f| f.lendable());
    want.is_some() && want == dtype
}

pub(crate) fn to_optim(e: BurnError) -> OptimError {
    match e {
        BurnError::Optim(o) => o,
        other => OptimError::Lent {
            param: String::new(),
            reason: other.to_string(),
        },
    }
}

/// Pass 0, before anything changes: the module's parameters that require a gradient (burn's
/// `require_grad`; an empty tensor, such as [`crate::LpmmLinear`]'s anchor, cannot train and is
/// not counted) and those of them without one in `GradientsParams`, labelled by id and module
/// path, in visiting order.
pub(crate) struct Uncovered<'a> {
    grads: &'a GradientsParams,
    path: Vec<String>,
    seen: HashSet<BurnId>,
    pub checked: usize,
    pub missing: Vec<String>,
}

impl<'a> Uncovered<'a> {
    pub fn new(grads: &'a GradientsParams) -> Self {
        Uncovered {
            grads,
            path: Vec::new(),
            seen: HashSet::new(),
            checked: 0,
            missing: Vec::new(),
        }
    }
}

impl ModuleVisitor for Uncovered<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !self.seen.insert(param.id) {
            return;
        }
        let t = param.val();
        if !t.is_require_grad() || t.dims().contains(&0) {
            return;
        }
        self.checked += 1;
        if self.grads.get::<D>(param.id).is_none() {
            self.missing.push(label(param.id, &self.path.join(".")));
        }
    }
}

/// Pass 1: every parameter with a gradient is registered (at its first gradient) and takes its
/// learning rate; its gradient is taken out of burn's `GradientsParams`, prepared for reading
/// where burn wrote it.
struct Gather<'a, L: Lane> {
    core: &'a mut Core<L>,
    grads: &'a mut GradientsParams,
    lr: &'a ModuleLearningRate,
    routing: &'a Routing,
    path: Vec<String>,
    given: HashMap<ParamId, L::Prim>,
    error: Option<BurnError>,
}

impl<L: Lane> Gather<'_, L> {
    fn gather<const D: usize>(
        &mut self,
        param: &Param<Tensor<D>>,
        grad: Tensor<D>,
    ) -> Result<(), BurnError> {
        let id = param.id;
        let path = self.path.join(".");
        let name = label(id, &path);
        let lr = self.lr.lr_from_param(id, Some(&path));
        let core = &mut *self.core;
        let t = param.val().inner();
        let shape = t.dims().to_vec();
        let lid = match core.index.get(&id) {
            Some(&lid) => lid,
            None => {
                if !core.lane.owns(&t.device()) {
                    return Err(BurnError::param(
                        &name,
                        format!(
                            "on {:?}, not on the {} device this optimizer steps",
                            t.device(),
                            core.lane.name()
                        ),
                    ));
                }
                let mut prim = core.lane.take(t)?;
                let config = self.routing.config_for(&path, &shape);
                let group = core.opt.add_group(config)?;
                core.add(id, &mut prim, &shape, group, config)
                    .map_err(|e| {
                        // lpmm's message names the parameter by its id alone: said once, with
                        // its path.
                        let message = e.to_string();
                        let prefix = format!("parameter {}: ", id.val());
                        let reason = message.strip_prefix(&prefix).unwrap_or(&message);
                        BurnError::param(&name, reason)
                    })?
            }
        };
        let registered = &core.shapes[lid.index()];
        if *registered != shape {
            return Err(BurnError::param(
                &name,
                format!(
                    "its shape {shape:?} differs from the {registered:?} it was registered with"
                ),
            ));
        }
        let numel: usize = shape.iter().product();
        core.opt.set_group_lr(core.groups[lid.index()], lr)?;
        let grad = grad.inner();
        if !core.lane.owns(&grad.device()) {
            return Err(BurnError::param(
                &name,
                format!(
                    "its gradient is on {:?}, not on the {} device",
                    grad.device(),
                    core.lane.name()
                ),
            ));
        }
        let mut g = core.lane.take(grad)?;
        if core.lane.dtype(&g).is_none() {
            return Err(BurnError::param(&name, "its gradient is not f32 or bf16"));
        }
        if core.lane.numel(&g) != numel {
            return Err(BurnError::param(
                &name,
                "its gradient's size is not its own",
            ));
        }
        core.lane.prepare(&mut g, false)?;
        self.given.insert(lid, g);
        Ok(())
    }
}

impl<L: Lane> ModuleVisitor for Gather<'_, L> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() {
            return;
        }
        let Some(grad) = self.grads.remove::<D>(param.id) else {
            return;
        };
        if let Err(e) = self.gather(param, grad) {
            self.error = Some(e);
        }
    }
}

/// burn's gradient tensors as lpmm's [`Gradients`]: each read where burn wrote it, and dropped
/// once its parameter has stepped.
struct GivenGrads<'a, L: Lane> {
    lane: &'a L,
    prims: HashMap<ParamId, L::Prim>,
}

impl<L: Lane> Gradients<L::B> for GivenGrads<'_, L> {
    fn gradient(&mut self, id: ParamId, f: &mut WithGradient<'_, L::B>) -> Result<(), OptimError> {
        match self.prims.get(&id) {
            Some(g) => f(Some(self.lane.input(g).map_err(to_optim)?)),
            None => f(None),
        }
    }

    fn consumed(&mut self, id: ParamId) {
        self.prims.remove(&id);
    }
}

/// The lent parameters' tensors, taken out of the module, as lpmm's [`Lender`] for the step.
struct StepLender<'a, L: Lane> {
    lane: &'a L,
    prims: HashMap<ParamId, L::Prim>,
}

impl<L: Lane> StepLender<'_, L> {
    fn prim(&mut self, id: ParamId) -> Result<&mut L::Prim, OptimError> {
        self.prims.get_mut(&id).ok_or_else(|| OptimError::Lent {
            param: format!("#{}", id.index()),
            reason: "internal: its tensor was not taken out of the module".into(),
        })
    }
}

impl<L: Lane> Lender<L::B> for StepLender<'_, L> {
    fn lend(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(<L::B as Backend>::Input<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError> {
        let lane = self.lane;
        let p = self.prim(id)?;
        f(lane.input(p).map_err(to_optim)?)
    }

    fn lend_mut(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(<L::B as Backend>::Output<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError> {
        let lane = self.lane;
        let p = self.prim(id)?;
        f(lane.output(p).map_err(to_optim)?)
    }
}

/// Takes each lent participant's tensor out of the module (so nothing else holds it) and
/// prepares it for writing; the module keeps a tensor sharing its memory where the lane can
/// write memory others hold (devices), or an empty stand-in until [`Restore`] puts it back (the
/// CPU, whose slices need sole ownership).
struct Take<'a, L: Lane> {
    core: &'a mut Core<L>,
    parts: HashMap<BurnId, ParamId>,
    prims: HashMap<ParamId, L::Prim>,
    /// Every stand-in shares its tensor's memory.
    shared: bool,
    error: Option<BurnError>,
}

impl<L: Lane> Take<'_, L> {
    fn take<const D: usize>(&mut self, lid: ParamId, t: Tensor<D>) -> Result<Tensor<D>, BurnError> {
        let core = &mut *self.core;
        let device = t.device();
        let mut p = core.lane.take(t)?;
        if core.lane.prepare(&mut p, true)? {
            core.copies += 1;
        }
        let stand_in = match core.lane.share::<D>(&p) {
            Some(t) => t,
            None => {
                self.shared = false;
                Tensor::empty([0; D], &device)
            }
        };
        self.prims.insert(lid, p);
        Ok(stand_in)
    }
}

impl<L: Lane> ModuleMapper for Take<'_, L> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let Some(lid) = self.parts.remove(&param.id) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let ctx = Ctx::capture(&tensor);
        let device = tensor.device().inner();
        let out = match self.take(lid, tensor.inner()) {
            Ok(t) => t,
            Err(e) => {
                self.error = Some(e);
                // The step fails and the module is dropped; any value will do.
                Tensor::empty([0; D], &device)
            }
        };
        Param::from_mapped_value(id, ctx.restore(out, id), mapper)
    }
}

/// Puts the stepped tensors back into the module in place of their stand-ins.
struct Restore<'a, L: Lane> {
    lane: &'a L,
    prims: HashMap<BurnId, L::Prim>,
}

impl<L: Lane> ModuleMapper for Restore<'_, L> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(p) = self.prims.remove(&param.id) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let ctx = Ctx::capture(&tensor);
        drop(tensor);
        Param::from_mapped_value(id, ctx.restore(self.lane.give(p), id), mapper)
    }
}
