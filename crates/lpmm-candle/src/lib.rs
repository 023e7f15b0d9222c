//! candle integration: [`LpmmOptimizer`] implements [`candle_nn::Optimizer`] for any lpmm
//! configuration.
//!
//! What memory is saved, honestly: lpmm holds each parameter in its configured storage, the
//! gradient accumulator and the optimizer states (what [`LpmmOptimizer::memory_report`] counts).
//! candle still holds every `Var` in its own dtype (the forward and backward passes read it),
//! and the `GradStore` of a backward pass (one gradient per `Var`, in the `Var`'s dtype) until it
//! is dropped. So against candle's own f32 AdamW (f32 `Var`s + f32 `GradStore` + two f32 states,
//! 16 bytes per parameter), an lpmm configuration saves the states' and accumulator's difference;
//! the `Var` copy remains (4 bytes per parameter for f32 `Var`s, reported by
//! [`LpmmOptimizer::candle_bytes`]). After every step the `Var`s are set to the parameters as lpmm
//! stores them (bf16-rounded, 8-bit-quantized, ...), so the model trains on exactly what lpmm
//! keeps.
//!
//! # A warning for candle users
//!
//! In candle-nn 0.11 (checked in 0.11.1), three fused operators have no backward pass: their
//! output is a constant to autograd, so no gradient reaches anything before them, and training
//! silently updates only what comes after. No error or warning is raised.
//!
//! - `candle_nn::ops::layer_norm` is applied with `Tensor::apply_op3_no_bwd`, and
//!   `candle_nn::LayerNorm::forward` takes that path for every contiguous input when the layer
//!   has a bias (as `candle_nn::layer_norm(size, eps, vb)` builds it).
//! - `candle_nn::ops::rms_norm` is applied with `apply_op2_no_bwd`, and
//!   `candle_nn::RmsNorm::forward` takes it for every contiguous input.
//! - `candle_nn::ops::softmax_last_dim` is applied with `apply_op1_no_bwd`.
//!
//! In a pre-norm transformer built with `candle_nn::LayerNorm`, the final layer norm stops every
//! gradient: only the output head trains; with `softmax_last_dim` in the attention, the queries
//! and keys never train. lpmm's own comparison model did exactly this until it was fixed
//! (docs/RESULTS.md has the before and after).
//!
//! Differentiable replacements: `candle_nn::ops::softmax(x, D::Minus1)` and
//! `candle_nn::ops::layer_norm_slow` / `rms_norm_slow` in candle-nn itself, or this crate's
//! [`ops`]: [`ops::layer_norm`], [`ops::rms_norm`], [`ops::softmax_last_dim`],
//! [`ops::causal_softmax`] and the module types [`ops::LayerNorm`] / [`ops::RmsNorm`]
//! (`let ln: lpmm_candle::ops::LayerNorm = candle_nn::layer_norm(size, 1e-5, vb)?.into();`), with
//! fused f32 CPU kernels that have their own backward pass, each tested against candle-nn's
//! forward values, the closed-form gradients and finite differences. To check a model, compute a
//! loss, call `backward()`, and look for a non-zero gradient of every `Var`, as the test
//! `every_parameter_receives_a_gradient` in `tests/short_runs.rs` does for the comparison's
//! language model.

pub mod experiments;
pub mod ops;

use candle_core::backprop::GradStore;
use candle_core::{DType, Error, Result, Tensor, Var};
use lpmm_optim::{MemoryReport, Optimizer, OptimizerOptions, ParamConfig, ParamId, StepReport};

/// The configuration of an [`LpmmOptimizer`]: one lpmm configuration for every `Var` (a parameter
/// group), and the optimizer-wide options.
#[derive(Debug, Clone, Copy)]
pub struct LpmmConfig {
    /// Storage formats and hyperparameters (e.g. `lpmm_optim::presets::adamw_8bit_bf16(1e-3)`).
    pub param: ParamConfig,
    /// Seed, clipping, non-finite policy.
    pub options: OptimizerOptions,
}

