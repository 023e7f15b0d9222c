//! The configuration of an [`LpmmOptimizer`](crate::LpmmOptimizer): lpmm's parameter
//! configuration, groups by name pattern, frozen `Var`s and the missing-gradient policy.

use candle_core::DType;
use lpmm_optim::backend::{Backend, Dtype};
use lpmm_optim::{
    Hybrid, MissingGradientHelp, MissingGradientPolicy, Optimizer, OptimizerOptions, ParamConfig,
    Route,
};

/// The configuration of an [`LpmmOptimizer`](crate::LpmmOptimizer): one lpmm configuration for
/// every parameter, the optimizer-wide options, parameter groups by name pattern, the frozen
/// `Var`s and what a step does when a parameter received no gradient.
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
    /// Muon for the hidden matrices ([`Hybrid`]): a parameter no group pattern matches and
    /// that the hybrid routes to its matrices takes [`Hybrid::matrices`] (its own group, the
    /// last); `param` is then the hybrid's other configuration.
    pub hybrid: Option<Hybrid>,
}

impl From<ParamConfig> for LpmmConfig {
    fn from(param: ParamConfig) -> Self {
        LpmmConfig {
            param,
            options: OptimizerOptions::default(),
            groups: Vec::new(),
            frozen: Vec::new(),
            missing_gradient: MissingGradientPolicy::default(),
            hybrid: None,
        }
    }
}

/// Muon for the hidden matrices and AdamW for the rest (e.g.
/// `lpmm_optim::presets::muon_adamw_8bit_bf16_sr(0.02, 3e-4)`): each `Var` routed by its name and
/// shape ([`Hybrid::route_of`]; groups added with [`LpmmConfig::with_group`] come first).
impl From<Hybrid> for LpmmConfig {
    fn from(hybrid: Hybrid) -> Self {
        LpmmConfig {
            hybrid: Some(hybrid.clone()),
            ..LpmmConfig::from(hybrid.others)
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
pub(crate) fn configure<B: Backend>(opt: &mut Optimizer<B>, config: &LpmmConfig) {
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
    /// [`StepReport::missing_gradients`](lpmm_optim::StepReport::missing_gradients), counts
    /// them).
    pub fn with_missing_gradient(self, policy: MissingGradientPolicy) -> Self {
        LpmmConfig {
            missing_gradient: policy,
            ..self
        }
    }

    /// Whether `Var` `name` is frozen ([`LpmmConfig::with_frozen`]).
    pub(crate) fn is_frozen(&self, name: &str) -> bool {
        self.frozen.iter().any(|p| matches(p, name))
    }

    /// The dtype to create `Var`s in so that each `Var` is lpmm's parameter (no copy): bf16 for
    /// bf16, Kahan and split-f32 storage, f32 otherwise (below 16 bits, use the layers of
    /// [`nn`](crate::nn)).
    pub fn var_dtype(&self) -> DType {
        match self.param.param.format().and_then(|f| f.lendable()) {
            Some(Dtype::Bf16) => DType::BF16,
            _ => DType::F32,
        }
    }

    /// The group (0: the default) and configuration of parameter `name` of `shape`.
    pub(crate) fn config_for(&self, name: &str, shape: &[usize]) -> (usize, ParamConfig) {
        if let Some(found) = self
            .groups
            .iter()
            .enumerate()
            .find(|(_, (p, _))| matches(p, name))
        {
            return (found.0 + 1, found.1.1);
        }
        match &self.hybrid {
            Some(h) if h.route_of(name, shape) == Route::Matrices => {
                (self.groups.len() + 1, h.matrices)
            }
            _ => (0, self.param),
        }
    }

    /// Every group's configuration in the optimizer's order: the default, the pattern groups,
    /// then the hybrid's matrices.
    pub(crate) fn all_groups(&self) -> Vec<ParamConfig> {
        std::iter::once(self.param)
            .chain(self.groups.iter().map(|(_, c)| *c))
            .chain(self.hybrid.iter().map(|h| h.matrices))
            .collect()
    }

    /// Each group's learning rate as a fraction of the default group's (the default first):
    /// what `set_learning_rate` keeps (1 for every group when the default's rate is 0).
    pub(crate) fn lr_ratios(&self) -> Vec<f64> {
        let base = self.param.hyper.lr();
        self.all_groups()
            .iter()
            .map(|c| if base > 0.0 { c.hyper.lr() / base } else { 1.0 })
            .collect()
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

#[cfg(test)]
mod tests {
    use lpmm_optim::{ParamConfig, presets};

    use super::{LpmmConfig, matches};

    fn sgd(lr: f64) -> ParamConfig {
        presets::sgdm_f32(lr, 0.0).build()
    }

    #[test]
    fn groups_keep_their_learning_rate_ratio() {
        let config = LpmmConfig::from(sgd(0.1))
            .with_group("*bias", sgd(0.05))
            .with_group("embed.*", sgd(0.3));
        let ratios = config.lr_ratios();
        assert_eq!(ratios.len(), 3);
        for (got, want) in ratios.iter().zip([1.0, 0.5, 3.0]) {
            assert!((got - want).abs() < 1e-12, "{ratios:?}");
        }
        // A default rate of 0 gives no ratio: every group follows it exactly.
        let zero = LpmmConfig::from(sgd(0.0)).with_group("*bias", sgd(0.05));
        assert_eq!(zero.lr_ratios(), [1.0, 1.0]);
    }

    #[test]
    fn patterns_match_runs_of_characters() {
        assert!(matches("*bias", "fc.bias"));
        assert!(matches("embed.*", "embed.weight"));
        assert!(matches("a*b*c", "a.x.b.y.c"));
        assert!(matches("fc.weight", "fc.weight"));
        assert!(!matches("fc.weight", "fc.weights"));
        assert!(!matches("a*b*c", "a.c.b"));
        assert!(!matches("*bias", "bias.weight"));
    }
}
