//! The per-tensor optimizer's engines: one lpmm optimizer on one device whose parameters are the
//! slots of the per-tensor states, registered in the order the optimizer first meets them (their
//! index keys their stochastic-rounding streams, as the whole-module optimizer's registration
//! order does), each stepped alone with its own gradient and learning rate.

use lpmm_optim::Out;
use lpmm_optim::Parts;
use std::sync::{Arc, Mutex, MutexGuard};

use burn_core::tensor::{Device, Tensor};
use lpmm_optim::backend::{Backend, Dtype, HostRegion, HostSlot, HostValues};
use lpmm_optim::checkpoint::CanonicalParam;
use lpmm_optim::{
    Grad, Gradients, Lent, LrRule, NonFinitePolicy, OptimError, Optimizer, OptimizerOptions,
    ParamConfig, ParamId, SlotKind, Step, StepReport, WithGradient,
};

use crate::BurnError;
use crate::core::{lends, optimizer};
use crate::lane::Lane;
use crate::persist;

/// What the engine keeps of one registered parameter.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// Its group (each parameter has its own, so each takes its own learning rate); `None` for a
    /// placeholder that only moves the next registration to its stream.
    pub group: Option<usize>,
    /// lpmm holds its value (decoded into the tensor after each step) rather than stepping the
    /// tensor in place.
    pub held: bool,
    pub shape: Vec<usize>,
    /// The configuration it was registered with, before the minimum-size and shape rules
    /// resolved its storages (what a record carries, as the whole-module optimizer's does).
    pub requested: ParamConfig,
    /// Steps taken (lpmm's own counter moves with it; a record carries it).
    pub steps: u64,
    /// A state still refers to it (a released one keeps its memory until the engine goes).
    pub live: bool,
}

/// One lpmm optimizer on one lane.
pub(crate) struct Engine<L: Lane> {
    pub lane: L,
    pub opt: Optimizer<L::B>,
    pub entries: Vec<Entry>,
    /// Private copies of a parameter tensor the steps made (a tensor shared with another, as
    /// burn-train's `Learner` keeps the model it steps, or not contiguous).
    pub copies: u64,
}

impl<L: Lane> std::fmt::Debug for Engine<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("lane", &self.lane.name())
            .field("entries", &self.entries.len())
            .finish()
    }
}

/// A step's gradient as lpmm's [`Gradients`]: this one parameter's, none for the others.
struct One<'a, B: Backend> {
    id: ParamId,
    grad: B::Input<'a>,
}

impl<B: Backend> Gradients<B> for One<'_, B> {
    fn gradient(&mut self, id: ParamId, f: &mut WithGradient<'_, B>) -> Result<(), OptimError> {
        f((id == self.id).then_some(self.grad))
    }
}

/// Zeros of a lent parameter's dtype: what stands in for its value (the module's tensor, which
/// the module record saves) when its slots are exported.
fn zeros(dtype: Dtype, numel: usize) -> ZeroValues {
    match dtype {
        Dtype::Bf16 => ZeroValues::Bf16(vec![lpmm_formats::bf16::ZERO; numel]),
        _ => ZeroValues::F32(vec![0.0; numel]),
    }
}

enum ZeroValues {
    F32(Vec<f32>),
    Bf16(Vec<lpmm_formats::bf16>),
}

impl ZeroValues {
    fn values(&self) -> HostValues<'_> {
        match self {
            ZeroValues::F32(v) => HostValues::F32(v),
            ZeroValues::Bf16(v) => HostValues::Bf16(v),
        }
    }
}

impl<L: Lane> Engine<L> {
    pub fn new(lane: L, options: OptimizerOptions) -> Result<Self, BurnError> {
        let opt = optimizer(&lane, options)?;
        Ok(Engine {
            lane,
            opt,
            entries: Vec::new(),
            copies: 0,
        })
    }

    /// Whether a parameter can still be registered at `stream` here.
    pub fn free(&self, stream: u64) -> bool {
        self.opt.status().params as u64 <= stream
    }

