//! candle integration: [`LpmmOptimizer`] implements [`candle_nn::Optimizer`] for any lpmm
//! configuration, with one copy of each parameter.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_nn::{Module as _, Optimizer as _, VarBuilder, VarMap};
//! use lpmm_candle::{LpmmConfig, LpmmOptimizer};
//! use lpmm_optim::presets;
//!
//! let config = LpmmConfig::from(presets::adamw_8bit_bf16_sr(1e-3));
//! let varmap = VarMap::new();
//! // Create the Vars in the dtype lpmm stores the parameters in (bf16 here): the Vars then *are*
//! // lpmm's parameters, stepped in place.
//! let vb = VarBuilder::from_varmap(&varmap, config.var_dtype(), &Device::Cpu);
//! let layer = candle_nn::linear(784, 10, vb.pp("fc"))?;
//! let x = Tensor::ones((8, 784), config.var_dtype(), &Device::Cpu)?;
//! let mut opt = LpmmOptimizer::from_varmap(&varmap, config)?;
//! let loss = layer.forward(&x)?.sqr()?.mean_all()?;
//! opt.backward_step(&loss)?; // or opt.accumulate(loss.backward()?) per micro-batch, then opt.apply()
//! assert!(!opt.last_report().expect("a step was taken").skipped);
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! Every step also checks that each parameter received a gradient: see "Does my model train?"
//! below before training a model built with candle-nn's norms or softmax.
//!
//! # What a training process holds
//!
//! - **Parameters.** Where the storage is f32 or bf16 (and Kahan or split f32, whose bf16 half is
//!   the Var) and the `Var` has that dtype ([`LpmmConfig::var_dtype`]), the `Var` *is* lpmm's
//!   parameter: lpmm steps its storage in place and keeps no copy (a lent parameter), on the CPU
//!   and, with feature `cuda`, in a candle CUDA device's memory (see "CUDA" below). A `Var` of
//!   another dtype still trains, with lpmm holding the parameter in its storage and the `Var` set
//!   to it after every step (a second copy; a `tracing` warning says so). Parameters below 16 bits
//!   (LPMM-SGDM's 8-bit ones) are best held by lpmm alone through the layers of [`nn`]
//!   ([`LpmmOptimizer::linear`], [`LpmmOptimizer::embedding`]), which dequantize the weight while
//!   their layer computes, in forward and again in backward, and free it after.
//! - **Gradients.** `backward_step` (`candle_nn::Optimizer`) and [`LpmmOptimizer::step_grads`]
//!   step from candle's `GradStore` where the gradients are and drop each once its parameter has
//!   stepped, and lpmm allocates no accumulator for a parameter stepped this way;
//!   [`LpmmOptimizer::accumulate`] adds a micro-batch's gradients into lpmm's accumulators (in
//!   their storage format), dropping each once added. candle's `backward()` returns only when
//!   every gradient exists, so the whole `GradStore` (in the `Var`s' dtype) is still the peak of
//!   a step over `Var`s, even with a released-gradient preset; only the layers of [`nn`] hand a
//!   gradient to lpmm inside the backward pass (a released preset then steps it there).
//! - **States** in their configured storage.
//!
//! Identity: parameters are named by their `VarMap` path ([`LpmmOptimizer::from_varmap`]) or by
//! the names the caller passes, and registered in name order, so stochastic-rounding streams and
//! checkpoints are tied to the same tensor in every process. Every step's [`StepReport`] is
//! kept ([`LpmmOptimizer::last_report`]) and skipped steps and non-finite gradients are logged
//! with `tracing`; parameters without a gradient are reported as "Does my model train?" below
//! says.
//!
//! # CUDA (feature `cuda`)
//!
//! With feature `cuda` (facade: `lpmm`'s `candle-cuda`), `Var`s on a candle CUDA device
//! (`Device::new_cuda(0)`) are stepped by lpmm-cuda where candle keeps them. An optimizer steps
//! the `Var`s of one device: the first `Var` registered picks it (an optimizer is the CPU's until
//! then), and a `Var` on any other device (another candle CUDA device too: candle's
//! `same_device`, one stream) is refused with an error. What happens:
//!
//! - **One cudarc, candle's stream.** candle-core 0.11.1's `cuda` feature depends on cudarc
//!   0.19.10, the version this workspace pins for lpmm-cuda, so the build has one cudarc and
//!   the two share its types: lpmm-cuda runs on candle's own stream (`CudaDevice::cuda_stream`,
//!   in candle's context, the device's primary context), and reads candle's `CudaSlice`s through
//!   typed views (`lpmm_cuda::CudaView::new` / `read_only` of the tensor's contiguous range,
//!   its layout's start offset included): no raw pointer, no `unsafe`, and no synchronisation
//!   between two streams, since candle's work and lpmm's are enqueued on the same stream in
//!   order. candle's default CUDA device uses the per-thread default stream: as for candle's own
//!   operations, step on the thread that ran the backward pass (or synchronise the device).
//! - **No copy per step.** A lent `Var` is stepped in place inside a candle in-place operation;
//!   each gradient is read from the `GradStore` where candle computed it and dropped once its
//!   parameter has stepped (a gradient that is not contiguous f32 or bf16 is first converted on
//!   the device). A `Var` lpmm holds a copy of is set on the device too (its parameter decoded
//!   into the `Var`'s storage), except an f16 or f64 `Var`, set through the host as on the CPU.
//!   Registration reads a copied `Var`'s initial values through the host once.
//!   [`LpmmOptimizer::with_optimizer`] is the CPU optimizer's
//!   (`LpmmOptimizer::with_cuda_optimizer` gives the lpmm-cuda one).
//! - **lpmm's layers** ([`nn`]) created with weights on the CUDA device are held by lpmm-cuda:
//!   each use decodes the weight into a device tensor, and the backward pass hands the weight's
//!   gradient to lpmm-cuda where candle computed it (accumulated, or a released step). Their
//!   input and output are copied once on the device (a custom operation receives storage, not
//!   a tensor).
//! - **Linking.** candle-core asks cudarc for `dynamic-linking`; lpmm-cuda alone loads the
//!   driver at run time. The workspace asks cudarc for `fallback-dynamic-loading`, which gives
//!   way to candle's linking when candle's `cuda` is in the build (cudarc refuses
//!   `dynamic-loading` and `dynamic-linking` together). So a binary built with this feature
//!   needs the CUDA libraries candle links (libcuda, libcudart, libcublas, libcublasLt,
//!   libcurand, libnvrtc) to start at all, like every candle CUDA binary. The bindings stay
//!   CUDA 12.8's (the workspace's `cuda-12080`, which also spares cudarc from asking nvcc).
//! - **Building** needs nvcc: candle-kernels compiles candle's kernels at build time
//!   (cudaforge: `NVCC`, `CUDA_HOME`, `CUDA_COMPUTE_CAP` where no GPU is there to ask).
//!   Without a CUDA toolkit, NVIDIA's pip wheels do (about 350 MB; candle-kernels' build then
//!   took 16 minutes of wall time on two shared cores, 8 of CPU time: too long for CI):
//!
//!   ```text
//!   python3 -m venv target/nvcc-venv
//!   target/nvcc-venv/bin/pip install nvidia-cuda-nvcc==13.2.86 nvidia-nvvm==13.2.86 \
//!       nvidia-cuda-crt==13.2.86 nvidia-cuda-runtime==13.2.86 nvidia-cuda-cccl==13.2.86
//!   C=$(target/nvcc-venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13
//!   NVCC=$C/bin/nvcc CUDA_HOME=$C CUDA_COMPUTE_CAP=80 \
//!       cargo clippy -p lpmm-candle --features cuda --all-targets -- -D warnings
//!   ```
//!
//!   CI checks it with `NVCC=.ci/check-nvcc` instead, an nvcc that writes empty kernels (a check
//!   build needs only their files); `cargo xtask gpu-bundle` builds it for a GPU with the CUDA
//!   13.0 wheels.
//!
//! - **Status:** compile-checked (library and tests) on a machine without a GPU; not yet run on a
//!   GPU. `tests/cuda.rs` steps bf16 and f32 `Var`s on CUDA and on the CPU from the same
//!   gradients and compares every bit of the `Var`s and states and the reports, that the
//!   `Var`s' device addresses never change, and a checkpoint saved on CUDA resumed on the CPU;
//!   it skips with a message where no device is present (`LPMM_REQUIRE_CUDA=1`: fails).
//!
//! # Does my model train?
//!
//! A model can train badly without any error: its loss falls through the parameters that receive
//! gradients while the others keep their initial values. In candle-nn 0.11 (checked in 0.11.1)
//! three fused operators have no backward pass: their output is a constant to autograd, so no
//! gradient reaches anything before them, and candle raises no error or warning.
//!
//! - `candle_nn::ops::layer_norm` is applied with `Tensor::apply_op3_no_bwd`, and
//!   `candle_nn::LayerNorm::forward` takes that path for every contiguous input when the layer
//!   has a bias (as `candle_nn::layer_norm(size, eps, vb)` builds it).
//! - `candle_nn::ops::rms_norm` is applied with `apply_op2_no_bwd`, and
//!   `candle_nn::RmsNorm::forward` takes it for every contiguous input.
//! - `candle_nn::ops::softmax_last_dim` is applied with `apply_op1_no_bwd`.
//!
//! In a pre-norm transformer built with `candle_nn::LayerNorm` or `candle_nn::RmsNorm` the final
//! norm stops every gradient: only the output head trains (candle-transformers 0.11's
//! `llama2_c::Llama` ends in a `candle_nn::RmsNorm`, `ln_f`, before `lm_head`); with
//! `softmax_last_dim` in the attention, the queries and keys never train. lpmm's own comparison
//! model did exactly this until it was fixed ([docs/RESULTS.md] has the before and after).
//!
//! **The check.** Every step reports the registered parameters that received no gradient
//! ([`StepReport::missing_gradients`]: how many, of how many, and the first
//! [`lpmm_optim::MISSING_NAMES`] names), and applies [`LpmmConfig::missing_gradient`]:
//!
//! - `MissingGradientPolicy::Warn` (the default): the step goes ahead, and on the first step
//!   that finds such parameters, and each time that set changes, a warning names them, gives the
//!   likely causes (these operators, a detached tensor, an unused layer) and says how to silence
//!   it. It goes to `tracing` where a subscriber records lpmm's warnings and to **stderr**
//!   otherwise: most training programs install no subscriber, and a model that does not train is
//!   a defect to see on the first step, not a log line nobody collects.
//! - `MissingGradientPolicy::Error`: the step is refused with an error naming them, and nothing
//!   changes (no `Var`, state or counter moves; the gradients stay in the `GradStore`). The
//!   strict choice for a new model:
//!   `LpmmConfig::from(preset).with_missing_gradient(MissingGradientPolicy::Error)`.
//! - `MissingGradientPolicy::Ignore`: only the step report counts them.
//!
//! A parameter counts as covered when the step has its gradient (from the `GradStore`, or
//! accumulated since the last step: [`LpmmOptimizer::accumulate`], an lpmm layer's backward
//! pass), or when a released step took it during the backward pass. `Var`s frozen on purpose
//! are left out with [`LpmmConfig::with_frozen`] (a name pattern; the optimizer then never
//! registers or steps them), or by passing the optimizer only the `Var`s it trains.
//!
//! **The replacements.** `candle_nn::ops::softmax(x, D::Minus1)` and
//! `candle_nn::ops::layer_norm_slow` / `rms_norm_slow` in candle-nn itself, or this crate's
//! [`ops`]: [`ops::layer_norm`], [`ops::rms_norm`], [`ops::softmax_last_dim`],
//! [`ops::causal_softmax`] and the module types [`ops::LayerNorm`] / [`ops::RmsNorm`]
//! (`let ln: lpmm_candle::ops::LayerNorm = candle_nn::layer_norm(size, 1e-5, vb)?.into();`), with
//! fused f32 CPU kernels that have their own backward pass, each tested against candle-nn's
//! forward values, the closed-form gradients and finite differences. A model whose code you do
//! not control (candle-transformers') needs its norms swapped in its source.
//!
//! **f32-only models.** Some models run only in f32 whatever their `Var`s are:
//! `llama2_c::Llama` with bf16 `Var`s fails in its attention mask, which it builds in f32
//! ("dtype mismatch in where"). Keep such a model's `Var`s f32 and take a preset with f32
//! parameters (`presets::adamw_8bit`: the `Var`s are lpmm's parameters, 8-bit states); a bf16
//! preset over f32 `Var`s also trains, but through a copy (see "What a training process holds"
//! above), which holds more than `adamw_8bit` does (the README's "Which preset").
//!
//! [docs/RESULTS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/RESULTS.md

