//! Configurations, used as burn's own: `Lpmm8bitAdamWConfig::new().init()?` gives the
//! `ModuleOptimizer` burn-train's `Learner` takes (`build()` the per-tensor optimizer,
//! `init_whole_module()` the whole-module one), and any lpmm configuration does the same through
//! `LpmmOptimizerConfig::from(preset)`.

use burn_core as burn;
use burn_core::config::Config;
use lpmm_optim::presets::Preset;
use lpmm_optim::{
    Hyper, MissingGradientPolicy, NonFinitePolicy, OptimizerOptions, ParamConfig, Storage,
};

use burn_optim::ModuleOptimizer;

use crate::{BurnError, LpmmOptimizer, LpmmTensorOptimizer};

/// Any lpmm configuration as a burn optimizer: the storage of each slot (parameter, gradient
/// accumulator, states), the update rule and its hyperparameters ([`ParamConfig`], e.g. one of
/// [`lpmm_optim::presets`]), and the optimizer-wide options (seed of the stochastic-rounding
/// streams, global-norm clipping, the non-finite-gradient policy).
///
/// Gradient storage `Storage::None` reads each gradient where burn's backward pass wrote it and
/// drops it once its parameter has stepped (no accumulator, no copy); any other gradient storage
/// adds burn's gradient into lpmm's accumulator of that format first (what the presets specify,
/// e.g. LPMM-SGDM's 8-bit stochastically rounded gradient), so the step has the preset's exact
/// numerics. Clipping and the skip-step policy see every gradient either way.
///
/// The learning rate is the one each step is given (burn's schedulers drive it); the
/// configuration's own is replaced at every step.
///
/// Three optimizers come from it: [`LpmmOptimizerConfig::init`], burn's `ModuleOptimizer` over
/// the per-tensor optimizer (what burn-train's `Learner` takes); [`LpmmOptimizerConfig::build`],
/// the per-tensor optimizer itself (for `ModuleOptimizer::with_group`); and
/// [`LpmmOptimizerConfig::init_whole_module`], the whole-module optimizer.
///
/// Every step checks that each of the module's parameters that requires a gradient received one
/// ([`LpmmOptimizerConfig::with_missing_gradient`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct LpmmOptimizerConfig {
    /// Storages and hyperparameters of every parameter.
    pub param: ParamConfig,
    /// Seed, clipping, non-finite policy.
    pub options: OptimizerOptions,
    /// What a step does when a parameter of the module that requires a gradient received none
    /// ([`LpmmOptimizerConfig::with_missing_gradient`]).
    pub missing_gradient: MissingGradientPolicy,
}

impl From<ParamConfig> for LpmmOptimizerConfig {
    fn from(param: ParamConfig) -> Self {
        LpmmOptimizerConfig {
            param,
            options: OptimizerOptions::default(),
            missing_gradient: MissingGradientPolicy::default(),
        }
    }
}

impl<R: Into<Hyper>> From<Preset<R>> for LpmmOptimizerConfig {
    fn from(preset: Preset<R>) -> Self {
        LpmmOptimizerConfig::from(preset.build())
    }
}

impl LpmmOptimizerConfig {
    /// With storages and hyperparameters `param` (a [`ParamConfig`] or a preset).
    pub fn with_param(self, param: impl Into<ParamConfig>) -> Self {
        LpmmOptimizerConfig {
            param: param.into(),
            ..self
        }
    }

    /// With these optimizer-wide options.
    pub fn with_options(self, options: OptimizerOptions) -> Self {
        LpmmOptimizerConfig { options, ..self }
    }

