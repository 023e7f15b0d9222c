//! The optimizer users hold: building it over `Var`s, its state shared with the layers of
//! [`nn`](crate::nn), and the `candle_nn::Optimizer` implementation.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{DType, Error, Result, Tensor, Var};
use candle_nn::VarMap;
use lpmm_optim::{Optimizer, StepReport};

use crate::config::{LpmmConfig, configure};
use crate::engine::{Engine, on_engine};
use crate::error::wrap;
use crate::register::Entry;

/// The optimizer's state, behind [`Shared`]'s lock.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) opt: Engine,
    /// The registered `Var`s, in registration order.
    pub(crate) vars: Vec<Entry>,
    /// Entry of each registered parameter (none for the layers' own parameters).
    pub(crate) by_id: Vec<Option<usize>>,
    pub(crate) config: LpmmConfig,
    /// The default group's learning rate.
    pub(crate) lr: f64,
    /// The last step's report.
    pub(crate) last: Option<StepReport>,
    /// A learning rate `set_learning_rate` could not apply (the trait cannot return an error):
    /// the next step reports it instead of silently training with the old rate.
    pub(crate) rejected_lr: Option<f64>,
}

/// The optimizer state shared with the layers of [`nn`](crate::nn) (their backward passes
/// accumulate into it).
#[derive(Debug, Clone)]
pub(crate) struct Shared(Arc<Mutex<Inner>>);

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An lpmm optimizer over candle `Var`s (and lpmm-held layers, [`nn`](crate::nn)).
#[derive(Debug)]
pub struct LpmmOptimizer {
    pub(crate) shared: Shared,
}

impl LpmmOptimizer {
    /// An optimizer with no parameters yet: add `Var`s ([`LpmmOptimizer::add_vars`]) and lpmm
    /// layers ([`LpmmOptimizer::linear`], [`LpmmOptimizer::embedding`]).
    pub fn empty(config: LpmmConfig) -> Result<Self> {
        let mut opt = Optimizer::new(config.options).map_err(wrap)?;
        configure(&mut opt, &config);
        for c in config.all_groups() {
            opt.add_group(c).map_err(wrap)?;
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
        // A Var without elements has nothing to step (candle's optimizers leave it as it is);
        // lpmm refuses to register one, which refused the whole model.
        named.retain(|(name, v)| {
            v.dtype().is_float() && v.elem_count() > 0 && !inner.config.is_frozen(name)
        });
        named.sort_by(|a, b| a.0.cmp(&b.0));
        // The same Var twice (or a clone of it: one storage) would be stepped twice a step, or
        // refused mid-way by its second gradient: refused before anything is registered.
        let mut seen: std::collections::HashSet<_> =
            inner.vars.iter().map(|e| e.var.as_tensor().id()).collect();
        for (name, var) in &named {
            if !seen.insert(var.as_tensor().id()) {
                return Err(Error::Msg(format!(
                    "Var {name} is given twice (the same Var, or a clone of it, registered already \
                     or listed again): nothing was registered"
                )));
            }
        }
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
    /// shape and values) cannot be told apart, which a warning reports (`tracing`, or stderr).
    /// Prefer [`LpmmOptimizer::from_varmap`], which names them by path.
    fn new(vars: Vec<Var>, config: LpmmConfig) -> Result<Self> {
        let mut keyed = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|v| Ok((fingerprint(&v)?, v)))
            .collect::<Result<Vec<_>>>()?;
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        if keyed.windows(2).any(|w| w[0].0 == w[1].0) {
            lpmm_optim::user_warning(
                "lpmm-candle",
                "Vars with equal shapes and initial values cannot be ordered the same way in every \
                 process (their stochastic rounding and checkpoint entries may trade places); name \
                 them (LpmmOptimizer::from_varmap) for reproducible bits",
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
        let ratios = inner.config.lr_ratios();
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
        // A later valid rate replaces a rejected one (the rejection was reported for that rate).
        inner.rejected_lr = None;
    }
}