#[cfg(feature = "cuda")]
mod cuda;
pub mod nn;
pub mod ops;

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Error, InplaceOp1, Layout, Result, Storage, Tensor, Var};
use candle_nn::VarMap;
use lpmm_optim::backend::{Dtype, HostValues, HostValuesMut};
use lpmm_optim::{
    Cpu, Gradients, Lender, MemoryReport, MissingGradientHelp, MissingGradientPolicy, OptimError,
    Optimizer, OptimizerOptions, ParamConfig, ParamId, SlotKind, StepReport, WithGradient,
    backend::Backend,
};

/// The configuration of an [`LpmmOptimizer`]: one lpmm configuration for every parameter, the
/// optimizer-wide options, parameter groups by name pattern, the frozen `Var`s and what a step
/// does when a parameter received no gradient.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LpmmConfig {
    /// Storage formats and hyperparameters (e.g. `lpmm_optim::presets::adamw_8bit(1e-3)`).
    pub param: ParamConfig,
    /// Seed, clipping, non-finite policy.
    pub options: OptimizerOptions,
    /// Parameter groups: a parameter whose name matches a pattern (`*` matches any run of
    /// characters) takes that group's configuration; the first match wins.
    pub groups: Vec<(String, ParamConfig)>,
    /// Name patterns of `Var`s frozen on purpose: not registered, so never stepped and never
    /// expected to receive a gradient.
    pub frozen: Vec<String>,
    /// What a step does when registered parameters received no gradient (crate docs, "Does my
    /// model train?"): warn by default.
    pub missing_gradient: MissingGradientPolicy,
}

