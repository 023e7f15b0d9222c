//! [`LpmmTensorOptimizer`]: any lpmm configuration as a per-tensor `burn_optim::Optimizer`, the
//! form burn's `ModuleOptimizer` (and so burn-train's `Learner`) takes.

pub(crate) mod engine;
pub(crate) mod state;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use burn_core::tensor::{Device, Tensor};
use burn_optim::LearningRate;
use lpmm_optim::{MemoryReport, StepReport};

use crate::lane::Lane;
use crate::{BurnError, LpmmOptimizerConfig};
use engine::{AnyEngine, Engine, EngineCell, Slot, lock, on_any, take};
use state::{Loaded, LpmmState, StateInner};

/// Any lpmm configuration as burn's per-tensor optimizer (`burn_optim::Optimizer`): what
/// `ModuleOptimizer::from(optim)` and `ModuleOptimizer::with_group(group, optim, clipping)` take,
/// and so burn-train's `Learner`. Built by [`crate::LpmmOptimizerConfig::build`] and
/// [`crate::Lpmm8bitAdamWConfig::build`]; their `init()` gives the `ModuleOptimizer` directly, as
/// burn's own configurations do.
///
/// ```ignore
/// // burn:  let optim = AdamWConfig::new().init();
/// let optim = Lpmm8bitAdamWConfig::new().init()?;
/// let learner = Learner::new(model, optim, lr_scheduler);
/// ```
///
/// Each parameter is stepped alone, when burn's `ModuleOptimizer` reaches it, with its own
/// gradient (after burn's gradient clipping, when its group has one) and its own learning rate
/// (burn's schedulers and per-group learning rates). The step is lpmm's: a parameter whose storage
/// is the tensor's dtype (f32; bf16 on flex) is the tensor, stepped in place; any other storage is
/// held by lpmm and its decoded value written into the tensor after each step. The states (codes,
/// block scales, compensations, counters) stay in lpmm's storage on the parameter's device
/// ([`LpmmState`]).
///
/// What the per-tensor form cannot do, because burn hands it one tensor at a time: global-norm
/// clipping (burn's `GradientClipping::Norm` clips each tensor by its own norm), the
/// all-or-nothing skip of a step with a non-finite gradient anywhere (`NonFinitePolicy::SkipStep`
/// skips only that parameter's step here), parameters stored below 16 bits without a full-precision
/// copy ([`crate::LpmmLinear`]), and naming the parameters that receive no gradient (burn steps
/// only those that have one; [`crate::check_gradients`] checks a module). The whole-module
/// [`crate::LpmmOptimizer`] does all four.
///
/// A step cannot return an error to burn: when one fails (a wgpu device not shared with lpmm, a
/// non-finite parameter lpmm refuses to register, a device error), the parameter and its state
/// are left as they were, a warning names it (`tracing` where a subscriber records lpmm's
/// warnings, stderr otherwise; once per distinct message), and [`LpmmTensorOptimizer::stats`]
/// keeps it. Keep a clone of the optimizer to read them: clones share their counters, engines
/// and stream order.
#[derive(Clone)]
pub struct LpmmTensorOptimizer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LpmmTensorOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LpmmTensorOptimizer")
            .field("config", &self.shared.config)
            .field("owner", &self.shared.owner)
            .finish()
    }
}

struct Shared {
    /// Tells this optimizer's slots from another's.
    owner: u64,
    config: LpmmOptimizerConfig,
    devices: Mutex<Vec<DeviceEngines>>,
    stats: Mutex<Counters>,
}

/// The engines of one device.
struct DeviceEngines {
    device: Device,
    /// The stream of the next parameter met for the first time.
    next_stream: u64,
    engines: Vec<Weak<EngineCell>>,
}

#[derive(Default)]
struct Counters {
    steps: u64,
    skipped: u64,
    non_finite: u64,
    copies: u64,
    reinitialised: Vec<String>,
    errors: Vec<String>,
    error_count: u64,
}