    /// Registers placeholders (one f32 element each, no gradient expected) until the next
    /// registration gets index `stream`. They are plain f32 SGD whatever the optimizer's rule: a
    /// rule that takes only some shapes (Muon: matrices) would refuse the placeholder, and with it
    /// every parameter after it.
    fn pad_to(&mut self, stream: u64) -> Result<(), BurnError> {
        let pad = lpmm_optim::presets::sgdm_f32(0.0, 0.0).build();
        while (self.opt.status().params as u64) < stream {
            let group = self.opt.add_group(pad)?;
            let name = format!("pad{}", self.opt.status().params);
            let id = self.opt.add_param_with(&name, &[1], &[0.0], group, pad)?;
            self.entries.push(Entry {
                group: None,
                held: true,
                shape: vec![1],
                requested: pad,
                steps: 0,
                live: false,
            });
            self.opt.set_expects_gradient(id, false)?;
        }
        Ok(())
    }

    /// Registers the parameter whose tensor is `prim` (read only) at index `stream`, with
    /// `config`: the tensor itself where its dtype is the storage's (lent), otherwise a copy in
    /// lpmm's storage (held).
    pub fn register(
        &mut self,
        stream: u64,
        prim: &mut L::Prim,
        shape: &[usize],
        config: &ParamConfig,
    ) -> Result<ParamId, BurnError> {
        if !self.free(stream) {
            return Err(BurnError::Record(format!(
                "internal: stream {stream} is taken in this engine"
            )));
        }
        self.pad_to(stream)?;
        let numel: usize = shape.iter().product();
        let name = stream.to_string();
        let lent = lends(config, numel, shape, self.lane.dtype(prim));
        let group = self.opt.add_group(*config)?;
        let id = if lent {
            self.lane.prepare(prim, false)?;
            let values = self.lane.input(prim)?;
            let id = self
                .opt
                .add_lent_param(&name, shape, values, group, *config)?;
            self.lane.settle()?;
            id
        } else {
            let host = self.lane.to_host(prim)?;
            self.opt
                .add_param_with(&name, shape, &host, group, *config)?
        };
        // One entry per lpmm parameter, at its index, from here on.
        self.entries.push(Entry {
            group: Some(group),
            held: !lent,
            shape: shape.to_vec(),
            requested: *config,
            steps: 0,
            live: true,
        });
        if id.index() as u64 != stream {
            self.release(id);
            return Err(BurnError::Record(format!(
                "internal: registered at {} instead of stream {stream}",
                id.index()
            )));
        }
        // Coverage is not the engine's to check: burn's `ModuleOptimizer` hands it one parameter
        // at a time.
        if let Err(e) = self.opt.set_expects_gradient(id, false) {
            self.release(id);
            return Err(e.into());
        }
        Ok(id)
    }

    /// Imports a saved state `p` into parameter `id` (just registered from its tensor `prim`):
    /// its counters, its states and, where its value is the tensor, the parameter slot's other
    /// regions (a Kahan compensation, a split remainder), with the tensor's values as the primary
    /// region; where lpmm holds the value, the record's value, then decoded into the tensor.
    pub fn import(
        &mut self,
        id: ParamId,
        prim: &mut L::Prim,
        p: &CanonicalParam,
    ) -> Result<(), BurnError> {
        let held = self.entries[id.index()].held;
        for (slot, host) in SlotKind::ALL.into_iter().zip(&p.slots) {
            if slot != SlotKind::Param {
                persist::import_slot(&mut self.opt, id, slot, host, None)?;
                continue;
            }
            if held {
                persist::import_slot(&mut self.opt, id, slot, host, None)?;
                continue;
            }
            if !host.regions.iter().any(|r| !r.spec.suffix.is_empty()) {
                // The tensor's own value is the whole slot.
                continue;
            }
            let mut host = host.clone();
            if host.region("").is_none() {
                let bytes = self.lane.to_host_bytes(prim)?;
                let spec = self
                    .opt
                    .param(id)?
                    .config
                    .param
                    .format()
                    .and_then(|f| {
                        f.regions(&self.entries[id.index()].shape)
                            .into_iter()
                            .find(|r| r.suffix.is_empty())
                    })
                    .ok_or_else(|| BurnError::Record("no primary region".into()))?;
                host.regions.insert(0, HostRegion { spec, bytes });
            }
            if self.lane.prepare(prim, true)? {
                self.copies += 1;
            }
            let out = self.lane.output(prim)?;
            persist::import_slot(&mut self.opt, id, slot, &host, Some(out))?;
            self.lane.settle()?;
        }
        persist::restore_counters(&mut self.opt, id, p)?;
        self.entries[id.index()].steps = p.steps;
        if held {
            self.decode(id, prim)?;
        }
        Ok(())
    }