impl From<ParamConfig> for LpmmConfig {
    fn from(param: ParamConfig) -> Self {
        LpmmConfig {
            param,
            options: OptimizerOptions::default(),
            groups: Vec::new(),
            frozen: Vec::new(),
            missing_gradient: MissingGradientPolicy::default(),
        }
    }
}

/// What lpmm-candle's missing-gradient warning and error say about causes and remedies.
const MISSING_GRADIENT_HELP: MissingGradientHelp = MissingGradientHelp::new(
    "an operator without a backward pass between them and the loss: candle-nn 0.11's fused \
     candle_nn::LayerNorm (with a bias) / candle_nn::ops::layer_norm, candle_nn::RmsNorm / \
     candle_nn::ops::rms_norm and candle_nn::ops::softmax_last_dim; use the differentiable \
     lpmm_candle::ops::{LayerNorm, RmsNorm, layer_norm, rms_norm, softmax_last_dim} instead \
     (lpmm-candle's docs, \"Does my model train?\")",
    "LpmmConfig::with_frozen(pattern), or leave them out of the Vars given to the optimizer",
    "LpmmConfig::with_missing_gradient",
);

/// Applies `config`'s missing-gradient policy, with lpmm-candle's help, to `opt`.
fn configure<B: Backend>(opt: &mut Optimizer<B>, config: &LpmmConfig) {
    opt.settings_mut().missing_gradient = config.missing_gradient;
    opt.settings_mut().missing_gradient_help = MISSING_GRADIENT_HELP;
}

impl<R: Into<lpmm_optim::Hyper>> From<lpmm_optim::presets::Preset<R>> for LpmmConfig {
    fn from(preset: lpmm_optim::presets::Preset<R>) -> Self {
        LpmmConfig::from(preset.build())
    }
}

impl LpmmConfig {
    /// With these optimizer-wide options.
    pub fn with_options(self, options: OptimizerOptions) -> Self {
        LpmmConfig { options, ..self }
    }

    /// With a parameter group: parameters whose name matches `pattern` take `config` (e.g. no
    /// weight decay for `*bias` and `*ln*`).
    pub fn with_group(mut self, pattern: &str, config: impl Into<ParamConfig>) -> Self {
        self.groups.push((pattern.to_string(), config.into()));
        self
    }

    /// With the `Var`s whose name matches `pattern` (`*` matches any run of characters) frozen:
    /// the optimizer does not register them, so it never steps them and does not expect a
    /// gradient for them (e.g. `"embed.*"` for a pretrained embedding kept fixed).
    pub fn with_frozen(mut self, pattern: &str) -> Self {
        self.frozen.push(pattern.to_string());
        self
    }

    /// With policy `policy` for a step that finds registered parameters without a gradient:
    /// `Warn` (the default: the step goes ahead and the parameters are named on stderr, or
    /// through `tracing` where a subscriber records lpmm's warnings), `Error` (the step is
    /// refused, nothing changes, and the error names them) or `Ignore` (only the step report,
    /// [`StepReport::missing_gradients`], counts them).
    pub fn with_missing_gradient(self, policy: MissingGradientPolicy) -> Self {
        LpmmConfig {
            missing_gradient: policy,
            ..self
        }
    }

    /// Whether `Var` `name` is frozen ([`LpmmConfig::with_frozen`]).
    fn is_frozen(&self, name: &str) -> bool {
        self.frozen.iter().any(|p| matches(p, name))
    }

    /// The dtype to create `Var`s in so that each `Var` is lpmm's parameter (no copy): bf16 for
    /// bf16, Kahan and split-f32 storage, f32 otherwise (below 16 bits, use the layers of
    /// [`nn`]).
    pub fn var_dtype(&self) -> DType {
        match self.param.param.format().and_then(|f| f.lendable()) {
            Some(Dtype::Bf16) => DType::BF16,
            _ => DType::F32,
        }
    }

    /// The group (0: the default) and configuration of parameter `name`.
    pub(crate) fn config_for(&self, name: &str) -> (usize, ParamConfig) {
        self.groups
            .iter()
            .enumerate()
            .find(|(_, (p, _))| matches(p, name))
            .map_or((0, self.param), |(k, (_, c))| (k + 1, *c))
    }
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters.
fn matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return pattern == name;
    }
    if !name.starts_with(first) || !name[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

fn wrap(e: OptimError) -> Error {
    Error::wrap(e)
}

/// A `Var` registered with lpmm.
#[derive(Debug)]
struct Entry {
    name: String,
    var: Var,
    id: ParamId,
    /// The `Var` is the parameter (lent); otherwise lpmm holds it and the `Var` is set to it
    /// after every step.
    lent: bool,
}

/// The lpmm optimizer on the backend of the `Var`s' device: the CPU, or (feature `cuda`) lpmm-cuda
/// on the candle CUDA device's own stream.
#[derive(Debug)]
pub(crate) enum Engine {
    Cpu(Optimizer<Cpu>),
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaEngine),
}

