//! Gradient coverage: which parameters a step found without a gradient, and what the optimizer
//! does about it.
//!
//! A model whose forward pass cuts the gradient of some parameters (an operator without a
//! backward pass, a detached tensor, a layer the loss does not use) still "trains": its loss
//! falls through the parameters that do receive gradients, and the others keep their initial
//! values. No error is raised anywhere in the framework. The optimizer is the one component that
//! sees every parameter and every gradient, so every step counts the registered parameters that
//! received none ([`MissingGradients`], in each [`crate::StepReport`]) and applies a
//! [`MissingGradientPolicy`]: ignore, warn (the default) or refuse the step.
//!
//! Warnings go to `tracing` (target `lpmm_optim::coverage`, level WARN) where a subscriber records
//! them, and to stderr otherwise: lpmm cannot know whether a user installed a subscriber, and a
//! model that does not train is a defect the user must see on the first step, not a log line
//! nobody collects. A warning is given on the first step that finds parameters without a
//! gradient and again each time that set changes, so a loop that steps the same partial set
//! prints it once.

use crate::error::{OptimError, name_list};

/// How many names of parameters without a gradient a [`MissingGradients`] keeps (the count is
/// always complete).
pub const MISSING_NAMES: usize = 16;

/// What a step does when registered parameters that expect a gradient received none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum MissingGradientPolicy {
    /// Step the parameters that have a gradient, report the others in the step report only.
    Ignore,
    /// Step the parameters that have a gradient, report the others, and warn (`tracing` where a
    /// subscriber records it, stderr otherwise) on the first step that finds such parameters and
    /// each time that set changes.
    #[default]
    Warn,
    /// Refuse the step ([`OptimError::MissingGradient`], naming them): nothing changes — no
    /// parameter, state or counter moves and no gradient is consumed.
    Error,
}

/// The parameters a step found without a gradient ([`crate::StepReport::missing_gradients`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MissingGradients {
    /// How many parameters that expect a gradient received none in this step.
    pub count: usize,
    /// How many parameters were checked: the registered parameters that expect a gradient (0 for
    /// a step that is not a coverage check: a released step, `Step::param`, covers one parameter
    /// by design).
    pub checked: usize,
    /// The names of the first [`MISSING_NAMES`] of them, in registration order.
    pub names: Vec<String>,
    /// FNV-1a over every name (not only those kept), so two sets are told apart; 0 when empty.
    fingerprint: u64,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl MissingGradients {
    /// The parameters without a gradient among `checked`, by name, in a fixed order (the same
    /// set in the same order gives an equal value): for an integration that checks parameters the
    /// optimizer has not registered (lpmm-burn registers a parameter at its first gradient).
    pub fn new<'a>(checked: usize, missing: impl IntoIterator<Item = &'a str>) -> Self {
        let mut m = MissingGradients {
            checked,
            ..MissingGradients::default()
        };
        for name in missing {
            m.push(name);
        }
        m
    }

    /// Whether every checked parameter received a gradient.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Counts one more parameter without a gradient (its name kept while fewer than
    /// [`MISSING_NAMES`] are).
    pub(crate) fn push(&mut self, name: &str) {
        let mut h = if self.count == 0 {
            FNV_OFFSET
        } else {
            self.fingerprint
        };
        // 0xff never occurs in UTF-8: it separates the names.
        for b in name.bytes().chain([0xff]) {
            h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        self.fingerprint = h;
        self.count += 1;
        if self.names.len() < MISSING_NAMES {
            self.names.push(name.to_string());
        }
    }

    /// What identifies the set (its size and fingerprint).
    fn key(&self) -> (usize, u64) {
        (self.count, self.fingerprint)
    }
}

/// The framework-specific part of the missing-gradient message: likely causes, and how to
/// silence the check, in the caller's API. lpmm-candle names candle-nn's fused operators without
/// a backward pass; lpmm-burn names burn's frozen parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MissingGradientHelp {
    /// Causes beyond the generic ones (a detached tensor, an unused layer), or "".
    pub causes: &'static str,
    /// How to exclude parameters frozen on purpose.
    pub exclude: &'static str,
    /// How to set the policy: a function called with it (`LpmmConfig::with_missing_gradient`),
    /// or where it is assigned, ending in `=` (`opt.settings_mut().missing_gradient =`).
    pub policy: &'static str,
}

impl MissingGradientHelp {
    /// The optimizer core's own: [`crate::Optimizer::set_expects_gradient`] and
    /// [`crate::Settings::missing_gradient`] (through [`crate::Optimizer::settings_mut`]).
    pub const CORE: MissingGradientHelp = MissingGradientHelp {
        causes: "",
        exclude: "Optimizer::set_expects_gradient(id, false)",
        policy: "Optimizer::settings_mut().missing_gradient =",
    };

    /// Help with these causes, exclusion and policy instructions.
    pub const fn new(causes: &'static str, exclude: &'static str, policy: &'static str) -> Self {
        MissingGradientHelp {
            causes,
            exclude,
            policy,
        }
    }

    /// The likely causes and what to do, as three sentences.
    fn sentences(&self) -> [String; 3] {
        let extra = if self.causes.is_empty() {
            String::new()
        } else {
            format!("{}; ", self.causes)
        };
        [
            format!(
                "Likely causes: {extra}a tensor detached from the graph before the loss; a layer \
                 the forward pass does not use."
            ),
            format!(
                "Parameters frozen on purpose: exclude them ({}).",
                self.exclude
            ),
            format!(
                "To silence this check: {}; to refuse such a step instead: \
                 MissingGradientPolicy::Error.",
                match self.policy.strip_suffix('=') {
                    Some(place) => format!("{place}= MissingGradientPolicy::Ignore"),
                    None => format!("{}(MissingGradientPolicy::Ignore)", self.policy),
                }
            ),
        ]
    }
}

