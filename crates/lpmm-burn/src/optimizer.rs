//! [`LpmmOptimizer`]: the burn optimizer over any lpmm configuration.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use burn_core::module::{Module, ModuleVisitor, Param};
use burn_core::tensor::{Device, Tensor};
use burn_optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn_optim::{GradientsParams, OptimizerRecord};
use lpmm_optim::{
    CoverageCheck, Hybrid, MemoryReport, MissingGradientHelp, MissingGradients, StepReport,
};

use crate::core::{Core, Pending, Uncovered};
use crate::lane::Lane;
use crate::persist::{self, record};
use crate::{BurnError, LpmmOptimizerConfig};

/// The lpmm optimizer on the lane of the module's device.
#[derive(Debug)]
pub(crate) enum Engine {
    #[cfg(any(feature = "ndarray", feature = "flex"))]
    Cpu(Core<crate::lane::cpu::CpuLane>),
    #[cfg(feature = "wgpu")]
    Wgpu(Core<crate::wgpu::WgpuLane>),
    #[cfg(feature = "cuda")]
    Cuda(Core<crate::cuda::CudaLane>),
}

/// Runs `$body` with `$core` bound to the engine's core, whatever its lane.
macro_rules! on_engine {
    ($engine:expr, $core:ident => $body:expr) => {
        match $engine {
            #[cfg(any(feature = "ndarray", feature = "flex"))]
            $crate::optimizer::Engine::Cpu($core) => $body,
            #[cfg(feature = "wgpu")]
            $crate::optimizer::Engine::Wgpu($core) => $body,
            #[cfg(feature = "cuda")]
            $crate::optimizer::Engine::Cuda($core) => $body,
        }
    };
}

impl Engine {
    fn new(device: &Device, config: &LpmmOptimizerConfig) -> Result<Self, BurnError> {
        let _ = config;
        #[cfg(any(feature = "ndarray", feature = "flex"))]
        {
            let lane = crate::lane::cpu::CpuLane;
            if lane.owns(device) {
                return Ok(Engine::Cpu(Core::new(lane, config.options)?));
            }
        }
        #[cfg(feature = "wgpu")]
        if let Some(lane) = crate::wgpu::WgpuLane::for_device(device)? {
            return Ok(Engine::Wgpu(Core::new(lane, config.options)?));
        }
        #[cfg(feature = "cuda")]
        if let Some(lane) = crate::cuda::CudaLane::for_device(device)? {
            return Ok(Engine::Cuda(Core::new(lane, config.options)?));
        }
        Err(BurnError::device(
            device,
            "no lpmm backend for this device in this build (features: ndarray, flex, wgpu, cuda)",
        ))
    }
}

/// What the optimizer did so far, for tests and reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LpmmStats {
    /// The lane in use ("cpu", "wgpu", "cuda"), once the first step chose it.
    pub lane: Option<&'static str>,
    /// Parameters registered.
    pub params: usize,
    /// Of those, parameters lpmm holds in its own storage (the module's tensor receives the
    /// decoded value after each step) rather than stepping in the module's tensor.
    pub held: usize,
    /// Private copies of a parameter tensor the steps had to make because the tensor was shared
    /// with another tensor (a clone kept elsewhere) or not contiguous. 0 in a plain training loop.
    pub copies: u64,
    /// Buffer maps (reads back to the host) of the wgpu lane so far.
    pub host_reads: Option<u64>,
    /// Bytes those reads brought back.
    pub host_read_bytes: Option<u64>,
}

/// The whole-module optimizer: any lpmm configuration over a whole burn module, used like burn's
/// `ModuleOptimizer` in a training loop written by hand, for what burn's per-tensor optimizers
/// (and so [`crate::LpmmTensorOptimizer`], what burn-train's `Learner` takes) cannot do:
/// global-norm clipping, the all-or-nothing skip of a step with a non-finite gradient, layers
/// whose weights live only in lpmm's storage below 16 bits ([`crate::LpmmLinear`]), and a report
/// naming the parameters that received no gradient.
///
/// ```ignore
/// let mut optim = Lpmm8bitAdamWConfig::new().init_whole_module();
/// let grads = GradientsParams::from_grads(loss.backward(), &model);
/// model = optim.step(lr, model, grads)?;
/// ```
///
/// Each step takes the whole module's gradients: they are accumulated first, so global-norm
/// clipping sees every gradient and a non-finite one skips the whole step (the all-or-nothing
/// policy), and then each parameter is stepped where it lives. A parameter whose storage is the
/// tensor's own dtype (f32, or bf16 on a backend with bf16 tensors) is the module's tensor:
/// lpmm steps it in place and keeps no copy, only its other slots (gradient accumulator, states,
/// a Kahan compensation or split remainder). A parameter with any other storage (8-bit, or bf16
/// in an f32 tensor) is held by lpmm, and its decoded value is written into the module's tensor
/// after each step (two copies: use [`crate::LpmmLinear`] to keep one).
///
/// The parameters are registered at the first step in the module's visiting order, which keys
/// their stochastic-rounding streams; the optimizer's state is keyed by burn's `ParamId`s (saved
/// in module records), so a record applies to the right tensors in another process.
#[derive(Debug, Clone)]
pub struct LpmmOptimizer {
    pub(crate) shared: Arc<Mutex<Shared>>,
}