/// Runs `$body` with `$o` bound to the engine's optimizer (`&mut`), whatever its backend.
macro_rules! on_engine {
    ($engine:expr, $o:ident => $body:expr) => {
        match $engine {
            Engine::Cpu($o) => $body,
            #[cfg(feature = "cuda")]
            Engine::Cuda(e) => {
                let $o = &mut e.opt;
                $body
            }
        }
    };
}

/// `on_engine!` for a shared borrow.
macro_rules! on_engine_ref {
    ($engine:expr, $o:ident => $body:expr) => {
        match $engine {
            Engine::Cpu($o) => $body,
            #[cfg(feature = "cuda")]
            Engine::Cuda(e) => {
                let $o = &e.opt;
                $body
            }
        }
    };
}

impl Engine {
    /// The CPU optimizer.
    pub(crate) fn cpu(&self) -> Result<&Optimizer<Cpu>> {
        match self {
            Engine::Cpu(o) => Ok(o),
            #[cfg(feature = "cuda")]
            Engine::Cuda(_) => Err(Error::Msg(
                "this optimizer steps CUDA parameters: its lpmm optimizer is lpmm-cuda's \
                 (LpmmOptimizer::with_cuda_optimizer)"
                    .into(),
            )),
        }
    }

    fn is_empty(&self) -> bool {
        on_engine_ref!(self, o => o.is_empty())
    }

    /// A short name of the device ("cpu", "cuda:0").
    fn device_name(&self) -> String {
        match self {
            Engine::Cpu(_) => "cpu".into(),
            #[cfg(feature = "cuda")]
            Engine::Cuda(e) => e.name(),
        }
    }

    /// Whether `device` is this engine's device.
    fn owns(&self, device: &candle_core::Device) -> bool {
        match self {
            Engine::Cpu(_) => device.is_cpu(),
            #[cfg(feature = "cuda")]
            Engine::Cuda(e) => e.owns(device),
        }
    }
}

/// How tensors of one candle device meet one lpmm backend: a tensor's memory as the backend's
/// input, a `Var`'s as its output (in place). The CPU: host slices; CUDA (feature `cuda`):
/// lpmm-cuda views of candle's device memory.
pub(crate) trait Lane: Backend + Clone {
    /// Calls `f` with a tensor's values as this backend's input: where they are for a
    /// contiguous f32 or bf16 tensor, converted otherwise.
    fn input<T>(&self, t: &Tensor, f: impl FnOnce(Self::Input<'_>) -> Result<T>) -> Result<T>;
    /// Calls `f` with a `Var`'s storage as this backend's output, written in place (inside a
    /// candle in-place operation).
    fn output(&self, t: &Tensor, f: LentFn<'_, Self>) -> std::result::Result<(), OptimError>;
}

impl Lane for Cpu {
    fn input<T>(&self, t: &Tensor, f: impl FnOnce(HostValues<'_>) -> Result<T>) -> Result<T> {
        with_values(t, f)
    }

    fn output(&self, t: &Tensor, f: LentFn<'_, Cpu>) -> std::result::Result<(), OptimError> {
        let op = InPlace::<Cpu>::new(f);
        let result = t.inplace_op1(&op);
        op.finish(result)
    }
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) opt: Engine,
    vars: Vec<Entry>,
    /// Entry of each registered parameter (none for the layers' own parameters).
    by_id: Vec<Option<usize>>,
    pub(crate) config: LpmmConfig,
    /// The default group's learning rate.
    lr: f64,
    last: Option<StepReport>,
    /// A learning rate `set_learning_rate` could not apply (the trait cannot return an error):
    /// the next step reports it instead of silently training with the old rate.
    rejected_lr: Option<f64>,
}

/// The optimizer state shared with the layers of [`nn`] (their backward passes accumulate into
/// it).
#[derive(Debug, Clone)]
pub(crate) struct Shared(Arc<Mutex<Inner>>);

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An lpmm optimizer over candle `Var`s (and lpmm-held layers, [`nn`]).
#[derive(Debug)]
pub struct LpmmOptimizer {
    shared: Shared,
}

/// Calls `f` with a contiguous CPU tensor's values (f32 or bf16 in place; other float dtypes
/// converted to f32).
fn with_values<T>(t: &Tensor, f: impl FnOnce(HostValues<'_>) -> Result<T>) -> Result<T> {
    let n = t.elem_count();
    let (storage, layout) = t.storage_and_layout();
    if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
        match cpu {
            CpuStorage::F32(v) => return f(HostValues::F32(&v[start..end])),
            CpuStorage::BF16(v) => return f(HostValues::Bf16(&v[start..end])),
            _ => {}
        }
    }
    drop(storage);
    if !t.device().is_cpu() {
        return Err(Error::Msg(
            "lpmm-candle steps CPU tensors (CUDA: feature `cuda`)".into(),
        ));
    }
    let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    debug_assert_eq!(values.len(), n);
    f(HostValues::F32(&values))
}

/// Calls `f` with a CPU tensor's values as f32 (in place where the tensor is contiguous f32).
pub(crate) fn with_f32<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<T>) -> Result<T> {
    with_values(t, |v| match v {
        HostValues::F32(v) => f(v),
        HostValues::Bf16(v) => f(&v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>()),
    })
}

/// What lpmm does with a lent buffer.
pub(crate) type LentFn<'f, B> =
    &'f mut dyn FnMut(<B as Backend>::Output<'_>) -> std::result::Result<(), OptimError>;

/// Steps a `Var`'s storage in place (candle hands it out only inside an in-place operation).
pub(crate) struct InPlace<'f, B: Backend> {
    f: Mutex<LentFn<'f, B>>,
    /// lpmm's error, kept typed (candle's error type would only keep its message).
    error: Mutex<Option<OptimError>>,
}

impl<'f, B: Backend> InPlace<'f, B> {
    pub(crate) fn new(f: LentFn<'f, B>) -> Self {
        InPlace {
            f: Mutex::new(f),
            error: Mutex::new(None),
        }
    }

    /// Keeps `e` as the operation's error and gives candle its message.
    pub(crate) fn fail(&self, e: OptimError) -> Error {
        let message = e.to_string();
        *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        Error::Msg(message)
    }

    /// The operation's result, with lpmm's error typed where it failed in lpmm.
    pub(crate) fn finish(self, result: Result<()>) -> std::result::Result<(), OptimError> {
        result.map_err(|e| {
            self.error
                .into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| candle_error(e))
        })
    }

    pub(crate) fn run(&self, values: B::Output<'_>) -> Result<()> {
        let mut f = self.f.lock().unwrap_or_else(|e| e.into_inner());
        (*f)(values).map_err(|e| self.fail(e))
    }
}

