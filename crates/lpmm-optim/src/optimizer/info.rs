//! What a training loop reads of the optimizer and the settings it may change at any time:
//! [`Optimizer::param`] and [`Optimizer::params`] ([`ParamInfo`]), [`Optimizer::status`]
//! ([`Status`]) and [`Optimizer::settings_mut`] ([`Settings`]).

use crate::backend::{Backend, HostValuesMut, ParamId, StepPlan};
use crate::config::ParamConfig;
use crate::coverage::{MissingGradientHelp, MissingGradientPolicy};
use crate::error::OptimError;
use crate::rule::RuleState;

use super::{Optimizer, OptimizerOptions, ParamState};

/// Where a parameter's rule evaluates ([`Optimizer::set_mode`]): at its training point, or at
/// its evaluation point (schedule-free AdamW's average `x`; every other rule has one point).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// The training point: steps are taken here.
    #[default]
    Train,
    /// The evaluation point: no step until [`Mode::Train`].
    Eval,
}

/// What the optimizer does that checkpoints do not hold, changed at any time through
/// [`Optimizer::settings_mut`] and kept across [`Optimizer::load`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settings {
    /// What a step does when parameters that expect a gradient received none
    /// ([`super::StepReport::missing_gradients`]): ignore, warn (the default) or refuse the
    /// step. A change forgets the set warned about last, so the next partial step warns.
    pub missing_gradient: MissingGradientPolicy,
    /// The likely causes and instructions that the missing-gradient warning and error give: a
    /// framework integration names its own operators and API here
    /// ([`MissingGradientHelp::CORE`] by default).
    pub missing_gradient_help: MissingGradientHelp,
    /// Steps every parameter's fused pass with the specialized kernels where one exists (`true`,
    /// the default) or on the generic element-wise path (`false`): the same bits either way (the
    /// generic path is the reference the kernels are tested against), only speed differs.
    pub specialized_kernels: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            missing_gradient: MissingGradientPolicy::default(),
            missing_gradient_help: MissingGradientHelp::CORE,
            specialized_kernels: true,
        }
    }
}

impl Settings {
    /// `plan` as these settings run it.
    pub(crate) fn plan(&self, plan: StepPlan) -> StepPlan {
        if self.specialized_kernels {
            plan
        } else {
            plan.generic()
        }
    }
}

/// The optimizer as a whole ([`Optimizer::status`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Status {
    /// Steps taken by [`Optimizer::step`] from the accumulators or given gradients (released
    /// steps of one parameter do not count).
    pub steps: u64,
    /// Registered parameters.
    pub params: usize,
    /// The mode ([`Optimizer::set_mode`]).
    pub mode: Mode,
    /// The options it was built with.
    pub options: OptimizerOptions,
    /// The settings in force ([`Optimizer::settings_mut`]).
    pub settings: Settings,
}

/// One registered parameter ([`Optimizer::param`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct ParamInfo<'a> {
    /// Its id.
    pub id: ParamId,
    /// Its name.
    pub name: &'a str,
    /// Its shape as registered (a shard's is `[len]`).
    pub shape: &'a [usize],
    /// Its group.
    pub group: usize,
    /// The configuration in force (storages resolved by the minimum-size and shape rules).
    pub config: ParamConfig,
    /// Whether it lives in the caller's buffer ([`Optimizer::add_lent_param`]).
    pub lent: bool,
    /// Its step plan: the tensor-wide phases and the kernel of its fused pass
    /// ([`crate::Cpu::kernel_name`] names the CPU's), as [`Settings::specialized_kernels`] runs it.
    pub plan: StepPlan,
    /// Steps it has taken.
    pub steps: u64,
    /// Its rule's host state ([`RuleState`]: schedule-free AdamW's averaging weights).
    pub rule_state: RuleState,
    /// Whether it is expected to receive a gradient in every step
    /// ([`Optimizer::set_expects_gradient`]).
    pub expects_gradient: bool,
    /// Whether it received a gradient since the last step: accumulated (pending), or taken by a
    /// released step. A step from accumulators counts it as covered exactly when this is true.
    pub received_gradient: bool,
}

/// Which parameter [`Optimizer::param`] looks up: its id, or its name (`&str`, `&String`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKey<'a> {
    /// By id.
    Id(ParamId),
    /// By name.
    Name(&'a str),
}