/// The optimizer's state, shared with the [`crate::LpmmLinear`] layers whose weights it holds.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: LpmmOptimizerConfig,
    /// Routes each parameter to one of two configurations by its module path and shape
    /// ([`LpmmOptimizer::with_hybrid`]); `None`: every parameter takes `config.param`.
    pub hybrid: Option<Hybrid>,
    pub engine: Option<Engine>,
    pending: Option<Pending>,
    last: Option<StepReport>,
    /// The first error of a layer's backward pass (which cannot return one), reported by the
    /// next step.
    pub deferred: Option<BurnError>,
    /// The device of the layers' weights, once a layer was created.
    pub device: Option<Device>,
    /// The missing-gradient policy over the module's parameters (the optimizer core sees only
    /// those registered, at their first gradient).
    coverage: CoverageCheck,
}

/// What lpmm-burn's missing-gradient warning and error say about causes and remedies.
pub(crate) const MISSING_GRADIENT_HELP: MissingGradientHelp = MissingGradientHelp::new(
    "GradientsParams built for another module than the one stepped \
     (GradientsParams::from_grads(loss.backward(), &model) takes the model given to step)",
    "burn's own way: Param::set_require_grad(false) or Module::no_grad() on the frozen part",
    "LpmmOptimizerConfig::with_missing_gradient",
);