    /// The seed of every stochastic-rounding stream (default 0). Streams are keyed by the
    /// parameter's registration order (the module's visiting order), so two processes that
    /// build the same module and seed step the same bits.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.options.seed = seed;
        self
    }

    /// Clips the global L2 norm of all the module's gradients to `max_norm` (`None`: off).
    pub fn with_max_grad_norm(mut self, max_norm: Option<f64>) -> Self {
        self.options.max_grad_norm = max_norm;
        self
    }

    /// What a non-finite gradient does: skip the whole step (default, all-or-nothing) or skip
    /// those elements.
    pub fn with_non_finite(mut self, policy: NonFinitePolicy) -> Self {
        self.options.non_finite = policy;
        self
    }

    /// What a step does when parameters of the module that require a gradient (burn's
    /// `require_grad`; a parameter frozen with `Param::set_require_grad(false)` or
    /// `Module::no_grad` is never expected to have one) received none in `GradientsParams`, or
    /// an [`crate::LpmmLinear`] weight none in the backward pass: `Warn` (the default: the step
    /// goes ahead and a warning names them, on stderr where no `tracing` subscriber records
    /// lpmm's warnings, on the first such step and whenever the set changes), `Error` (the step
    /// returns [`crate::BurnError::Optim`] with `OptimError::MissingGradient` naming them before
    /// anything changes in the optimizer; like every error of the step, it drops the module) or
    /// `Ignore`. Every report counts them
    /// ([`lpmm_optim::StepReport::missing_gradients`]).
    pub fn with_missing_gradient(mut self, policy: MissingGradientPolicy) -> Self {
        self.missing_gradient = policy;
        self
    }

    /// The configuration checked for the per-tensor form: valid hyperparameters and storages,
    /// and no global-norm clipping (it needs every gradient of the module at once: use burn's
    /// `GradientClipping`, or the whole-module optimizer).
    fn check_per_tensor(&self) -> Result<(), BurnError> {
        self.param.validate()?;
        if let Some(n) = self.options.max_grad_norm {
            return Err(BurnError::Config(format!(
                "global-norm clipping (max_grad_norm {n}) needs the whole module's gradients, which burn's per-tensor optimizers never see together: clip with burn's GradientClipping (ModuleOptimizer::with_grad_clipping, or the clipping of ModuleOptimizer::with_group; Norm clips each tensor by its own norm), or use the whole-module optimizer (init_whole_module)"
            )));
        }
        Ok(())
    }

    /// The per-tensor optimizer (`burn_optim::Optimizer`): what `ModuleOptimizer::with_group`
    /// takes. Refuses invalid hyperparameters and global-norm clipping
    /// ([`BurnError::Config`], [`BurnError::Optim`]).
    pub fn build(&self) -> Result<LpmmTensorOptimizer, BurnError> {
        self.check_per_tensor()?;
        Ok(LpmmTensorOptimizer::new(*self))
    }

    /// burn's `ModuleOptimizer` over the per-tensor optimizer: what burn-train's `Learner::new`
    /// takes, as burn's `AdamWConfig::init()` gives it. Nothing is allocated until a parameter's
    /// first step.
    pub fn init(&self) -> Result<ModuleOptimizer, BurnError> {
        Ok(ModuleOptimizer::from(self.build()?))
    }

    /// The whole-module optimizer ([`LpmmOptimizer`]: global-norm clipping, the all-or-nothing
    /// skip, [`crate::LpmmLinear`] layers). Nothing is allocated until the first step, which
    /// registers the module's parameters (in its visiting order) on the lpmm backend of their
    /// device.
    pub fn init_whole_module(&self) -> LpmmOptimizer {
        LpmmOptimizer::new(*self)
    }
}

/// AdamW with 8-bit states (bitsandbytes' blockwise dynamic maps, blocks of 256), the parameter
/// stepped in place in the module's own tensor (f32, or bf16 on a backend with bf16 tensors) and
/// the gradients read where burn's backward pass wrote them (no gradient accumulator): burn's
/// `AdamWConfig` with 2 bytes of optimizer state per parameter instead of 8. Defaults are burn's
/// `AdamWConfig`'s (betas 0.9 and 0.999, epsilon 1e-5, weight decay 1e-4); tensors smaller than
/// 4096 elements keep f32 states (bitsandbytes' `min_8bit_size`).
///
/// ```ignore
/// // burn:  let optim = AdamWConfig::new().init();
/// let optim = Lpmm8bitAdamWConfig::new().init()?;
/// let learner = Learner::new(model, optim, lr_scheduler);
/// ```
///
/// Gradient clipping as burn's: `ModuleOptimizer::with_grad_clipping` on what `init` gives.
/// `max_grad_norm` is the whole-module optimizer's global-norm clipping
/// ([`Lpmm8bitAdamWConfig::init_whole_module`]); `init` refuses it.
#[derive(Config, Debug)]
pub struct Lpmm8bitAdamWConfig {
    /// First-moment decay.
    #[config(default = 0.9)]
    pub beta_1: f64,
    /// Second-moment decay.
    #[config(default = 0.999)]
    pub beta_2: f64,
    /// Added to the bias-corrected root of the second moment.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Decoupled weight decay.
    #[config(default = 1e-4)]
    pub weight_decay: f64,
    /// Global-norm clipping of all gradients together (burn's `GradientClippingConfig::Norm`,
    /// applied to the whole module rather than per tensor).
    pub max_grad_norm: Option<f64>,
    /// Seed of the stochastic-rounding streams (the preset rounds to nearest; kept for
    /// configurations derived from it).
    #[config(default = 0)]
    pub seed: u64,
}

impl Lpmm8bitAdamWConfig {
    /// The lpmm configuration this is.
    pub fn lpmm(&self) -> LpmmOptimizerConfig {
        let mut hyper = lpmm_optim::Adam::adamw(0.0);
        hyper.betas = (self.beta_1, self.beta_2);
        hyper.eps = self.epsilon;
        hyper.weight_decay = self.weight_decay;
        let param = ParamConfig::f32(Hyper::Adam(hyper))
            .with_param(Storage::F32)
            .with_grad(Storage::None)
            .with_state1(Storage::DYNAMIC8_SIGNED)
            .with_state2(Storage::DYNAMIC8_UNSIGNED);
        LpmmOptimizerConfig::from(param)
            .with_seed(self.seed)
            .with_max_grad_norm(self.max_grad_norm)
    }

    /// The per-tensor optimizer (for `ModuleOptimizer::with_group`).
    pub fn build(&self) -> Result<LpmmTensorOptimizer, BurnError> {
        self.lpmm().build()
    }

    /// burn's `ModuleOptimizer` over the per-tensor optimizer: what burn-train's `Learner::new`
    /// takes.
    pub fn init(&self) -> Result<ModuleOptimizer, BurnError> {
        self.lpmm().init()
    }

    /// The whole-module optimizer.
    pub fn init_whole_module(&self) -> LpmmOptimizer {
        self.lpmm().init_whole_module()
    }
}
