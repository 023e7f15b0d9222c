//! The module visitors of a step and of attaching a state: which parameters lack a gradient,
//! gathering the module's tensors, and handing gradients and lent tensors to lpmm-optim's step.

use super::*;
/// Pass 0, before anything changes: the module's parameters that require a gradient (burn's
/// `require_grad`; an empty tensor, such as [`crate::LpmmLinear`]'s anchor, cannot train and is
/// not counted) and those of them without one in `GradientsParams`, labelled by id and module
/// path, in visiting order.
pub(crate) struct Uncovered<'a> {
    pub(super) grads: &'a GradientsParams,
    pub(super) path: Vec<String>,
    pub(super) seen: HashSet<BurnId>,
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
pub(super) struct Gather<'a, L: Lane> {
    pub(super) core: &'a mut Core<L>,
    pub(super) grads: &'a mut GradientsParams,
    pub(super) lr: &'a ModuleLearningRate,
    pub(super) base: &'a ParamConfig,
    pub(super) path: Vec<String>,
    pub(super) given: HashMap<ParamId, L::Prim>,
    pub(super) error: Option<BurnError>,
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
                let group = core.opt.add_group(*self.base)?;
                core.add(id, &mut prim, &shape, group, *self.base)
                    .map_err(|e| BurnError::param(&name, e.to_string()))?
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
pub(super) struct GivenGrads<'a, L: Lane> {
    pub(super) lane: &'a L,
    pub(super) prims: HashMap<ParamId, L::Prim>,
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
pub(super) struct StepLender<'a, L: Lane> {
    pub(super) lane: &'a L,
    pub(super) prims: HashMap<ParamId, L::Prim>,
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
pub(super) struct Take<'a, L: Lane> {
    pub(super) core: &'a mut Core<L>,
    pub(super) parts: HashMap<BurnId, ParamId>,
    pub(super) prims: HashMap<ParamId, L::Prim>,
    /// Every stand-in shares its tensor's memory.
    pub(super) shared: bool,
    pub(super) error: Option<BurnError>,
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
pub(super) struct Restore<'a, L: Lane> {
    pub(super) lane: &'a L,
    pub(super) prims: HashMap<BurnId, L::Prim>,
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
    pub(super) core: &'a mut Core<L>,
    pub(super) work: Work,
    pub(super) parts: HashMap<BurnId, ParamId>,
    pub(super) error: Option<BurnError>,
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
                PartsMut::of(&mut core.opt).import_slot(lid, SlotKind::Param, &host, Some(out))?;
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
pub(super) struct Collect<'a, L: Lane> {
    pub(super) lane: &'a L,
    pub(super) prims: HashMap<BurnId, (Vec<usize>, L::Prim)>,
    pub(super) error: Option<BurnError>,
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
