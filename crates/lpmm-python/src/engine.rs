//! The optimizer behind a Python optimizer: an [`Optimizer`] on the CPU backend whose parameters
//! are the framework's buffers where their storage allows (lent: stepped in place, no copy), and
//! lpmm's own memory otherwise (the buffer then receives the parameter after every step). Pure
//! Rust over host slices: the Python module lends torch's tensors as slices (`py.rs`).

use half::bf16;
use lpmm_optim::backend::{Dtype, HostValues, HostValuesMut};
use lpmm_optim::{
    Cpu, Gradients, Lender, Lent, MissingGradientPolicy, OptimError, Optimizer, OptimizerOptions,
    ParamConfig, ParamId, SlotKind, Step, StepReport, Storage, WithGradient,
};
use lpmm_optim::{Mode, Out};

use crate::{EngineError, config};

/// A registered parameter.
#[derive(Debug, Clone)]
pub struct ParamEntry {
    /// Its name in errors and in lpmm (the torch name where the optimizer was given names).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its element count.
    pub numel: usize,
    /// The dtype of its buffer.
    pub dtype: Dtype,
    /// The buffer is lpmm's parameter (stepped in place); otherwise lpmm holds the parameter and
    /// writes it into the buffer after every step.
    pub lent: bool,
    /// Its group.
    pub group: usize,
    /// Its id in the optimizer.
    pub id: ParamId,
}

/// A parameter group: the configuration its parameters take (their storage chosen per tensor).
#[derive(Debug, Clone)]
pub struct GroupEntry {
    /// The group's configuration (hyperparameters and the states' storages).
    pub config: ParamConfig,
    /// Where the parameters' values live ([`config::param_storage`]).
    pub param_storage: String,
}

/// What a step did, with parameters named.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Parameters updated.
    pub updated: usize,
    /// The whole step was skipped for a non-finite gradient.
    pub skipped: bool,
    /// Parameters whose gradient held a non-finite value.
    pub non_finite: Vec<String>,
    /// The global gradient norm, where it was computed.
    pub grad_norm: Option<f64>,
    /// Parameters without a gradient in a step (the first few of them, by name).
    pub missing: Vec<String>,
}

/// The optimizer of one Python optimizer.
#[derive(Debug)]
pub struct Engine {
    pub(crate) opt: Optimizer<Cpu>,
    pub(crate) params: Vec<ParamEntry>,
    pub(crate) groups: Vec<GroupEntry>,
}

/// Gradients by parameter index (`None`: no gradient this step).
struct Given<'g, 'a> {
    grads: &'g [Option<HostValues<'a>>],
}

impl Gradients<Cpu> for Given<'_, '_> {
    fn gradient(&mut self, id: ParamId, f: &mut WithGradient<'_, Cpu>) -> Result<(), OptimError> {
        f(self.grads.get(id.index()).copied().flatten())
    }
}

/// Lent buffers by parameter index, for the operations that take a [`Lender`].
pub(crate) struct Buffers<'s, 'a> {
    pub(crate) buffers: &'s mut [Option<HostValuesMut<'a>>],
}