/// At most this many distinct messages are kept (the counts are complete).
const KEPT: usize = 32;

/// What the per-tensor optimizer did so far.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct LpmmTensorStats {
    /// The lane of the first device ("cpu", "wgpu", "cuda"), once a parameter was registered.
    pub lane: Option<&'static str>,
    /// Parameters whose state lpmm holds now.
    pub params: usize,
    /// Tensor steps taken (one per parameter per training step).
    pub steps: u64,
    /// Of those, steps skipped for a non-finite gradient (`NonFinitePolicy::SkipStep`).
    pub skipped: u64,
    /// Steps whose gradient held a non-finite value (skipped, or those elements left unchanged).
    pub non_finite: u64,
    /// Private copies made: a parameter tensor shared with another tensor (burn-train's
    /// `Learner` keeps the model it steps, so each step copies each parameter, as burn's own
    /// in-place operations would), or a state stepped by two clones of an optimizer.
    pub copies: u64,
    /// States that could not be used and were re-initialised, with the reason (the first 32): a
    /// loaded one (another optimizer's record, a damaged one, another shape or configuration),
    /// or a live one whose parameter's tensor was replaced by one of another shape.
    pub reinitialised: Vec<String>,
    /// Steps that failed (the parameter and its state left unchanged), distinct messages (the
    /// first 32).
    pub errors: Vec<String>,
    /// How many steps failed.
    pub error_count: u64,
    /// Buffer maps (reads back to the host) of lpmm's wgpu backend so far (every optimizer on
    /// that device together).
    pub host_reads: Option<u64>,
    /// Bytes those reads brought back.
    pub host_read_bytes: Option<u64>,
}

static OWNERS: AtomicU64 = AtomicU64::new(1);

/// Why a registration failed.
enum Failed {
    /// The device has no lpmm engine (a wgpu device not shared with lpmm, a backend not built).
    Device(BurnError),
    /// The parameter or its saved state was refused.
    Param(BurnError),
}