/// Applies a [`MissingGradientPolicy`] to each step's [`MissingGradients`], remembering which set
/// it warned about last. The optimizer core holds one; an integration that checks parameters
/// the optimizer does not know of (lpmm-burn) holds its own.
#[derive(Debug, Clone)]
pub struct CoverageCheck {
    policy: MissingGradientPolicy,
    help: MissingGradientHelp,
    /// The set warned about last (size, fingerprint); `None` once a step covered everything.
    warned: Option<(usize, u64)>,
}

impl Default for CoverageCheck {
    fn default() -> Self {
        CoverageCheck::new(MissingGradientPolicy::default(), MissingGradientHelp::CORE)
    }
}

impl CoverageCheck {
    /// A check with `policy`, whose messages give `help`.
    pub fn new(policy: MissingGradientPolicy, help: MissingGradientHelp) -> Self {
        CoverageCheck {
            policy,
            help,
            warned: None,
        }
    }

    /// The policy.
    pub fn policy(&self) -> MissingGradientPolicy {
        self.policy
    }

    /// Sets the policy (the set warned about is forgotten: the next partial step warns).
    pub fn set_policy(&mut self, policy: MissingGradientPolicy) {
        self.policy = policy;
        self.warned = None;
    }

    /// The help its messages give.
    pub fn help(&self) -> MissingGradientHelp {
        self.help
    }

    /// Sets the help its messages give.
    pub fn set_help(&mut self, help: MissingGradientHelp) {
        self.help = help;
    }

    /// Applies the policy to what step `step` found, before the step changes anything: `Error`
    /// returns [`OptimError::MissingGradient`] where a parameter lacks a gradient; `Warn` warns
    /// where the set differs from the one warned about last. Allocates nothing when every
    /// parameter has a gradient.
    pub fn check(&mut self, missing: &MissingGradients, step: u64) -> Result<(), OptimError> {
        if missing.is_empty() {
            if self.warned.take().is_some() {
                tracing::info!(step, "lpmm: every parameter received a gradient again");
            }
            return Ok(());
        }
        match self.policy {
            MissingGradientPolicy::Ignore => Ok(()),
            MissingGradientPolicy::Error => Err(OptimError::MissingGradient {
                step,
                count: missing.count,
                checked: missing.checked,
                names: missing.names.clone(),
                help: self.help.sentences().join(" "),
            }),
            MissingGradientPolicy::Warn => {
                if self.warned != Some(missing.key()) {
                    self.warned = Some(missing.key());
                    warn(&format!(
                        "step {step}: {} of {} parameters received no gradient: {}.\n  The \
                         optimizer steps only the parameters that receive one: these keep their \
                         values.\n  {}",
                        missing.count,
                        missing.checked,
                        name_list(&missing.names, missing.count),
                        self.help.sentences().join("\n  ")
                    ));
                }
                Ok(())
            }
        }
    }
}

/// A warning users must see: to `tracing` where a subscriber records it, to stderr otherwise.
fn warn(message: &str) {
    user_warning("lpmm", message);
}

/// A warning users must see, from crate `source` ("lpmm", "lpmm-burn", ...): to `tracing`
/// (level WARN) where a subscriber records it, to stderr otherwise (lpmm cannot know whether a
/// user installed a subscriber; most training programs do not).
pub fn user_warning(source: &str, message: &str) {
    if tracing::enabled!(tracing::Level::WARN) {
        tracing::warn!("{source}: {message}");
    } else {
        eprintln!(
            "{source} warning: {message}\n  (On stderr because no tracing subscriber records \
             lpmm's warnings.)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_is_told_from_another_beyond_the_names_kept() {
        let names: Vec<String> = (0..40).map(|i| format!("p{i}")).collect();
        let a = MissingGradients::new(50, names.iter().map(String::as_str));
        let b = MissingGradients::new(50, names[..39].iter().map(String::as_str).chain(["q"]));
        assert_eq!((a.count, a.names.len()), (40, MISSING_NAMES));
        assert_eq!(a.names, b.names);
        assert_ne!(a, b);
        assert_eq!(
            a,
            MissingGradients::new(50, names.iter().map(String::as_str))
        );
        assert_eq!(
            MissingGradients::new(3, []),
            MissingGradients {
                checked: 3,
                ..MissingGradients::default()
            }
        );
    }

    #[test]
    fn warn_only_when_the_set_changes_and_error_names_them() {
        let one = MissingGradients::new(3, ["a"]);
        let two = MissingGradients::new(3, ["a", "b"]);
        let mut check = CoverageCheck::default();
        check.check(&one, 1).unwrap();
        assert_eq!(check.warned, Some(one.key()));
        check.check(&two, 2).unwrap();
        assert_eq!(check.warned, Some(two.key()));
        check.check(&MissingGradients::new(3, []), 3).unwrap();
        assert_eq!(check.warned, None);
        check.set_policy(MissingGradientPolicy::Error);
        let e = check.check(&two, 4).unwrap_err().to_string();
        assert!(e.contains("2 of 3 parameters") && e.contains("a, b"), "{e}");
        check.set_policy(MissingGradientPolicy::Ignore);
        check.check(&two, 5).unwrap();
        assert_eq!(check.warned, None);
    }
}