    /// Parameter `id`'s state in the canonical layout, and whether its value is outside it (the
    /// tensor's). The value of a lent parameter is not read: zeros stand in for it.
    pub fn export(&self, id: ParamId) -> Result<(CanonicalParam, bool), BurnError> {
        let entry = &self.entries[id.index()];
        // The storages in force (resolved for this shape) for the value's dtype; the record
        // carries the requested configuration, which resolves to them again (a resolved one need
        // not validate as a configuration: CAME's factorized state of a vector resolves to none).
        let config = self.opt.param(id)?.config;
        let numel: usize = entry.shape.iter().product();
        let lent = !entry.held;
        let dtype = config
            .param
            .format()
            .and_then(|f| f.lendable())
            .unwrap_or(Dtype::F32);
        let zeros = lent.then(|| zeros(dtype, numel));
        let backend = Parts::of(&self.opt).backend();
        let mut slots: [HostSlot; lpmm_optim::backend::SLOTS] = Default::default();
        for (slot, out) in SlotKind::ALL.into_iter().zip(slots.iter_mut()) {
            let input = match (&zeros, slot) {
                (Some(z), SlotKind::Param) => Some(backend.host_input(z.values())),
                _ => None,
            };
            *out = persist::export_slot(&self.opt, id, slot, input)?;
        }
        Ok((
            CanonicalParam {
                name: String::new(),
                shape: entry.shape.clone(),
                group: 0,
                requested: entry.requested,
                steps: entry.steps,
                accumulations: 0,
                pending: false,
                lr_rule: LrRule::Group,
                rule_state: persist::rule_state(&self.opt, id)?,
                slots,
            },
            lent,
        ))
    }

    /// Writes the value lpmm holds for parameter `id` into its tensor.
    fn decode(&mut self, id: ParamId, prim: &mut L::Prim) -> Result<(), BurnError> {
        if self.lane.prepare(prim, true)? {
            self.copies += 1;
        }
        let out = self.lane.output(prim)?;
        self.opt.read(id, SlotKind::Param, Out::Backend(out))?;
        self.lane.settle()
    }

    /// One step of parameter `id` (its tensor `prim`, its gradient `grad`) at learning rate
    /// `lr`. Under `SkipElements` the gradient is read where it is, and on a device nothing comes
    /// back but lpmm's non-finite flag; under `SkipStep` the gradient is checked first and a
    /// non-finite one skips this parameter's step.
    pub fn step(
        &mut self,
        id: ParamId,
        lr: f64,
        prim: &mut L::Prim,
        grad: &L::Prim,
    ) -> Result<StepReport, BurnError> {
        let entry = self.entries[id.index()].clone();
        let group = entry
            .group
            .ok_or_else(|| BurnError::Record("internal: a placeholder cannot step".into()))?;
        let numel: usize = entry.shape.iter().product();
        if self.lane.dtype(grad).is_none() {
            return Err(BurnError::param(
                format!("#{}", id.index()),
                "its gradient is not f32 or bf16",
            ));
        }
        if self.lane.numel(grad) != numel {
            return Err(BurnError::param(
                format!("#{}", id.index()),
                format!(
                    "its gradient has {} elements, the parameter {numel}",
                    self.lane.numel(grad)
                ),
            ));
        }
        self.opt.set_group_lr(group, lr)?;
        let policy = self.opt.status().options.non_finite;
        let report = {
            let g = self.lane.input(grad)?;
            if entry.held {
                match policy {
                    NonFinitePolicy::SkipElements => {
                        self.opt.step(Step::given(&mut One::<L::B> { id, grad: g }))
                    }
                    NonFinitePolicy::SkipStep => self.opt.step(Step::param(id, Grad::Input(g))),
                }
            } else {
                if self.lane.prepare(prim, true)? {
                    self.copies += 1;
                }
                let out = self.lane.output(prim)?;
                let mut lent = [(id, out)];
                let lent = Lent::Buffers(&mut lent);
                match policy {
                    NonFinitePolicy::SkipElements => self
                        .opt
                        .step(Step::given(&mut One::<L::B> { id, grad: g }).lent(lent)),
                    NonFinitePolicy::SkipStep => {
                        self.opt.step(Step::param(id, Grad::Input(g)).lent(lent))
                    }
                }
            }
        };
        self.lane.settle()?;
        let report = report?;
        self.entries[id.index()].steps += report.updated as u64;
        if entry.held && report.updated > 0 {
            self.decode(id, prim)?;
        }
        Ok(report)
    }