impl From<ParamConfig> for LpmmConfig {
    fn from(param: ParamConfig) -> Self {
        LpmmConfig {
            param,
            options: OptimizerOptions::default(),
        }
    }
}

/// An lpmm optimizer over candle `Var`s.
#[derive(Debug)]
pub struct LpmmOptimizer {
    opt: Optimizer,
    vars: Vec<(Var, ParamId)>,
    /// A learning rate `set_learning_rate` could not apply (the trait cannot return an error):
    /// the next step reports it instead of silently training with the old rate.
    rejected_lr: Option<f64>,
}

fn wrap(e: lpmm_optim::OptimError) -> Error {
    Error::wrap(e)
}

impl LpmmOptimizer {
    /// The lpmm optimizer inside.
    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    /// The model memory lpmm holds (parameters in their storage, gradient accumulators, states).
    pub fn memory_report(&self) -> MemoryReport {
        self.opt.memory_report()
    }

    /// Bytes candle holds for the `Var`s themselves (in their dtype), beside lpmm's storage.
    pub fn candle_bytes(&self) -> usize {
        self.vars
            .iter()
            .map(|(v, _)| v.elem_count() * v.dtype().size_in_bytes())
            .sum()
    }

    /// Adds the gradients of one micro-batch into lpmm's gradient accumulators (in their
    /// storage format). `Var`s without a gradient are skipped.
    pub fn accumulate(&mut self, grads: &GradStore) -> Result<()> {
        for (var, id) in &self.vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                let g = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                self.opt.accumulate(*id, &g).map_err(wrap)?;
            }
        }
        Ok(())
    }

    /// Steps every parameter with accumulated gradients and sets the `Var`s to the new values.
    pub fn apply(&mut self) -> Result<StepReport> {
        if let Some(lr) = self.rejected_lr.take() {
            return Err(Error::Msg(format!(
                "learning rate {lr} was rejected: it must be finite, >= 0 and finite in f32"
            )));
        }
        let report = self.opt.step().map_err(wrap)?;
        self.sync()?;
        Ok(report)
    }

    /// Sets every `Var` to its parameter as lpmm stores it.
    fn sync(&self) -> Result<()> {
        for (var, id) in &self.vars {
            let mut values = vec![0f32; var.elem_count()];
            self.opt.read_param(*id, &mut values).map_err(wrap)?;
            let t = Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
            var.set(&t)?;
        }
        Ok(())
    }
}

impl candle_nn::Optimizer for LpmmOptimizer {
    type Config = LpmmConfig;

    /// Registers every floating-point `Var` (others are not trainable) with the configuration,
    /// and sets each `Var` to its value as lpmm stores it.
    fn new(vars: Vec<Var>, config: LpmmConfig) -> Result<Self> {
        let mut opt = Optimizer::new(config.options).map_err(wrap)?;
        let group = opt.add_group(config.param).map_err(wrap)?;
        let mut registered = Vec::new();
        for (i, var) in vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .enumerate()
        {
            let init = var
                .as_tensor()
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?;
            let dims = var.dims().to_vec();
            // A scalar Var has no dimensions; lpmm stores it as one element.
            let shape = if dims.is_empty() { vec![1] } else { dims };
            let id = opt
                .add_param(&format!("var{i}"), &shape, &init, group)
                .map_err(wrap)?;
            registered.push((var, id));
        }
        let this = LpmmOptimizer {
            opt,
            vars: registered,
            rejected_lr: None,
        };
        this.sync()?;
        Ok(this)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.accumulate(grads)?;
        self.apply().map(|_| ())
    }

    fn learning_rate(&self) -> f64 {
        self.vars
            .first()
            .and_then(|(_, id)| self.opt.config(*id).ok())
            .map_or(0.0, |c| c.hyper.lr())
    }

    fn set_learning_rate(&mut self, lr: f64) {
        if self.opt.set_lr(lr).is_err() {
            self.rejected_lr = Some(lr);
        }
    }
}