impl LpmmTensorOptimizer {
    /// The optimizer of a checked configuration.
    pub(crate) fn new(config: LpmmOptimizerConfig) -> Self {
        LpmmTensorOptimizer {
            shared: Arc::new(Shared {
                owner: OWNERS.fetch_add(1, Ordering::Relaxed),
                config,
                devices: Mutex::new(Vec::new()),
                stats: Mutex::new(Counters::default()),
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> LpmmOptimizerConfig {
        self.shared.config
    }

    fn devices(&self) -> MutexGuard<'_, Vec<DeviceEngines>> {
        self.shared
            .devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn counters(&self) -> MutexGuard<'_, Counters> {
        self.shared.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The engines alive now.
    fn engines(&self) -> Vec<Arc<EngineCell>> {
        self.devices()
            .iter()
            .flat_map(|d| d.engines.iter().filter_map(Weak::upgrade))
            .collect()
    }

    /// Counters, failures, re-initialised states, host reads.
    pub fn stats(&self) -> LpmmTensorStats {
        let mut stats = LpmmTensorStats::default();
        for cell in self.engines() {
            let engine = lock(&cell);
            on_any!(&*engine, e => {
                stats.lane.get_or_insert(e.lane.name());
                stats.params += e.live();
                stats.copies += e.copies;
                if let Some((reads, bytes)) = e.lane.host_reads() {
                    stats.host_reads = Some(reads);
                    stats.host_read_bytes = Some(bytes);
                }
            });
        }
        let c = self.counters();
        stats.steps = c.steps;
        stats.skipped = c.skipped;
        stats.non_finite = c.non_finite;
        stats.copies += c.copies;
        stats.reinitialised = c.reinitialised.clone();
        stats.errors = c.errors.clone();
        stats.error_count = c.error_count;
        stats
    }

    /// The model memory lpmm holds for this optimizer's parameters (their slots; a lent
    /// parameter's value is the module's tensor and is not counted), per parameter, every engine
    /// together (a few one-element placeholders included where a record's streams needed them).
    pub fn memory_report(&self) -> MemoryReport {
        let mut report = MemoryReport::default();
        for cell in self.engines() {
            let engine = lock(&cell);
            let r = on_any!(&*engine, e => e.opt.memory_report());
            report.params.extend(r.params);
        }
        report
    }

    fn fail(&self, what: &str, e: BurnError) {
        let message = format!("{what}: {e}");
        let mut c = self.counters();
        c.error_count += 1;
        if !c.errors.contains(&message) {
            if c.errors.len() < KEPT {
                c.errors.push(message.clone());
            }
            drop(c);
            crate::warn(&format!(
                "the per-tensor step left a parameter unchanged: {message}"
            ));
        }
    }

    fn reinitialised(&self, reason: String) {
        let mut c = self.counters();
        if c.reinitialised.len() < KEPT {
            c.reinitialised.push(reason.clone());
        }
        drop(c);
        crate::warn(&format!("an optimizer state was re-initialised: {reason}"));
    }

    /// The stream of a parameter met for the first time on `device` (or, with `at`, a loaded
    /// state's own), moving the device's counter past it.
    fn stream(devices: &mut Vec<DeviceEngines>, device: &Device, at: Option<u64>) -> u64 {
        let d = match devices.iter().position(|d| d.device == *device) {
            Some(i) => &mut devices[i],
            None => {
                devices.push(DeviceEngines {
                    device: device.clone(),
                    next_stream: 0,
                    engines: Vec::new(),
                });
                devices.last_mut().expect("just pushed")
            }
        };
        let s = at.unwrap_or(d.next_stream);
        d.next_stream = d.next_stream.max(s + 1);
        s
    }

    /// Gives back `stream`, the last one given out on `device`, where nothing took it.
    fn unstream(devices: &mut [DeviceEngines], device: &Device, stream: u64) {
        if let Some(d) = devices.iter_mut().find(|d| d.device == *device)
            && d.next_stream == stream + 1
        {
            d.next_stream = stream;
        }
    }

    /// An engine on `device` where `stream` is free (a new one where none is).
    fn engine_for(
        &self,
        devices: &mut [DeviceEngines],
        device: &Device,
        stream: u64,
    ) -> Result<Arc<EngineCell>, BurnError> {
        let d = devices
            .iter_mut()
            .find(|d| d.device == *device)
            .ok_or_else(|| BurnError::device(device, "internal: no stream counter"))?;
        d.engines.retain(|w| w.strong_count() > 0);
        for w in &d.engines {
            if let Some(cell) = w.upgrade() {
                let free = on_any!(&*lock(&cell), e => e.free(stream));
                if free {
                    return Ok(cell);
                }
            }
        }
        let cell = Arc::new(Mutex::new(AnyEngine::new(
            device,
            self.shared.config.options,
        )?));
        d.engines.push(Arc::downgrade(&cell));
        Ok(cell)
    }

    /// Registers the parameter of `tensor` at `stream` (importing `loaded`), giving back the
    /// tensor and its new state.
    fn register<const D: usize>(
        &self,
        tensor: Tensor<D>,
        stream: Option<u64>,
        loaded: Option<&Loaded>,
    ) -> (Tensor<D>, Result<LpmmState<D>, Failed>) {
        let device = tensor.device();
        let mut devices = self.devices();
        let stream = Self::stream(&mut devices, &device, stream);
        let cell = match self.engine_for(&mut devices, &device, stream) {
            Ok(c) => c,
            Err(e) => return (tensor, Err(Failed::Device(e))),
        };
        let config = self.shared.config.param;
        let mut engine = lock(&cell);
        let (tensor, id) =
            on_any!(&mut *engine, e => register_on(e, tensor, stream, &config, loaded));
        let taken = on_any!(&*engine, e => !e.free(stream));
        drop(engine);
        if id.is_err() && !taken {
            // A parameter refused at registration (Muon's non-matrix, non-finite values) keeps
            // no stream: it is tried again at its next step, and the parameters met after it
            // take the streams they would have had without it.
            Self::unstream(&mut devices, &device, stream);
        }
        drop(devices);
        let slot = id.map(|id| Slot {
            engine: cell,
            id,
            stream,
            owner: self.shared.owner,
            device,
        });
        (
            tensor,
            slot.map(|s| LpmmState::new(StateInner::Live(s)))
                .map_err(Failed::Param),
        )
    }

    /// Why `loaded` cannot be the state of `tensor` under this configuration, if it cannot.
    fn unusable<const D: usize>(&self, loaded: &Loaded, tensor: &Tensor<D>) -> Option<String> {
        let reason = self.mismatch(loaded, tensor)?;
        Some(format!("{}: {reason}", loaded.label))
    }

    fn mismatch<const D: usize>(&self, loaded: &Loaded, tensor: &Tensor<D>) -> Option<String> {
        let shape = tensor.dims().to_vec();
        if loaded.param.shape != shape {
            return Some(format!(
                "the record's state is for shape {:?}, the parameter's is {shape:?}",
                loaded.param.shape
            ));
        }
        let numel: usize = shape.iter().product();
        let ours = self.shared.config.param;
        let theirs = loaded.param.requested;
        if std::mem::discriminant(&ours.hyper) != std::mem::discriminant(&theirs.hyper) {
            return Some(format!(
                "the record's state is {}'s, this optimizer is {}",
                theirs.hyper.name(),
                ours.hyper.name()
            ));
        }
        let (ours, theirs) = (
            ours.resolve(numel, &shape).slots(),
            theirs.resolve(numel, &shape).slots(),
        );
        if ours != theirs {
            return Some(format!(
                "the record's state has storages {theirs:?}, this configuration {ours:?}"
            ));
        }
        None
    }

    /// One tensor step (burn's `Optimizer::step`).
    fn step_tensor<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<LpmmState<D>>,
    ) -> (Tensor<D>, Option<LpmmState<D>>) {
        let device = tensor.device();
        let owner = self.shared.owner;
        let state = match state.as_ref().and_then(|s| s.other_shape(&tensor.dims())) {
            Some(reason) => {
                self.reinitialised(reason);
                None
            }
            None => state,
        };
        let (tensor, state) = match state {
            Some(s) if s.live_here(owner, &device) => (tensor, s),
            other => {
                let (loaded, stream) = match &other {
                    None => (None, None),
                    Some(s) => match &*s.inner {
                        StateInner::Refused(reason) => {
                            self.reinitialised(reason.clone());
                            (None, None)
                        }
                        StateInner::Live(slot) => match s.to_loaded() {
                            Ok(l) => {
                                // Another clone holds these slots, or another optimizer or
                                // device does: step a copy.
                                if slot.owner == owner {
                                    self.counters().copies += 1;
                                }
                                (Some(l), Some(slot.stream))
                            }
                            Err(e) => {
                                self.fail("its state could not be copied", e);
                                return (tensor, other);
                            }
                        },
                        StateInner::Loaded(l) => match self.unusable(l, &tensor) {
                            Some(reason) => {
                                self.reinitialised(reason);
                                (None, None)
                            }
                            None => (Some((**l).clone()), Some(l.stream)),
                        },
                    },
                };
                let (tensor, registered) = self.register(tensor, stream, loaded.as_ref());
                let (tensor, registered) = match registered {
                    // A saved state that does not import (its slots do not fit this
                    // configuration's) is re-initialised, as an unusable one is.
                    Err(Failed::Param(e)) if loaded.is_some() => {
                        let label = loaded.as_ref().map_or("", |l| l.label.as_str());
                        self.reinitialised(format!("{label}: its state did not import: {e}"));
                        self.register(tensor, None, None)
                    }
                    r => (tensor, r),
                };
                match registered {
                    Ok(s) => (tensor, s),
                    Err(Failed::Device(e)) => {
                        self.fail("registration", e);
                        // The device has no lpmm engine: a loaded state is kept for a later try.
                        let keep = other.filter(|s| matches!(&*s.inner, StateInner::Loaded(_)));
                        return (tensor, keep);
                    }
                    Err(Failed::Param(e)) => {
                        self.fail("registration", e);
                        return (tensor, None);
                    }
                }
            }
        };
        let StateInner::Live(slot) = &*state.inner else {
            return (tensor, Some(state));
        };
        let mut engine = lock(&slot.engine);
        let (tensor, report) = on_any!(&mut *engine, e => step_on(e, slot.id, lr, tensor, grad));
        drop(engine);
        match report {
            Ok(r) => {
                let mut c = self.counters();
                c.steps += 1;
                c.skipped += u64::from(r.skipped);
                c.non_finite += u64::from(!r.non_finite.is_empty());
            }
            Err(e) => self.fail("step", e),
        }
        (tensor, Some(state))
    }
}

/// Registers `tensor`'s parameter in engine `e` at `stream` and imports `loaded`.
fn register_on<L: Lane, const D: usize>(
    e: &mut Engine<L>,
    tensor: Tensor<D>,
    stream: u64,
    config: &lpmm_optim::ParamConfig,
    loaded: Option<&Loaded>,
) -> (Tensor<D>, Result<lpmm_optim::ParamId, BurnError>) {
    let shape = tensor.dims().to_vec();
    if !e.lane.owns(&tensor.device()) {
        return (
            tensor,
            Err(BurnError::device(
                "tensor",
                format!("not on the {} device of this engine", e.lane.name()),
            )),
        );
    }
    let mut prim = match take(&e.lane, tensor) {
        Ok(p) => p,
        Err((t, err)) => return (t, Err(err)),
    };
    let result = e.register(stream, &mut prim, &shape, config).and_then(|id| {
        let Some(l) = loaded else { return Ok(id) };
        let imported = if l.outside == e.entries[id.index()].held {
            Err(BurnError::Record(
                "the record's state holds the parameter's value where this tensor's dtype makes lpmm hold it, or the reverse (the parameter's dtype changed)".into(),
            ))
        } else {
            e.import(id, &mut prim, &l.param)
        };
        if imported.is_err() {
            // It stays registered (lpmm cannot unregister a parameter); nothing refers to it.
            e.release(id);
        }
        imported.map(|()| id)
    });
    (e.lane.give(prim), result)
}

/// Steps parameter `id` of engine `e` with `grad` at `lr`.
fn step_on<L: Lane, const D: usize>(
    e: &mut Engine<L>,
    id: lpmm_optim::ParamId,
    lr: f64,
    tensor: Tensor<D>,
    grad: Tensor<D>,
) -> (Tensor<D>, Result<StepReport, BurnError>) {
    if !e.lane.owns(&grad.device()) || !e.lane.owns(&tensor.device()) {
        return (
            tensor,
            Err(BurnError::device(
                grad.device(),
                format!("not on the {} device of this state", e.lane.name()),
            )),
        );
    }
    let mut prim = match take(&e.lane, tensor) {
        Ok(p) => p,
        Err((t, err)) => return (t, Err(err)),
    };
    let result = match e.lane.take(grad) {
        Ok(mut g) => e
            .lane
            .prepare(&mut g, false)
            .and_then(|_| e.step(id, lr, &mut prim, &g)),
        Err(err) => Err(err),
    };
    (e.lane.give(prim), result)
}

impl burn_optim::Optimizer for LpmmTensorOptimizer {
    type State<const D: usize> = LpmmState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        self.step_tensor(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        state.to_device(device)
    }
}