impl InplaceOp1 for InPlace<'_, Cpu> {
    fn name(&self) -> &'static str {
        "lpmm-step"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(Error::Msg("a lent Var must be contiguous".into()));
        };
        let outside = || Error::Msg("a lent Var's layout lies outside its storage".into());
        match storage {
            CpuStorage::F32(v) => self.run(HostValuesMut::F32(
                v.get_mut(start..end).ok_or_else(outside)?,
            )),
            CpuStorage::BF16(v) => self.run(HostValuesMut::Bf16(
                v.get_mut(start..end).ok_or_else(outside)?,
            )),
            _ => Err(Error::Msg("a lent Var is f32 or bf16".into())),
        }
    }
}

/// The `Var`s as lpmm's lent parameters.
struct VarLender<'a, B> {
    vars: &'a [Entry],
    by_id: &'a [Option<usize>],
    backend: B,
}

impl<'a, B: Lane> VarLender<'a, B> {
    fn new(opt: &Optimizer<B>, vars: &'a [Entry], by_id: &'a [Option<usize>]) -> Self {
        VarLender {
            vars,
            by_id,
            backend: opt.backend().clone(),
        }
    }
}

impl<B> VarLender<'_, B> {
    fn var(&self, id: ParamId) -> std::result::Result<&Var, OptimError> {
        self.by_id
            .get(id.index())
            .copied()
            .flatten()
            .map(|k| &self.vars[k].var)
            .ok_or_else(|| OptimError::UnknownParam(format!("#{}", id.index())))
    }
}

fn candle_error(e: Error) -> OptimError {
    OptimError::Lent {
        param: "a candle Var".into(),
        reason: e.to_string(),
    }
}

impl<B: Lane> Lender<B> for VarLender<'_, B> {
    fn lend(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(B::Input<'_>) -> std::result::Result<(), OptimError>,
    ) -> std::result::Result<(), OptimError> {
        let var = self.var(id)?;
        let mut out = Ok(());
        self.backend
            .input(var.as_tensor(), |v| {
                out = f(v);
                Ok(())
            })
            .map_err(candle_error)?;
        out
    }

    fn lend_mut(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(B::Output<'_>) -> std::result::Result<(), OptimError>,
    ) -> std::result::Result<(), OptimError> {
        let var = self.var(id)?;
        self.backend.output(var.as_tensor(), f)
    }
}

/// candle's gradients as lpmm's: each read where it is and dropped once its parameter has
/// stepped.
struct GradSource<'a, B> {
    grads: Option<&'a mut GradStore>,
    shared: Option<&'a GradStore>,
    vars: &'a [Entry],
    by_id: &'a [Option<usize>],
    backend: B,
}

impl<B> GradSource<'_, B> {
    fn store(&self) -> Option<&GradStore> {
        self.grads.as_deref().or(self.shared)
    }

    fn var(&self, id: ParamId) -> Option<&Var> {
        self.by_id
            .get(id.index())
            .copied()
            .flatten()
            .map(|k| &self.vars[k].var)
    }
}

impl<B: Lane> Gradients<B> for GradSource<'_, B> {
    fn gradient(
        &mut self,
        id: ParamId,
        f: &mut WithGradient<'_, B>,
    ) -> std::result::Result<(), OptimError> {
        let grad = self
            .var(id)
            .and_then(|v| self.store().and_then(|s| s.get(v.as_tensor())));
        let Some(grad) = grad else { return f(None) };
        let mut out = Ok(());
        self.backend
            .input(grad, |v| {
                out = f(Some(v));
                Ok(())
            })
            .map_err(candle_error)?;
        out
    }

    fn consumed(&mut self, id: ParamId) {
        if let Some(var) = self.var(id).cloned()
            && let Some(grads) = self.grads.as_deref_mut()
        {
            grads.remove(var.as_tensor());
        }
    }
}

/// Registers `var` as `name` with `opt`, lent where its dtype is its storage's.
fn register_on<B: Lane>(
    opt: &mut Optimizer<B>,
    name: &str,
    var: &Var,
    shape: &[usize],
    group: usize,
    config: ParamConfig,
    lent: bool,
) -> Result<ParamId> {
    if lent {
        let backend = opt.backend().clone();
        backend.input(var.as_tensor(), |v| {
            opt.add_lent_param(name, shape, v, group, config)
                .map_err(wrap)
        })
    } else {
        tracing::warn!(
            param = name,
            var_dtype = ?var.dtype(),
            storage = %config.param.describe(),
            "lpmm keeps a second copy of this parameter: create its Var in the storage's dtype \
             (LpmmConfig::var_dtype) to avoid it, or hold it in an lpmm layer (lpmm_candle::nn)"
        );
        let mut add = |init: &[f32]| {
            opt.add_param_with(name, shape, init, group, config)
                .map_err(wrap)
        };
        if var.device().is_cpu() {
            with_f32(var.as_tensor(), add)
        } else {
            // A device Var's initial values through the host, once.
            add(&var
                .as_tensor()
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?)
        }
    }
}

/// Steps `opt` from `grads`/`shared` and every pending accumulator, the `Var`s lent.
fn step_on<B: Lane>(
    opt: &mut Optimizer<B>,
    vars: &[Entry],
    by_id: &[Option<usize>],
    grads: Option<&mut GradStore>,
    shared: Option<&GradStore>,
) -> Result<StepReport> {
    let backend = opt.backend().clone();
    let mut source = GradSource {
        grads,
        shared,
        vars,
        by_id,
        backend: backend.clone(),
    };
    let mut lender = VarLender {
        vars,
        by_id,
        backend,
    };
    opt.step(lpmm_optim::Step::given(&mut source).lent(lpmm_optim::Lent::Lender(&mut lender)))
        .map_err(wrap)
}

/// Adds a micro-batch's gradients into `opt`'s accumulators, dropping each from `grads` once
/// added.
fn accumulate_on<B: Lane>(
    opt: &mut Optimizer<B>,
    vars: &[Entry],
    grads: &mut GradStore,
) -> Result<()> {
    let backend = opt.backend().clone();
    for e in vars {
        if let Some(g) = grads.remove(e.var.as_tensor()) {
            backend.input(&g, |v| {
                opt.accumulate(e.id, lpmm_optim::Grad::Input(v))
                    .map_err(wrap)
            })?;
        }
    }
    Ok(())
}

