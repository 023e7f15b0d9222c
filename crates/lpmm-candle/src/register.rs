//! Registering `Var`s with the engine: each lent where its dtype is its storage's, the engine
//! moved to the first `Var`'s device, and the table from lpmm's parameters back to the `Var`s.

use candle_core::{CpuStorage, DType, Device, DeviceLocation, Error, Result, Var};
use lpmm_optim::Parts;
use lpmm_optim::backend::Dtype;
use lpmm_optim::{Optimizer, ParamConfig, ParamId};

use crate::config::configure;
#[cfg(feature = "cuda")]
use crate::cuda;
use crate::engine::{Engine, on_engine};
use crate::error::wrap;
use crate::lane::{Lane, initial_f32};
use crate::optimizer::Inner;

/// A `Var` registered with lpmm.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) var: Var,
    pub(crate) id: ParamId,
    /// The `Var` is the parameter (lent); otherwise lpmm holds it and the `Var` is set to it
    /// after every step.
    pub(crate) lent: bool,
    /// For a `Var` lpmm sets (not lent, on the CPU): a hash of the values lpmm last set it to,
    /// which tells a write by the user since ([`contents`]).
    pub(crate) written: std::cell::Cell<Option<u64>>,
}

/// A hash of a CPU `Var`'s values (`None` on another device), to tell whether it changed.
pub(crate) fn contents(var: &Var) -> Option<u64> {
    use std::hash::Hasher;
    let (storage, layout) = var.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return None;
    };
    let (start, end) = layout.contiguous_offsets()?;
    let mut h = std::hash::DefaultHasher::new();
    match cpu {
        CpuStorage::F32(v) => v[start..end].iter().for_each(|x| h.write_u32(x.to_bits())),
        CpuStorage::F64(v) => v[start..end].iter().for_each(|x| h.write_u64(x.to_bits())),
        CpuStorage::BF16(v) => v[start..end].iter().for_each(|x| h.write_u16(x.to_bits())),
        CpuStorage::F16(v) => v[start..end].iter().for_each(|x| h.write_u16(x.to_bits())),
        _ => return None,
    }
    Some(h.finish())
}

/// The `Var` of registered parameter `id` (none for the layers' own parameters): `by_id` maps
/// lpmm's parameters to entries of `vars`.
pub(crate) fn var_of<'a>(
    vars: &'a [Entry],
    by_id: &[Option<usize>],
    id: ParamId,
) -> Option<&'a Var> {
    by_id
        .get(id.index())
        .copied()
        .flatten()
        .map(|k| &vars[k].var)
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
        let backend = Parts::of(opt).backend().clone();
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
        initial_f32(var.as_tensor(), |init| {
            opt.add_param_with(name, shape, init, group, config)
                .map_err(wrap)
        })
    }
}
impl Inner {
    /// Registers `var` as `name`.
    pub(crate) fn register(&mut self, name: &str, var: Var) -> Result<()> {
        self.take_device(var.device(), |location, engine| {
            format!(
                "Var {name} is on {location:?}, but this optimizer steps Vars on {engine}: lpmm \
                 steps the Vars of one device"
            )
        })?;
        let dims = var.dims().to_vec();
        // A scalar Var has no dimensions; lpmm stores it as one element.
        let shape = if dims.is_empty() { vec![1] } else { dims };
        let (group, config) = self.config.config_for(name, &shape);
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
            written: std::cell::Cell::new(None),
        });
        Ok(())
    }

    /// Moves the engine to `device` while it is empty (the first parameter picks the device);
    /// an error from `refuse(device's location, the engine's device)` where a parameter on
    /// `device` cannot join it.
    pub(crate) fn take_device(
        &mut self,
        device: &Device,
        refuse: impl FnOnce(DeviceLocation, String) -> String,
    ) -> Result<()> {
        if self.opt.is_empty() && !self.opt.owns(device) {
            self.switch_device(device)?;
        }
        if !self.opt.owns(device) {
            return Err(Error::Msg(refuse(
                device.location(),
                self.opt.device_name(),
            )));
        }
        Ok(())
    }

    /// An empty engine on `device` in place of the current (empty) one: the same groups and
    /// learning rates.
    fn switch_device(&mut self, device: &Device) -> Result<()> {
        let groups = self.config.all_groups();
        // A learning rate set before (`set_learning_rate`) is set again, as it set it.
        let base = self.config.param.hyper.lr();
        let set_lrs: Option<Vec<f64>> = (self.lr != base).then(|| {
            self.config
                .lr_ratios()
                .into_iter()
                .map(|r| self.lr * r)
                .collect()
        });
        let mut engine = match device {
            Device::Cpu => Engine::Cpu(Optimizer::new(self.config.options).map_err(wrap)?),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Engine::Cuda(cuda::CudaEngine::new(d, self.config.options)?),
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
}