impl From<ParamId> for ParamKey<'_> {
    fn from(id: ParamId) -> Self {
        ParamKey::Id(id)
    }
}

impl<'a> From<&'a str> for ParamKey<'a> {
    fn from(name: &'a str) -> Self {
        ParamKey::Name(name)
    }
}

impl<'a> From<&'a String> for ParamKey<'a> {
    fn from(name: &'a String) -> Self {
        ParamKey::Name(name)
    }
}

/// Where [`Optimizer::read`] decodes a slot: host values (copied out of the backend's memory
/// where that is elsewhere) or a buffer of the backend's. `&mut [f32]`, `&mut Vec<f32>` and
/// [`HostValuesMut`] convert into it.
pub enum Out<'a, B: Backend> {
    /// Host values, f32 or bf16 (rounded to nearest).
    Host(HostValuesMut<'a>),
    /// A buffer in the backend's memory.
    Backend(B::Output<'a>),
}

impl<B: Backend> std::fmt::Debug for Out<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Out::Host(h) => f.debug_tuple("Host").field(h).finish(),
            Out::Backend(_) => f.write_str("Backend(..)"),
        }
    }
}

impl<'a, B: Backend> From<&'a mut [f32]> for Out<'a, B> {
    fn from(values: &'a mut [f32]) -> Self {
        Out::Host(HostValuesMut::F32(values))
    }
}

impl<'a, B: Backend> From<&'a mut Vec<f32>> for Out<'a, B> {
    fn from(values: &'a mut Vec<f32>) -> Self {
        Out::Host(HostValuesMut::F32(values))
    }
}

impl<'a, B: Backend, const N: usize> From<&'a mut [f32; N]> for Out<'a, B> {
    fn from(values: &'a mut [f32; N]) -> Self {
        Out::Host(HostValuesMut::F32(values))
    }
}

impl<'a, B: Backend> From<HostValuesMut<'a>> for Out<'a, B> {
    fn from(values: HostValuesMut<'a>) -> Self {
        Out::Host(values)
    }
}

impl<B: Backend> Optimizer<B> {
    fn info(&self, index: usize) -> ParamInfo<'_> {
        let m: &ParamState = &self.states[index];
        let layout = &self.layouts[index];
        ParamInfo {
            id: ParamId(index),
            name: &m.name,
            shape: &layout.shape,
            group: m.group,
            config: m.config,
            lent: layout.lent,
            plan: self.settings.plan(m.step_plan),
            steps: m.steps,
            rule_state: m.rule_state,
            expects_gradient: m.expects_gradient,
            received_gradient: m.pending || m.released,
        }
    }

    /// The parameter with this id or name ([`OptimError::UnknownParam`] if there is none).
    pub fn param<'k>(&self, key: impl Into<ParamKey<'k>>) -> Result<ParamInfo<'_>, OptimError> {
        let index = match key.into() {
            ParamKey::Id(id) => self.state(id).map(|_| id.0)?,
            ParamKey::Name(name) => *self
                .names
                .get(name)
                .ok_or_else(|| OptimError::UnknownParam(name.to_string()))?,
        };
        Ok(self.info(index))
    }

    /// Every registered parameter, in registration order (ids 0, 1, ...).
    pub fn params(&self) -> impl ExactSizeIterator<Item = ParamInfo<'_>> + '_ {
        (0..self.states.len()).map(|i| self.info(i))
    }

    /// The groups' configurations, in order (a group's learning rate is its hyperparameters'
    /// `lr`: [`crate::Hyper::lr`]).
    pub fn groups(&self) -> &[ParamConfig] {
        &self.groups
    }

    /// The optimizer as a whole: its step count, mode, options and settings.
    pub fn status(&self) -> Status {
        Status {
            steps: self.global_steps,
            params: self.states.len(),
            mode: if self.eval { Mode::Eval } else { Mode::Train },
            options: self.options,
            settings: self.settings,
        }
    }

    /// The settings checkpoints do not hold ([`Settings`]), to change: the missing-gradient
    /// policy and its help, the specialized kernels on or off.
    pub fn settings_mut(&mut self) -> &mut Settings {
        &mut self.settings
    }
}