impl LpmmOptimizer {
    pub(crate) fn new(config: LpmmOptimizerConfig) -> Self {
        LpmmOptimizer {
            shared: Arc::new(Mutex::new(Shared {
                config,
                hybrid: None,
                engine: None,
                pending: None,
                last: None,
                deferred: None,
                device: None,
                coverage: CoverageCheck::new(config.missing_gradient, MISSING_GRADIENT_HELP),
            })),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The configuration.
    pub fn config(&self) -> LpmmOptimizerConfig {
        self.lock().config
    }

    /// Routes each parameter to one of `hybrid`'s two configurations (Muon for the hidden
    /// matrices, AdamW for the rest: [`lpmm_optim::presets::muon_adamw_8bit_bf16_sr`] and its
    /// siblings) by its burn module path (`blocks.0.attn.qkv.weight`: the field names from the
    /// model down to the parameter) and its shape, as [`Hybrid::route_of`] decides: the user's
    /// routes first, then [`lpmm_optim::DEFAULT_OTHERS`] (`*embed*`, `*head*`, ...), then a
    /// matrix to `hybrid.matrices` and anything else to `hybrid.others`. The configuration's own
    /// `param` is then unused; its options (seed, clipping, non-finite policy) and
    /// missing-gradient policy still apply. [`crate::LpmmLinear`] weights (no module path) go
    /// by their shape: to `hybrid.matrices`.
    ///
    /// burn-train's per-tensor form has no module paths: there, burn's own
    /// `ModuleOptimizer::with_group(ParamGroup::from_regex(..)?, muon, None)` routes (see
    /// docs/BURN.md).
    ///
    /// Refused ([`BurnError::Config`]) once a parameter is registered (a step taken, a layer
    /// created) or a loaded state waits, and for an invalid configuration in either route.
    pub fn with_hybrid(self, hybrid: Hybrid) -> Result<Self, BurnError> {
        hybrid.matrices.validate()?;
        hybrid.others.validate()?;
        {
            let mut shared = self.lock();
            let registered = match &shared.engine {
                Some(e) => {
                    on_engine!(e, core => !core.burn_ids.is_empty() || !core.external.is_empty())
                }
                None => false,
            };
            if registered || shared.pending.is_some() {
                return Err(BurnError::Config(
                    "with_hybrid: parameters are registered or a loaded state waits already; \
                     route a new optimizer before its first step"
                        .into(),
                ));
            }
            shared.hybrid = Some(hybrid);
        }
        Ok(self)
    }

    /// The routing of [`LpmmOptimizer::with_hybrid`], if any.
    pub fn hybrid(&self) -> Option<Hybrid> {
        self.lock().hybrid.clone()
    }

    /// Updates `module`'s parameters with `grads` at learning rate `lr` (a number, or burn's
    /// per-group `ModuleLearningRate` from a `ModuleLrScheduler`), as burn's
    /// `ModuleOptimizer::step`. On an error the module is dropped with the step.
    pub fn step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        module: M,
        grads: GradientsParams,
    ) -> Result<M, BurnError> {
        self.lock().step(lr.into(), module, grads)
    }

    /// Applies a loaded record or checkpoint to `module` now rather than at the next step. A model
    /// with [`crate::LpmmLinear`] layers needs it before its first forward pass after loading
    /// (their weights live only in the optimizer); for others it is optional.
    pub fn attach<M: Module>(&mut self, module: M) -> Result<M, BurnError> {
        let mut shared = self.lock();
        let Some(pending) = shared.pending.take() else {
            return Ok(module);
        };
        let mut first = FirstDevice {
            grads: None,
            device: None,
        };
        module.visit(&mut first);
        let Some(device) = first.device.or_else(|| shared.device.clone()) else {
            return Err(BurnError::Record("the module has no parameter".into()));
        };
        let engine = shared.engine(&device)?;
        on_engine!(engine, core => core.attach(module, pending))
    }

    /// What the last step did (parameters updated, whether it was skipped, the gradient norm).
    pub fn last_report(&self) -> Option<StepReport> {
        self.lock().last.clone()
    }

    /// The model memory lpmm holds (its slots; a lent parameter's own tensor is the module's and
    /// is not counted), per parameter.
    pub fn memory_report(&self) -> MemoryReport {
        match &self.lock().engine {
            Some(e) => on_engine!(e, core => core.opt.memory_report()),
            None => MemoryReport::default(),
        }
    }

    /// Counters: lane, parameters, copies made, host reads.
    pub fn stats(&self) -> LpmmStats {
        match &self.lock().engine {
            Some(e) => on_engine!(e, core => LpmmStats {
                lane: Some(core.lane.name()),
                params: core.burn_ids.len(),
                held: core.held.iter().filter(|h| **h).count(),
                copies: core.copies,
                host_reads: core.lane.host_reads().map(|r| r.0),
                host_read_bytes: core.lane.host_reads().map(|r| r.1),
            }),
            None => LpmmStats::default(),
        }
    }

    /// The optimizer's state as a burn [`OptimizerRecord`] (burnpack), encoded by lpmm's
    /// checkpoint codec (`lpmm_optim::checkpoint::codec`): lpmm's canonical slots (codes, scales,
    /// compensations, counters, configuration) as tensors named `{param_id}/{slot}{region}`,
    /// keyed by burn's `ParamId`s, with a CRC-32 of the metadata and every tensor. The values of
    /// parameters that live in the module's tensors are held outside it, in the module record.
    pub fn to_record(&self) -> Result<OptimizerRecord, BurnError> {
        let pending = self.lock().canonical::<NoModule>(None)?;
        record::encode(pending.as_ref())
    }

    /// Loads a record written by [`LpmmOptimizer::to_record`] (in any process) into this
    /// optimizer, which has not stepped yet. It applies at the next step, to the module's
    /// parameters with the record's `ParamId`s (load the module record first); its options
    /// (seed, clipping, policy) and per-parameter configurations replace this optimizer's.
    ///
    /// A record without its checksum, whose contents do not give it, or whose metadata has a key
    /// this build does not know is a [`BurnError::Record`] (a corrupt record is never loaded as
    /// another state). Records of format version 1 (before lpmm's checkpoint codec) load too.
    pub fn load_record(self, record: OptimizerRecord) -> Result<Self, BurnError> {
        let pending = record::decode(record)?;
        self.lock().set_pending(pending)?;
        Ok(self)
    }

    /// Saves [`LpmmOptimizer::to_record`] to a burnpack file (burn's recorder format).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), BurnError> {
        self.to_record()?
            .save(path)
            .map_err(|e| BurnError::Record(e.to_string()))
    }

    /// Loads a burnpack file written by [`LpmmOptimizer::save`].
    pub fn load(self, path: impl AsRef<Path>) -> Result<Self, BurnError> {
        let record = OptimizerRecord::load(path).map_err(|e| BurnError::Record(e.to_string()))?;
        self.load_record(record)
    }

    /// Saves lpmm's own safetensors checkpoint (`lpmm_optim::Optimizer::save`'s format),
    /// complete: the parameters' values are read from `module`'s tensors, so it loads anywhere,
    /// with or without burn (`lpmm_optim::Canonical::read(path)?.into_optimizer(backend)`).
    pub fn save_lpmm<M: Module>(
        &self,
        path: impl AsRef<Path>,
        module: &M,
    ) -> Result<(), BurnError> {
        match self.lock().canonical(Some(module))? {
            Some(p) => persist::write_checkpoint(&p.canonical, path),
            None => Err(BurnError::Record(
                "nothing to save: the optimizer has not stepped".into(),
            )),
        }
    }