/// Decodes held parameter `id` into `t` (a fresh f32 tensor of its shape on `opt`'s device).
fn decode_on<B: Lane>(opt: &Optimizer<B>, id: ParamId, t: &Tensor) -> Result<()> {
    let backend = opt.backend().clone();
    backend
        .output(t, &mut |out| opt.read(id, SlotKind::Param, Out::Backend( out)))
        .map_err(wrap)
}

/// Hands `grad` to held parameter `id`: added into its accumulator, or a released step where its
/// configuration keeps none. Read where candle computed it.
fn give_on<B: Lane>(opt: &mut Optimizer<B>, id: ParamId, grad: &Tensor) -> Result<()> {
    let released = opt.config(id).map_err(wrap)?.grad == lpmm_optim::Storage::None;
    let backend = opt.backend().clone();
    backend.input(grad, |g| {
        if released {
            opt.step(lpmm_optim::Step::param(id, lpmm_optim::Grad::Input(g)))
                .map(drop)
                .map_err(wrap)
        } else {
            opt.accumulate(id, lpmm_optim::Grad::Input(g)).map_err(wrap)
        }
    })
}

impl Inner {
    /// Registers a parameter lpmm holds for a layer ([`nn`]), initialised with `init`, on
    /// `init`'s device (the CPU, or with feature `cuda` a CUDA device: the engine's device, as a
    /// `Var`'s picks it).
    pub(crate) fn register_held(&mut self, name: &str, init: &Tensor) -> Result<ParamId> {
        if self.opt.is_empty() && !self.opt.owns(init.device()) {
            self.switch_device(init.device())?;
        }
        if !self.opt.owns(init.device()) {
            return Err(Error::Msg(format!(
                "layer {name}'s weight is on {:?}, but this optimizer steps parameters on {}: \
                 lpmm steps the parameters of one device",
                init.device().location(),
                self.opt.device_name()
            )));
        }
        let shape = init.dims().to_vec();
        let (group, config) = self.config.config_for(name);
        let mut add = |values: &[f32]| {
            on_engine!(&mut self.opt, o => o.add_param_with(name, &shape, values, group, config))
                .map_err(wrap)
        };
        if init.device().is_cpu() {
            with_f32(init, add)
        } else {
            // A device weight's initial values through the host, once.
            add(&init.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
        }
    }

    /// Held parameter `id` decoded into `t` (f32, its shape, on the engine's device).
    pub(crate) fn decode_held(&self, id: ParamId, t: &Tensor) -> Result<()> {
        on_engine_ref!(&self.opt, o => decode_on(o, id, t))
    }

    /// A layer's gradient for held parameter `id` (see [`give_on`]).
    pub(crate) fn give_held(&mut self, id: ParamId, grad: &Tensor) -> Result<()> {
        on_engine!(&mut self.opt, o => give_on(o, id, grad))
    }

    /// Registers `var` as `name`.
    fn register(&mut self, name: &str, var: Var) -> Result<()> {
        if self.opt.is_empty() && !self.opt.owns(var.device()) {
            self.switch_device(var.device())?;
        }
        if !self.opt.owns(var.device()) {
            return Err(Error::Msg(format!(
                "Var {name} is on {:?}, but this optimizer steps Vars on {}: lpmm steps the Vars \
                 of one device",
                var.device().location(),
                self.opt.device_name()
            )));
        }
        let dims = var.dims().to_vec();
        // A scalar Var has no dimensions; lpmm stores it as one element.
        let shape = if dims.is_empty() { vec![1] } else { dims };
        let (group, config) = self.config.config_for(name);
        let numel: usize = shape.iter().product();
        let lendable = config
            .resolve(numel, &shape)
            .param
            .format()
            .and_then(|f| f.lendable());
        let lent = matches!(
            (lendable, var.dtype()),
            (Some(Dtype::F32), DType::F32) | (Some(Dtype::Bf16), DType::BF16)
        );
        let id = on_engine!(&mut self.opt, o => register_on(o, name, &var, &shape, group, config, lent))?;
        if self.by_id.len() <= id.index() {
            self.by_id.resize(id.index() + 1, None);
        }
        self.by_id[id.index()] = Some(self.vars.len());
        self.vars.push(Entry {
            name: name.to_string(),
            var,
            id,
            lent,
        });
        Ok(())
    }

    /// An empty engine on `device` in place of the current (empty) one: the same groups and
    /// learning rates.
    fn switch_device(&mut self, device: &candle_core::Device) -> Result<()> {
        let groups =
            std::iter::once(self.config.param).chain(self.config.groups.iter().map(|(_, c)| *c));
        // A learning rate set before (`set_learning_rate`) is set again, as it set it.
        let base = self.config.param.hyper.lr();
        let set_lrs: Option<Vec<f64>> = (self.lr != base).then(|| {
            std::iter::once(1.0)
                .chain(
                    self.config
                        .groups
                        .iter()
                        .map(|(_, c)| if base > 0.0 { c.hyper.lr() / base } else { 1.0 }),
                )
                .map(|r| self.lr * r)
                .collect()
        });
        let mut engine = match device {
            candle_core::Device::Cpu => {
                Engine::Cpu(Optimizer::new(self.config.options).map_err(wrap)?)
            }
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => {
                Engine::Cuda(cuda::CudaEngine::new(d, self.config.options)?)
            }
            other => {
                return Err(Error::Msg(format!(
                    "lpmm steps Vars on the CPU{}, not on {:?}",
                    if cfg!(feature = "cuda") {
                        " and on CUDA"
                    } else {
                        " (CUDA: lpmm-candle's feature `cuda`)"
                    },
                    other.location()
                )));
            }
        };
        on_engine!(&mut engine, o => {
            configure(o, &self.config);
            for config in groups {
                o.add_group(config).map_err(wrap)?;
            }
            for (g, lr) in set_lrs.iter().flatten().enumerate() {
                o.set_group_lr(g, *lr).map_err(wrap)?;
            }
        });
        self.opt = engine;
        Ok(())
    }

    /// Sets every `Var` that is not lent to its parameter as lpmm stores it.
    fn sync(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &self.opt {
            return e.sync(self.vars.iter().filter(|e| !e.lent).map(|e| (e.id, &e.var)));
        }
        let opt = self.opt.cpu()?;
        for e in self.vars.iter().filter(|e| !e.lent) {
            let mut values = vec![0f32; e.var.elem_count()];
            opt.read(e.id, SlotKind::Param, &mut values).map_err(wrap)?;
            let t =
                Tensor::from_vec(values, e.var.shape(), e.var.device())?.to_dtype(e.var.dtype())?;
            e.var.set(&t)?;
        }
        Ok(())
    }

    fn check_lr(&mut self) -> Result<()> {
        if let Some(lr) = self.rejected_lr.take() {
            return Err(Error::Msg(format!(
                "learning rate {lr} was rejected: it must be finite, >= 0 and finite in f32"
            )));
        }
        Ok(())
    }

    /// Steps from `source` and every pending accumulator, then logs and keeps the report.
    fn step(
        &mut self,
        grads: Option<&mut GradStore>,
        shared: Option<&GradStore>,
    ) -> Result<StepReport> {
        self.check_lr()?;
        let Inner {
            opt, vars, by_id, ..
        } = self;
        let report = on_engine!(opt, o => step_on(o, vars, by_id, grads, shared))?;
        self.sync()?;
        self.log(&report);
        self.last = Some(report.clone());
        Ok(report)
    }

    fn log(&self, report: &StepReport) {
        let steps = on_engine_ref!(&self.opt, o => o.steps());
        let names: Vec<String> = report
            .non_finite
            .iter()
            .filter_map(|id| on_engine_ref!(&self.opt, o => o.name(*id).ok().map(str::to_string)))
            .collect();
        if report.skipped {
            tracing::warn!(
                step = steps,
                non_finite = ?names,
                "lpmm skipped the step: non-finite gradients (no parameter or state changed)"
            );
        } else if !names.is_empty() {
            tracing::warn!(
                step = steps,
                non_finite = ?names,
                "lpmm left the elements with non-finite gradients unchanged"
            );
        }
        tracing::debug!(
            step = steps,
            updated = report.updated,
            grad_norm = report.grad_norm,
            "lpmm step"
        );
    }
}

impl LpmmOptimizer {
    /// An optimizer with no parameters yet: add `Var`s ([`LpmmOptimizer::add_vars`]) and lpmm
    /// layers ([`LpmmOptimizer::linear`], [`LpmmOptimizer::embedding`]).
    pub fn empty(config: LpmmConfig) -> Result<Self> {
        let mut opt = Optimizer::new(config.options).map_err(wrap)?;
        configure(&mut opt, &config);
        opt.add_group(config.param).map_err(wrap)?;
        for (_, c) in &config.groups {
            opt.add_group(*c).map_err(wrap)?;
        }
        Ok(LpmmOptimizer {
            shared: Shared(Arc::new(Mutex::new(Inner {
                opt: Engine::Cpu(opt),
                vars: Vec::new(),
                by_id: Vec::new(),
                lr: config.param.hyper.lr(),
                config,
                last: None,
                rejected_lr: None,
            }))),
        })
    }