impl Lender<Cpu> for Buffers<'_, '_> {
    fn lend(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(HostValues<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError> {
        match self.buffers.get(id.index()) {
            Some(Some(b)) => f(read_only(b)),
            _ => Err(missing_buffer(id)),
        }
    }

    fn lend_mut(
        &mut self,
        id: ParamId,
        f: &mut dyn FnMut(HostValuesMut<'_>) -> Result<(), OptimError>,
    ) -> Result<(), OptimError> {
        match self.buffers.get_mut(id.index()) {
            Some(Some(b)) => f(b.reborrow()),
            _ => Err(missing_buffer(id)),
        }
    }
}

fn missing_buffer(id: ParamId) -> OptimError {
    OptimError::Lent {
        param: format!("#{}", id.index()),
        reason: "its tensor was not given".into(),
    }
}

/// A writable buffer read-only.
pub(crate) fn read_only<'b>(values: &'b HostValuesMut<'_>) -> HostValues<'b> {
    match values {
        HostValuesMut::F32(v) => HostValues::F32(v),
        HostValuesMut::Bf16(v) => HostValues::Bf16(v),
    }
}

/// A buffer's values as f32 (a held parameter's initial values).
fn to_f32(values: HostValues<'_>) -> Vec<f32> {
    match values {
        HostValues::F32(v) => v.to_vec(),
        HostValues::Bf16(v) => v.iter().map(|x| bf16::to_f32(*x)).collect(),
    }
}

impl Engine {
    /// An optimizer with `options` and no parameters. Parameters without a gradient in a step are
    /// skipped as torch skips them (`missing`: [`MissingGradientPolicy::Ignore`] by default).
    pub fn new(
        options: OptimizerOptions,
        missing: MissingGradientPolicy,
    ) -> Result<Self, EngineError> {
        let mut opt = Optimizer::new(options)?;
        opt.settings_mut().missing_gradient = missing;
        Ok(Engine {
            opt,
            params: Vec::new(),
            groups: Vec::new(),
        })
    }

    /// The registered parameters.
    pub fn params(&self) -> &[ParamEntry] {
        &self.params
    }

    /// The groups.
    pub fn groups(&self) -> &[GroupEntry] {
        &self.groups
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &Optimizer<Cpu> {
        &self.opt
    }

    /// Adds a group; `config`'s gradient storage is replaced by none (torch hands over its
    /// gradients at each step: lpmm keeps no accumulator).
    pub fn add_group(
        &mut self,
        config: ParamConfig,
        param_storage: &str,
    ) -> Result<usize, EngineError> {
        config::param_storage(param_storage, config.param, Dtype::F32)?;
        let config = config.with_grad(Storage::None);
        let index = self.opt.add_group(config)?;
        self.groups.push(GroupEntry {
            config,
            param_storage: param_storage.to_string(),
        });
        Ok(index)
    }

    /// The configuration of a parameter of `dtype` in `group`.
    pub fn param_config(&self, group: usize, dtype: Dtype) -> Result<ParamConfig, EngineError> {
        let g = self
            .groups
            .get(group)
            .ok_or_else(|| EngineError::Config(format!("no parameter group {group}")))?;
        let storage = config::param_storage(&g.param_storage, g.config.param, dtype)?;
        Ok(g.config.with_param(storage))
    }

    /// Registers the parameter in buffer `values` as `name` in `group`: lent where its storage is
    /// the buffer's dtype, otherwise held by lpmm (initialised from `values`, which then receive
    /// the stored parameter). Returns its index.
    pub fn add_param(
        &mut self,
        name: &str,
        shape: &[usize],
        mut values: HostValuesMut<'_>,
        group: usize,
    ) -> Result<usize, EngineError> {
        let (dtype, numel) = values.info();
        let config = self.param_config(group, dtype)?;
        let lent = config::lendable(config.resolve(numel, shape).param, dtype);
        let id = if lent {
            self.opt
                .add_lent_param(name, shape, read_only(&values), group, config)?
        } else {
            let init = to_f32(read_only(&values));
            let id = self.opt.add_param_with(name, shape, &init, group, config)?;
            self.opt
                .read(id, SlotKind::Param, Out::Backend(values.reborrow()))?;
            id
        };
        self.params.push(ParamEntry {
            name: name.to_string(),
            shape: shape.to_vec(),
            numel,
            dtype,
            lent,
            group,
            id,
        });
        Ok(self.params.len() - 1)
    }

    /// Sets a group's learning rate, from the next step.
    pub fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<(), EngineError> {
        self.opt.set_group_lr(group, lr)?;
        self.groups[group].config.hyper.set_lr(lr);
        Ok(())
    }

    /// Whether parameter `index` counts as missing a gradient in a step without one (`false`:
    /// the tensor left its param group, so torch would not step it).
    pub fn set_expects_gradient(&mut self, index: usize, expects: bool) -> Result<(), EngineError> {
        let id = self
            .params
            .get(index)
            .ok_or_else(|| EngineError::Config(format!("no parameter {index}")))?
            .id;
        self.opt.set_expects_gradient(id, expects)?;
        Ok(())
    }

    /// One step of every parameter with a gradient: `params[i]` is parameter `i`'s buffer (needed
    /// where it has a gradient), `grads[i]` its gradient. Lent parameters are stepped in their
    /// buffers; held ones are written into theirs after the step.
    pub fn step(
        &mut self,
        params: &mut [Option<HostValuesMut<'_>>],
        grads: &[Option<HostValues<'_>>],
    ) -> Result<Report, EngineError> {
        self.check_lengths(params.len(), grads.len())?;
        let mut lent = Vec::new();
        let mut held = Vec::new();
        for (entry, buffer) in self.params.iter().zip(params.iter_mut()) {
            if let Some(b) = buffer {
                if entry.lent {
                    lent.push((entry.id, b.reborrow()));
                } else {
                    held.push((entry.id, b.reborrow()));
                }
            }
        }
        let mut given = Given { grads };
        let report = self
            .opt
            .step(Step::given(&mut given).lent(Lent::Buffers(&mut lent)))?;
        if !report.skipped {
            for (id, buffer) in held {
                if grads[id.index()].is_some() {
                    self.opt.read(id, SlotKind::Param, Out::Backend(buffer))?;
                }
            }
        }
        Ok(self.report(report))
    }

    /// Gradient release: steps parameter `index` now with `grad`, in `param`.
    pub fn step_param(
        &mut self,
        index: usize,
        mut param: HostValuesMut<'_>,
        grad: HostValues<'_>,
    ) -> Result<Report, EngineError> {
        let entry = self
            .params
            .get(index)
            .ok_or_else(|| EngineError::Config(format!("no parameter {index}")))?;
        let id = entry.id;
        let report = if entry.lent {
            let mut lent = [(id, param)];
            self.opt
                .step(Step::param(id, grad).lent(Lent::Buffers(&mut lent)))?
        } else {
            let report = self.opt.step(Step::param(id, grad))?;
            if !report.skipped {
                self.opt
                    .read(id, SlotKind::Param, Out::Backend(param.reborrow()))?;
            }
            report
        };
        Ok(self.report(report))
    }

    /// Moves the parameters to their evaluation point (`eval = true`: schedule-free AdamW's
    /// averaged weights) or back to their training point; `params` as for [`Engine::step`].
    pub fn set_eval(
        &mut self,
        eval: bool,
        params: &mut [Option<HostValuesMut<'_>>],
    ) -> Result<(), EngineError> {
        self.check_lengths(params.len(), params.len())?;
        let mut lender = Buffers { buffers: params };
        let mode = if eval { Mode::Eval } else { Mode::Train };
        self.opt.set_mode(mode, Lent::Lender(&mut lender))?;
        for entry in self.params.iter().filter(|e| !e.lent) {
            if let Some(b) = &mut lender.buffers[entry.id.index()] {
                self.opt
                    .read(entry.id, SlotKind::Param, Out::Backend(b.reborrow()))?;
            }
        }
        Ok(())
    }

    /// Whether the parameters hold their evaluation point.
    pub fn in_eval(&self) -> bool {
        self.opt.status().mode == Mode::Eval
    }

    fn check_lengths(&self, params: usize, grads: usize) -> Result<(), EngineError> {
        if params != self.params.len() || grads != self.params.len() {
            return Err(EngineError::Config(format!(
                "{params} parameters and {grads} gradients given for {} registered parameters",
                self.params.len()
            )));
        }
        Ok(())
    }

    fn report(&self, r: StepReport) -> Report {
        let name = |id: ParamId| self.params[id.index()].name.clone();
        Report {
            updated: r.updated,
            skipped: r.skipped,
            non_finite: r.non_finite.iter().map(|&id| name(id)).collect(),
            grad_norm: r.grad_norm,
            missing: r.missing_gradients.names.clone(),
        }
    }

    /// Bytes lpmm holds per slot (parameter, gradient, states 1 to 3): a lent parameter's buffer
    /// is torch's and not counted.
    pub fn memory(&self) -> [usize; 5] {
        self.opt.memory_report().slot_totals()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(preset: &str, storage: &str) -> Engine {
        let mut e = Engine::new(
            OptimizerOptions::default().with_seed(7),
            MissingGradientPolicy::Ignore,
        )
        .unwrap();
        e.add_group(config::preset(preset, 1e-2).unwrap(), storage)
            .unwrap();
        e
    }

    fn grad(n: usize, k: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + k * 13) % 17) as f32 * 1e-3 - 8e-3)
            .collect()
    }

    /// A lent f32 parameter is stepped in its buffer, bit for bit as the same parameter held by
    /// lpmm (the Rust API's `add_param`).
    #[test]
    fn lent_buffers_step_as_held_parameters() {
        let n = 8192;
        let mut e = engine("adamw_8bit", "auto");
        let mut w = vec![0.25f32; n];
        let i = e
            .add_param("w", &[64, 128], HostValuesMut::F32(&mut w), 0)
            .unwrap();
        assert!(e.params()[i].lent);
        let mut reference = Optimizer::new(OptimizerOptions::default().with_seed(7)).unwrap();
        let g0 = reference
            .add_group(
                config::preset("adamw_8bit", 1e-2)
                    .unwrap()
                    .with_grad(Storage::None),
            )
            .unwrap();
        let r = reference
            .add_param("w", &[64, 128], &vec![0.25f32; n], g0)
            .unwrap();
        for k in 0..5 {
            let g = grad(n, k);
            let report = e
                .step(
                    &mut [Some(HostValuesMut::F32(&mut w))],
                    &[Some(HostValues::F32(&g))],
                )
                .unwrap();
            assert_eq!(report.updated, 1);
            let mut grads = vec![g];
            reference.step(&mut grads).unwrap();
        }
        let mut expected = vec![0f32; n];
        reference.read(r, SlotKind::Param, &mut expected).unwrap();
        assert_eq!(
            w.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            expected.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(e.memory()[0], 0, "a lent parameter's buffer is not lpmm's");
    }

    /// LPMM-SGDM's 8-bit parameter is held by lpmm: the buffer receives it at registration and
    /// after each step.
    #[test]
    fn held_parameters_are_written_back() {
        let n = 4096;
        let mut e = engine("lpmm_sgdm", "preset");
        let mut w: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let before = w.clone();
        e.add_param("w", &[n], HostValuesMut::F32(&mut w), 0)
            .unwrap();
        assert!(!e.params()[0].lent);
        assert_ne!(w, before, "the buffer holds the 8-bit parameter's value");
        let mut read = vec![0f32; n];
        e.opt
            .read(e.params()[0].id, SlotKind::Param, &mut read)
            .unwrap();
        assert_eq!(w, read);
        let g = grad(n, 1);
        e.step(
            &mut [Some(HostValuesMut::F32(&mut w))],
            &[Some(HostValues::F32(&g))],
        )
        .unwrap();
        e.opt
            .read(e.params()[0].id, SlotKind::Param, &mut read)
            .unwrap();
        assert_eq!(w, read);
        assert_ne!(w, before);
    }

    /// No gradient: not stepped, no buffer needed; a skipped step (NaN) changes nothing.
    #[test]
    fn missing_and_non_finite_gradients() {
        let n = 300;
        let mut e = engine("adamw_8bit", "auto");
        let mut a = vec![1f32; n];
        let mut b = vec![bf16::ONE; n];
        e.add_param("a", &[n], HostValuesMut::F32(&mut a), 0)
            .unwrap();
        e.add_param("b", &[n], HostValuesMut::Bf16(&mut b), 0)
            .unwrap();
        let g = grad(n, 0);
        let r = e
            .step(
                &mut [Some(HostValuesMut::F32(&mut a)), None],
                &[Some(HostValues::F32(&g)), None],
            )
            .unwrap();
        assert_eq!(r.updated, 1);
        assert!(b.iter().all(|x| *x == bf16::ONE));
        let a_before = a.clone();
        let mut bad = g.clone();
        bad[3] = f32::NAN;
        let r = e
            .step(
                &mut [Some(HostValuesMut::F32(&mut a)), None],
                &[Some(HostValues::F32(&bad)), None],
            )
            .unwrap();
        assert!(r.skipped);
        assert_eq!(r.non_finite, vec!["a".to_string()]);
        assert_eq!(a, a_before);
    }
}