    /// Loads an lpmm checkpoint (from [`LpmmOptimizer::save_lpmm`], or any lpmm optimizer whose
    /// parameters are named by burn `ParamId`s) into this optimizer, which has not stepped yet: at
    /// the next step its parameter values go into the module's tensors and everything else into
    /// the optimizer.
    pub fn load_lpmm(self, path: impl AsRef<Path>) -> Result<Self, BurnError> {
        let canonical = persist::read_checkpoint(path)?;
        let from_module = vec![false; canonical.params.len()];
        self.lock().set_pending(Some(Pending {
            canonical,
            from_module,
        }))?;
        Ok(self)
    }
}

impl Shared {
    /// How parameters registered now get their configuration.
    pub fn routing(&self) -> crate::core::Routing {
        crate::core::Routing {
            base: self.config.param,
            hybrid: self.hybrid.clone(),
        }
    }

    /// The engine of `device`'s lane, created on first use.
    pub fn engine(&mut self, device: &Device) -> Result<&mut Engine, BurnError> {
        let engine = match self.engine.take() {
            Some(e) => e,
            None => Engine::new(device, &self.config)?,
        };
        Ok(self.engine.insert(engine))
    }

    fn step<M: Module>(
        &mut self,
        lr: ModuleLearningRate,
        module: M,
        grads: GradientsParams,
    ) -> Result<M, BurnError> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        // Coverage first, before anything changes: the module's parameters that require a
        // gradient, and the layer weights lpmm holds.
        let mut uncovered = Uncovered::new(&grads);
        module.visit(&mut uncovered);
        let (mut checked, mut missing) = (uncovered.checked, uncovered.missing);
        let step = match &self.engine {
            Some(e) => on_engine!(e, core => core.uncovered_weights(&mut checked, &mut missing)?),
            None => 1,
        };
        let missing = MissingGradients::new(checked, missing.iter().map(String::as_str));
        self.coverage.check(&missing, step)?;
        let mut first = FirstDevice {
            grads: Some(&grads),
            device: None,
        };
        module.visit(&mut first);
        let device = match first.device.or_else(|| self.device.clone()) {
            Some(d) => d,
            // No gradient: nothing to step.
            None => return Ok(module),
        };
        let pending = self.pending.take();
        let routing = self.routing();
        let engine = self.engine(&device)?;
        let result = on_engine!(engine, core => {
            let module = match pending {
                Some(p) => core.attach(module, p),
                None => Ok(module),
            };
            module.and_then(|m| core.step(&routing, &lr, m, grads))
        });
        let (module, mut report) = result?;
        report.missing_gradients = missing;
        self.last = Some(report);
        Ok(module)
    }

    /// Whether a loaded state not yet attached holds layer weight `id`.
    pub fn pending_external(&self, id: burn_core::module::ParamId) -> bool {
        let name = id.val().to_string();
        self.pending
            .as_ref()
            .is_some_and(|p| p.canonical.params.iter().any(|q| q.name == name))
    }

    fn set_pending(&mut self, pending: Option<Pending>) -> Result<(), BurnError> {
        if let Some(e) = &self.engine {
            let stepped = on_engine!(e, core => core.external.len() < core.burn_ids.len());
            if stepped {
                return Err(BurnError::Record(
                    "the optimizer has stepped already: load into a new optimizer".into(),
                ));
            }
        }
        self.pending = pending;
        Ok(())
    }

    /// The whole state in lpmm's canonical layout; with `module`, lent parameters' values are
    /// read from its tensors, without, they are left out (a burn record leaves them to the module
    /// record).
    fn canonical<M: Module>(&self, module: Option<&M>) -> Result<Option<Pending>, BurnError> {
        if let Some(p) = &self.pending {
            return Ok(Some(p.clone()));
        }
        let Some(engine) = &self.engine else {
            return Ok(None);
        };
        on_engine!(engine, core => {
            let prims = match module {
                Some(m) => Some(core.collect(m)?),
                None => None,
            };
            let canonical = core.canonical(prims)?;
            let from_module = core.held.iter().map(|h| !h && module.is_none()).collect();
            Ok(Some(Pending { canonical, from_module }))
        })
    }
}

/// The device of the first parameter (with a gradient, when `grads` are given).
struct FirstDevice<'a> {
    grads: Option<&'a GradientsParams>,
    device: Option<Device>,
}

impl ModuleVisitor for FirstDevice<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.device.is_some() {
            return;
        }
        match self.grads {
            Some(grads) => {
                if let Some(g) = grads.get::<D>(param.id) {
                    self.device = Some(g.device().inner());
                }
            }
            None => self.device = Some(param.val().device().inner()),
        }
    }
}

/// No module (records without the lent parameters' values): only its type is used.
type NoModule = Option<Param<Tensor<1>>>;