    /// Every floating-point `Var` of `varmap`, named by its path, registered in name order.
    pub fn from_varmap(varmap: &VarMap, config: LpmmConfig) -> Result<Self> {
        let mut this = Self::empty(config)?;
        let named: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .map_err(|e| Error::Msg(e.to_string()))?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        this.add_vars(named)?;
        Ok(this)
    }

    /// Registers named `Var`s (floating-point ones; others are not trainable), in name order;
    /// `Var`s whose name matches a frozen pattern ([`LpmmConfig::with_frozen`]) are left out.
    pub fn add_vars(&mut self, mut named: Vec<(String, Var)>) -> Result<()> {
        let mut inner = self.shared.lock();
        named.retain(|(name, v)| v.dtype().is_float() && !inner.config.is_frozen(name));
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, var) in named {
            inner.register(&name, var)?;
        }
        inner.sync()
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// Runs `f` on the lpmm optimizer inside (read-only: parameters, states, memory, config)
    /// where it is the CPU's; an error where the `Var`s are on a CUDA device (feature `cuda`:
    /// `LpmmOptimizer::with_cuda_optimizer`).
    pub fn with_optimizer<T>(&self, f: impl FnOnce(&Optimizer) -> T) -> Result<T> {
        Ok(f(self.shared.lock().opt.cpu()?))
    }

    /// Runs `f` on the lpmm-cuda optimizer inside, where the `Var`s are on a CUDA device; an
    /// error where they are the CPU's ([`LpmmOptimizer::with_optimizer`]).
    #[cfg(feature = "cuda")]
    pub fn with_cuda_optimizer<T>(
        &self,
        f: impl FnOnce(&Optimizer<lpmm_cuda::Cuda>) -> T,
    ) -> Result<T> {
        match &self.shared.lock().opt {
            Engine::Cuda(e) => Ok(f(&e.opt)),
            Engine::Cpu(_) => Err(Error::Msg(
                "this optimizer steps CPU Vars: with_optimizer".into(),
            )),
        }
    }

    /// The device whose `Var`s this optimizer steps ("cpu", "cuda:0"): the CPU until a `Var` on
    /// another device is the first registered.
    pub fn device_name(&self) -> String {
        self.shared.lock().opt.device_name()
    }

    /// The model memory lpmm holds (parameters in their storage — a lent parameter, which is
    /// the `Var`, is not counted here —, gradient accumulators, states).
    pub fn memory_report(&self) -> MemoryReport {
        on_engine_ref!(&self.shared.lock().opt, o => o.memory_report())
    }

    /// Bytes candle holds for the `Var`s themselves (in their dtype), lent or not.
    pub fn candle_bytes(&self) -> usize {
        self.shared
            .lock()
            .vars
            .iter()
            .map(|e| e.var.elem_count() * e.var.dtype().size_in_bytes())
            .sum()
    }

    /// Bytes of the `Var`s lent to lpmm as its parameters (stepped in place): model memory that
    /// candle holds and [`LpmmOptimizer::memory_report`] does not count.
    pub fn lent_bytes(&self) -> usize {
        self.shared
            .lock()
            .vars
            .iter()
            .filter(|e| e.lent)
            .map(|e| e.var.elem_count() * e.var.dtype().size_in_bytes())
            .sum()
    }

    /// The names of the registered `Var`s whose parameter lpmm holds as a second copy.
    pub fn copied_vars(&self) -> Vec<String> {
        self.shared
            .lock()
            .vars
            .iter()
            .filter(|e| !e.lent)
            .map(|e| e.name.clone())
            .collect()
    }

    /// The last step's report (skipped, non-finite parameters, global gradient norm).
    pub fn last_report(&self) -> Option<StepReport> {
        self.shared.lock().last.clone()
    }

