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
//! # What goes wrong, and what happens
//!
//! What a careless or hostile user tried from outside the repository (`tests/hostile.rs`,
//! `tests/user.rs`):
//!
//! - **A checkpoint saved under a schedule** (`set_learning_rate` between steps):
//!   [`LpmmOptimizer::load`] takes the checkpoint's learning rates (`learning_rate()` returns the
//!   saved one) and refuses any other difference of configuration, changing nothing.
//! - **A write into a `Var` lpmm holds a copy of** (a `Var` not of [`LpmmConfig::var_dtype`]:
//!   `Var::set`, `VarMap::load` after creating the optimizer): the next step is refused with an
//!   error naming it (the step would start from lpmm's copy and lose the write); the write stays
//!   in the `Var`. Load the weights before creating the optimizer, or create the `Var`s in
//!   [`LpmmConfig::var_dtype`], which lpmm steps in place and which take any write.
//! - **The same `Var` twice** (or a clone of it): refused before anything is registered. A `Var`
//!   without elements is left out, as candle's optimizers leave it.
//! - **A rejected learning rate** (NaN, infinite, negative): the next step is an error and changes
//!   nothing, unless a valid rate was set since.
//! - **Unnamed `Var`s** (`LpmmOptimizer::new(varmap.all_vars(), ..)`): ordered by shape and
//!   values *when the optimizer is created*. A resumed run must create it from the same values
//!   as the saved run did (before loading trained weights into the `Var`s), or two `Var`s of one
//!   shape can trade checkpoint entries; name them ([`LpmmOptimizer::from_varmap`]) to be safe.
//! - **The layers of [`nn`]** add their weight's gradient into lpmm's accumulator in *every*
//!   backward pass through them, whether or not its `GradStore` is kept or its step taken: an
//!   extra `loss.backward()` (to log a gradient norm, say), or a refused step retried after
//!   another backward pass, counts that gradient twice. [`LpmmOptimizer::accumulate`] is not all
//!   or nothing either: a micro-batch refused for one parameter (a non-finite gradient a
//!   quantized accumulator cannot hold) has already been added for the parameters before it in
//!   name order.
//! - **An f16 `Var`** whose parameter lpmm holds in f32 or bf16 is set by a conversion to f16,
//!   which rounds values of magnitude 65520 and above to infinity where lpmm's value is finite:
//!   a warning names the `Var` (`tracing`, or stderr) each time it happens (on the CPU).
//!
//! [docs/RESULTS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/RESULTS.md
//! [`StepReport`]: lpmm_optim::StepReport
//! [`StepReport::missing_gradients`]: lpmm_optim::StepReport::missing_gradients

// The crate's parts: the configuration (config.rs) and the optimizer users hold (optimizer.rs:
// building, the `candle_nn::Optimizer` implementation); the engine, the lpmm optimizer of the
// `Var`s' device (engine.rs); how a tensor's memory meets a backend (lane.rs; CUDA in cuda.rs);
// registering `Var`s (register.rs) and the parameters lpmm holds for the layers of `nn`
// (held.rs); the `Var`s lent to lpmm (lending.rs) and candle's gradients handed to it
// (gradients.rs); the step (step.rs); checkpoints (checkpoint.rs); reports and logs (report.rs).

mod checkpoint;
mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod engine;
mod error;
mod gradients;
mod held;
mod lane;
mod lending;
pub mod nn;
pub mod ops;
mod optimizer;
mod register;
mod report;
mod step;

pub use config::LpmmConfig;
pub use optimizer::LpmmOptimizer;