    /// The state of parameter `id` is gone: its memory is kept until the engine goes (lpmm
    /// cannot unregister a parameter).
    pub fn release(&mut self, id: ParamId) {
        if let Some(e) = self.entries.get_mut(id.index()) {
            e.live = false;
        }
    }

    /// Live parameters.
    pub fn live(&self) -> usize {
        self.entries.iter().filter(|e| e.live).count()
    }
}

/// An engine on whichever lane serves its device.
#[derive(Debug)]
pub(crate) enum AnyEngine {
    #[cfg(any(feature = "ndarray", feature = "flex"))]
    Cpu(Engine<crate::lane::cpu::CpuLane>),
    #[cfg(feature = "wgpu")]
    Wgpu(Engine<crate::wgpu::WgpuLane>),
    #[cfg(feature = "cuda")]
    Cuda(Engine<crate::cuda::CudaLane>),
}

/// Runs `$body` with `$e` bound to the engine, whatever its lane.
macro_rules! on_any {
    ($engine:expr, $e:ident => $body:expr) => {
        match $engine {
            #[cfg(any(feature = "ndarray", feature = "flex"))]
            $crate::tensor::engine::AnyEngine::Cpu($e) => $body,
            #[cfg(feature = "wgpu")]
            $crate::tensor::engine::AnyEngine::Wgpu($e) => $body,
            #[cfg(feature = "cuda")]
            $crate::tensor::engine::AnyEngine::Cuda($e) => $body,
        }
    };
}
pub(crate) use on_any;

impl AnyEngine {
    /// An engine for tensors on `device`.
    pub fn new(device: &Device, options: OptimizerOptions) -> Result<Self, BurnError> {
        #[cfg(any(feature = "ndarray", feature = "flex"))]
        {
            let lane = crate::lane::cpu::CpuLane;
            if lane.owns(device) {
                return Ok(AnyEngine::Cpu(Engine::new(lane, options)?));
            }
        }
        #[cfg(feature = "wgpu")]
        if let Some(lane) = crate::wgpu::WgpuLane::for_device(device)? {
            return Ok(AnyEngine::Wgpu(Engine::new(lane, options)?));
        }
        #[cfg(feature = "cuda")]
        if let Some(lane) = crate::cuda::CudaLane::for_device(device)? {
            return Ok(AnyEngine::Cuda(Engine::new(lane, options)?));
        }
        let _ = options;
        Err(BurnError::device(
            device,
            "no lpmm backend for this device in this build (features: ndarray, flex, wgpu, cuda)",
        ))
    }
}

/// An engine shared by the states whose slots it holds.
pub(crate) type EngineCell = Mutex<AnyEngine>;

pub(crate) fn lock(cell: &EngineCell) -> MutexGuard<'_, AnyEngine> {
    cell.lock().unwrap_or_else(|e| e.into_inner())
}

/// A state's slots in an engine: parameter `id`, registered at `stream`, of optimizer `owner`, on
/// `device`. Dropping it releases the parameter.
pub(crate) struct Slot {
    pub engine: Arc<EngineCell>,
    pub id: ParamId,
    pub stream: u64,
    pub owner: u64,
    pub device: Device,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("id", &self.id)
            .field("stream", &self.stream)
            .field("owner", &self.owner)
            .finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut engine = lock(&self.engine);
        on_any!(&mut *engine, e => e.release(self.id));
    }
}

/// Takes a tensor's primitive, giving the tensor back when the lane refuses it.
#[allow(clippy::result_large_err)] // the error hands the caller's tensor back, by value
pub(crate) fn take<L: Lane, const D: usize>(
    lane: &L,
    t: Tensor<D>,
) -> Result<L::Prim, (Tensor<D>, BurnError)> {
    let backup = t.clone();
    match lane.take(t) {
        Ok(p) => Ok(p),
        Err(e) => Err((backup, e)),
    }
}