    /// Adds the gradients of one micro-batch into lpmm's gradient accumulators (in their storage
    /// format), dropping each from `grads` once added, so the f32 gradients never outlive their
    /// accumulation. `Var`s without a gradient are skipped. Finish with
    /// [`LpmmOptimizer::apply`].
    pub fn accumulate(&mut self, mut grads: GradStore) -> Result<()> {
        let mut inner = self.shared.lock();
        let Inner { opt, vars, .. } = &mut *inner;
        on_engine!(opt, o => accumulate_on(o, vars, &mut grads))
    }

    /// Steps every parameter with accumulated gradients (micro-batches of
    /// [`LpmmOptimizer::accumulate`], an lpmm layer's backward passes).
    pub fn apply(&mut self) -> Result<StepReport> {
        self.shared.lock().step(None, None)
    }

    /// Steps from the gradients of a backward pass (and any accumulated ones), dropping each from
    /// `grads` once its parameter has stepped.
    pub fn step_grads(&mut self, grads: &mut GradStore) -> Result<StepReport> {
        self.shared.lock().step(Some(grads), None)
    }

    /// Writes the optimizer's complete state, the `Var`s' values included, to `path` (an lpmm
    /// safetensors checkpoint, atomic).
    pub fn save(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let mut inner = self.shared.lock();
        let Inner {
            opt, vars, by_id, ..
        } = &mut *inner;
        on_engine!(opt, o => {
            let mut lender = VarLender::new(o, vars, by_id);
            o.save(path, Checkpoint::new().lender( &mut lender).map_err(wrap)
        })
    }

    /// Moves the `Var`s to the point the optimizer evaluates at (schedule-free AdamW: the average
    /// `x`, as the `schedulefree` package's `optimizer.eval()`)); parameters of other rules do not
    /// change. Steps are refused until [`LpmmOptimizer::train`]. Call it before evaluating or
    /// saving the model for inference; a no-op when already there.
    pub fn eval(&mut self) -> Result<()> {
        self.switch(true)
    }

    /// Moves the `Var`s back to the training point ([`LpmmOptimizer::eval`]'s inverse).
    pub fn train(&mut self) -> Result<()> {
        self.switch(false)
    }

    fn switch(&mut self, eval: bool) -> Result<()> {
        let mut inner = self.shared.lock();
        let Inner {
            opt, vars, by_id, ..
        } = &mut *inner;
        on_engine!(opt, o => {
            let mut lender = VarLender::new(o, vars, by_id);
            if eval {
                o.set_mode(Mode::Eval, lpmm_optim::Lent::Lender(&mut lender)).map_err(wrap)
            } else {
                o.set_mode(Mode::Train, lpmm_optim::Lent::Lender(&mut lender)).map_err(wrap)
            }
        })?;
        inner.sync()
    }

    /// Restores a checkpoint of [`LpmmOptimizer::save`] into this optimizer (the same parameters
    /// and storages): the `Var`s take the saved values, the states, counters and random streams
    /// continue exactly.
    pub fn load(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let mut inner = self.shared.lock();
        let Inner {
            opt, vars, by_id, ..
        } = &mut *inner;
        on_engine!(opt, o => {
            let mut lender = VarLender::new(o, vars, by_id);
            o.load(path, Checkpoint::new().lender( &mut lender).map_err(wrap)
        }))?;
        inner.sync()
    }
}

/// Order-independent identities for `Var`s passed without names: shape, dtype and values.
fn fingerprint(var: &Var) -> Result<(Vec<usize>, String, Vec<u32>)> {
    let values = var
        .as_tensor()
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    Ok((
        var.dims().to_vec(),
        format!("{:?}", var.dtype()),
        values.into_iter().map(f32::to_bits).collect(),
    ))
}

impl candle_nn::Optimizer for LpmmOptimizer {
    type Config = LpmmConfig;

    /// Registers every floating-point `Var` (others are not trainable). Without names, the
    /// `Var`s are ordered by shape, dtype and initial values (`VarMap::all_vars` comes in hash
    /// order, different in every process) and named `var0`, `var1`, ...; `Var`s that tie (equal
    /// shape and values) cannot be told apart, which a `tracing` warning reports. Prefer
    /// [`LpmmOptimizer::from_varmap`], which names them by path.
    fn new(vars: Vec<Var>, config: LpmmConfig) -> Result<Self> {
        let mut keyed = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|v| Ok((fingerprint(&v)?, v)))
            .collect::<Result<Vec<_>>>()?;
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        if keyed.windows(2).any(|w| w[0].0 == w[1].0) {
            tracing::warn!(
                "Vars with equal shapes and initial values cannot be ordered the same way in every \
                 process; name them (LpmmOptimizer::from_varmap) for reproducible bits"
            );
        }
        let mut this = Self::empty(config)?;
        let named = keyed
            .into_iter()
            .enumerate()
            .map(|(i, (_, v))| (format!("var{i:06}"), v))
            .collect();
        this.add_vars(named)?;
        Ok(this)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.shared.lock().step(None, Some(grads)).map(|_| ())
    }

    /// The backward pass and the step, each gradient dropped as soon as its parameter has
    /// stepped.
    fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        // Not under the lock: lpmm layers accumulate into the optimizer during backward.
        let mut grads = loss.backward()?;
        self.step_grads(&mut grads).map(|_| ())
    }

    /// The learning rate of the default group (groups with their own rate keep their ratio to
    /// it).
    fn learning_rate(&self) -> f64 {
        self.shared.lock().lr
    }

    /// Sets the default group's learning rate; every other group keeps its configured ratio to
    /// it (a group configured with the default's rate follows it exactly).
    fn set_learning_rate(&mut self, lr: f64) {
        let mut inner = self.shared.lock();
        let base = inner.config.param.hyper.lr();
        let ratios: Vec<f64> = std::iter::once(1.0)
            .chain(
                inner.config.groups.iter().map(
                    |(_, c)| {
                        if base > 0.0 { c.hyper.lr() / base } else { 1.0 }
                    },
                ),
            )
            .collect();
        // Check every group's rate before changing any.
        let valid = |v: f64| v.is_finite() && v >= 0.0 && (v as f32).is_finite();
        if ratios.iter().any(|r| !valid(lr * r)) {
            inner.rejected_lr = Some(lr);
            return;
        }
        for (g, r) in ratios.iter().enumerate() {
            if on_engine!(&mut inner.opt, o => o.set_group_lr(g, lr * r)).is_err() {
                inner.rejected_lr = Some(lr);
                return;
            }
        }
        inner.lr = lr;
    }
}
