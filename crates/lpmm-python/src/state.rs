//! The optimizer's state as torch state-dict entries, and back: every use of lpmm-optim's
//! checkpoint and slot functions for implementors (`Parts::canonical`, `Parts::export_slot`,
//! `PartsMut::import_slot`, `restore`, `restore_rule_state`, `set_steps`) is in this module.
//!
//! A parameter's state is its metadata (a JSON string: counters, the configuration, the
//! optimizer's options and step count) and its slots' regions as raw little-endian bytes, each
//! under the key `<slot><suffix>` (`state1`, `state1.absmax`, `param.comp`, ...). Bytes survive
//! torch's `load_state_dict`, which casts floating-point state to the parameter's dtype but
//! leaves integer tensors alone. A lent parameter's values are the tensor itself (the model's
//! state dict holds them): its primary region is not saved, and on load it is the tensor's.

use lpmm_optim::backend::{HostValues, HostValuesMut};
use lpmm_optim::{Cpu, LrRule, Optimizer, OptimizerOptions, ParamConfig, RuleState, SlotKind};
use lpmm_optim::{Mode, Out, Parts, PartsMut};
use serde::{Deserialize, Serialize};

use crate::EngineError;
use crate::engine::{Buffers, Engine, GroupEntry, ParamEntry, read_only};

/// The state dict's format name and version, checked on load.
pub const FORMAT: &str = "lpmm.torch";
/// Bumped when the layout changes.
pub const VERSION: u32 = 1;

/// One parameter's metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Meta {
    format: String,
    version: u32,
    name: String,
    shape: Vec<usize>,
    group: usize,
    requested: ParamConfig,
    steps: u64,
    accumulations: u64,
    pending: bool,
    lr_rule: LrRule,
    rule_state: RuleState,
    /// Whether the parameter's values are the tensor's alone (lent, with no other region): they
    /// are not saved here, the model's state dict holds them.
    lent: bool,
    /// The optimizer's options and `step()` count (the same in every parameter's metadata).
    options: OptimizerOptions,
    global_steps: u64,
}

/// One parameter's saved state.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    /// Its metadata (JSON).
    pub meta: String,
    /// Its regions: key and little-endian bytes.
    pub regions: Vec<(String, Vec<u8>)>,
    /// Its step count (torch's `step` entry, for display).
    pub steps: u64,
}

fn key(slot: SlotKind, suffix: &str) -> String {
    format!("{}{suffix}", slot.name())
}

fn state_err(name: &str, reason: impl std::fmt::Display) -> EngineError {
    EngineError::State(format!("parameter {name}: {reason}"))
}

/// Every parameter's state; `buffers[i]` is parameter `i`'s tensor (needed for lent ones).
pub fn save(
    engine: &Engine,
    buffers: &mut [Option<HostValuesMut<'_>>],
) -> Result<Vec<Saved>, EngineError> {
    if engine.opt.status().mode == Mode::Eval {
        return Err(EngineError::State(
            "the parameters hold their evaluation point: call train() before state_dict()".into(),
        ));
    }
    let canonical = Parts::of(&engine.opt).canonical(Some(&mut Buffers { buffers }))?;
    let mut out = Vec::with_capacity(canonical.params.len());
    for (p, entry) in canonical.params.into_iter().zip(&engine.params) {
        // A lent parameter whose storage has other regions (a Kahan compensation, a split
        // remainder) keeps its values here too: those regions mean something only beside them,
        // and a load writes them into the tensor whether the model was loaded before or after.
        let omit = entry.lent && p.slots[SlotKind::Param as usize].regions.len() == 1;
        let mut regions = Vec::new();
        for (slot, host) in SlotKind::ALL.into_iter().zip(p.slots) {
            for r in host.regions {
                if omit && slot == SlotKind::Param && r.spec.suffix.is_empty() {
                    continue;
                }
                regions.push((key(slot, r.spec.suffix), r.bytes));
            }
        }
        let meta = Meta {
            format: FORMAT.into(),
            version: VERSION,
            name: p.name,
            shape: p.shape,
            group: p.group,
            requested: p.requested,
            steps: p.steps,
            accumulations: p.accumulations,
            pending: p.pending,
            lr_rule: p.lr_rule,
            rule_state: p.rule_state,
            lent: omit,
            options: canonical.options,
            global_steps: canonical.global_steps,
        };
        out.push(Saved {
            meta: serde_json::to_string(&meta)
                .map_err(|e| state_err(&entry.name, format!("metadata: {e}")))?,
            regions,
            steps: p.steps,
        });
    }
    Ok(out)
}

/// A new optimizer holding `saved` for `engine`'s parameters (`buffers[i]`: parameter `i`'s
/// tensor, every one needed), whose groups take `groups`' configurations. Everything is checked
/// and imported into the new optimizer before any held parameter's tensor is written; the caller
/// replaces its optimizer with the result. A lent parameter's tensor is written with its own
/// values only.
pub fn load(
    engine: &Engine,
    saved: &[Saved],
    buffers: &mut [Option<HostValuesMut<'_>>],
) -> Result<Engine, EngineError> {
    load_parts(&engine.params, &engine.groups, &engine.opt, saved, buffers)
}

/// [`load`] with the groups' configurations replaced by `groups` (torch's `load_state_dict`
/// restored the param groups' hyperparameters first).
pub fn load_with_groups(
    engine: &Engine,
    groups: &[GroupEntry],
    saved: &[Saved],
    buffers: &mut [Option<HostValuesMut<'_>>],
) -> Result<Engine, EngineError> {
    load_parts(&engine.params, groups, &engine.opt, saved, buffers)
}

/// [`load`] for parameters `params` in groups `groups`; `old` gives the options where no
/// parameter is saved, and the missing-gradient policy.
fn load_parts(
    params: &[ParamEntry],
    groups: &[GroupEntry],
    old: &Optimizer<Cpu>,
    saved: &[Saved],
    buffers: &mut [Option<HostValuesMut<'_>>],
) -> Result<Engine, EngineError> {
    if saved.len() != params.len() {
        return Err(EngineError::State(format!(
            "the state holds {} parameters, this optimizer {}",
            saved.len(),
            params.len()
        )));
    }
    let metas = saved
        .iter()
        .zip(params)
        .map(|(s, e)| {
            let m: Meta = serde_json::from_str(&s.meta)
                .map_err(|err| state_err(&e.name, format!("its lpmm metadata: {err}")))?;
            if m.format != FORMAT || m.version != VERSION {
                return Err(state_err(
                    &e.name,
                    format!(
                        "format {} version {}; this lpmm reads {FORMAT} version {VERSION}",
                        m.format, m.version
                    ),
                ));
            }
            if m.shape != e.shape {
                return Err(state_err(
                    &e.name,
                    format!(
                        "saved with shape {:?}, the tensor is {:?}",
                        m.shape, e.shape
                    ),
                ));
            }
            if m.group != e.group {
                return Err(state_err(
                    &e.name,
                    format!("saved in group {}, now in group {}", m.group, e.group),
                ));
            }
            // Another preset of the same rule (8-bit states into a 4-bit optimizer, f32 into
            // 8-bit) has the same hyperparameters: what tells it is the states' storage. The
            // parameter's own storage may differ (a model saved in bf16, loaded in f32).
            if let Some(g) = groups.get(e.group) {
                let own = g.config.with_param(m.requested.param);
                let saved = m.requested.with_hyper(g.config.hyper);
                if saved != own {
                    return Err(state_err(
                        &e.name,
                        format!(
                            "saved by another preset or configuration (states {}, {}, {}; gradient {}; quantized from {} elements), this optimizer's is {}, {}, {}; {}; {}",
                            saved.state1.describe(),
                            saved.state2.describe(),
                            saved.state3.describe(),
                            saved.grad.describe(),
                            saved.min_quantized_size,
                            own.state1.describe(),
                            own.state2.describe(),
                            own.state3.describe(),
                            own.grad.describe(),
                            own.min_quantized_size
                        ),
                    ));
                }
            }
            Ok(m)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let options = metas.first().map_or(old.status().options, |m| m.options);
    let global_steps = metas.first().map_or(0, |m| m.global_steps);
    let mut opt = Optimizer::new(options)?;
    opt.settings_mut().missing_gradient = old.status().settings.missing_gradient;
    for g in groups {
        opt.add_group(g.config)?;
    }
    PartsMut::of(&mut opt).set_steps(global_steps)?;
    let mut entries = Vec::with_capacity(params.len());
    let mut held = Vec::new();
    // Saved values of lent parameters, imported into a copy of the tensor and written into the
    // tensor only once everything has loaded.
    let mut written: Vec<(usize, Scratch)> = Vec::new();
    for (((s, m), e), buffer) in saved.iter().zip(&metas).zip(params).zip(buffers.iter_mut()) {
        let Some(buffer) = buffer else {
            return Err(state_err(&e.name, "its tensor was not given"));
        };
        // torch's param group holds the hyperparameters in force (the saved param groups, which
        // torch's `load_state_dict` restored): a scheduler may have changed them after the last
        // step.
        let group = groups
            .get(e.group)
            .ok_or_else(|| state_err(&e.name, format!("no group {}", e.group)))?;
        let requested = m.requested.with_hyper(group.config.hyper);
        let resolved = requested.resolve(e.numel, &e.shape);
        let lent = crate::config::lendable(resolved.param, e.dtype);
        if m.lent && !lent {
            return Err(state_err(
                &e.name,
                format!(
                    "saved as the tensor itself (its values are in the model's state dict); the tensor is {} now and cannot hold its {} storage",
                    e.dtype.name(),
                    resolved.param.describe()
                ),
            ));
        }
        let id = if lent {
            opt.add_lent_param(&e.name, &e.shape, read_only(buffer), e.group, requested)?
        } else {
            let init = vec![0f32; e.numel];
            opt.add_param_with(&e.name, &e.shape, &init, e.group, requested)?
        };
        PartsMut::of(&mut opt).restore(id, m.steps, m.accumulations, m.pending, m.lr_rule)?;
        PartsMut::of(&mut opt).restore_rule_state(id, m.rule_state)?;
        let mut used = 0;
        let mut scratch = Scratch::of(read_only(buffer));
        for slot in SlotKind::ALL {
            let lend = lent && slot == SlotKind::Param;
            let mut host =
                Parts::of(&opt).export_slot(id, slot, lend.then(|| read_only(buffer)))?;
            for r in &mut host.regions {
                let k = key(slot, r.spec.suffix);
                let found = s.regions.iter().find(|(name, _)| *name == k);
                let Some((_, bytes)) = found else {
                    if lend && m.lent && r.spec.suffix.is_empty() {
                        continue; // the tensor's own values
                    }
                    return Err(state_err(&e.name, format!("no {k} in its state")));
                };
                if bytes.len() != r.bytes.len() {
                    return Err(state_err(
                        &e.name,
                        format!(
                            "{k} holds {} bytes, {} expected",
                            bytes.len(),
                            r.bytes.len()
                        ),
                    ));
                }
                r.bytes.clone_from(bytes);
                used += 1;
            }
            PartsMut::of(&mut opt)
                .import_slot(id, slot, &host, lend.then(|| scratch.values()))
                .map_err(|err| state_err(&e.name, err))?;
        }
        if lent && !m.lent {
            written.push((id.index(), scratch));
        }
        if used != s.regions.len() {
            let known: Vec<&str> = s.regions.iter().map(|(k, _)| k.as_str()).collect();
            return Err(state_err(
                &e.name,
                format!(
                    "its state holds entries this configuration does not have ({})",
                    known.join(", ")
                ),
            ));
        }
        if !lent {
            held.push(id);
        }
        entries.push(ParamEntry {
            lent,
            id,
            ..e.clone()
        });
    }
    for (i, scratch) in written {
        if let Some(b) = &mut buffers[i] {
            scratch.write(b.reborrow());
        }
    }
    for id in held {
        if let Some(b) = &mut buffers[id.index()] {
            opt.read(id, SlotKind::Param, Out::Backend(b.reborrow()))?;
        }
    }
    Ok(Engine {
        opt,
        params: entries,
        groups: groups.to_vec(),
    })
}

/// A copy of a lent parameter's tensor that a load imports into.
enum Scratch {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
}

impl Scratch {
    fn of(values: HostValues<'_>) -> Self {
        match values {
            HostValues::F32(v) => Scratch::F32(v.to_vec()),
            HostValues::Bf16(v) => Scratch::Bf16(v.to_vec()),
        }
    }

    fn values(&mut self) -> HostValuesMut<'_> {
        match self {
            Scratch::F32(v) => HostValuesMut::F32(v),
            Scratch::Bf16(v) => HostValuesMut::Bf16(v),
        }
    }

    fn write(&self, out: HostValuesMut<'_>) {
        match (self, out) {
            (Scratch::F32(v), HostValuesMut::F32(o)) => o.copy_from_slice(v),
            (Scratch::Bf16(v), HostValuesMut::Bf16(o)) => o.copy_from_slice(v),
            _ => unreachable!("a copy of the same tensor"),
        }
    }
}

/// The engine with group `group`'s hyperparameters changed to `config`'s (a scheduler changed
/// more than the learning rate): its state moved to a new optimizer as a checkpoint would be.
pub fn reconfigure(
    engine: &Engine,
    group: usize,
    config: ParamConfig,
    buffers: &mut [Option<HostValuesMut<'_>>],
) -> Result<Engine, EngineError> {
    let old = engine
        .groups
        .get(group)
        .ok_or_else(|| EngineError::Config(format!("no parameter group {group}")))?;
    let (before, after) = (old.config.hyper.states(), config.hyper.states());
    if before != after {
        // The states a parameter holds are set at registration (Adafactor's first moment exists
        // only with a `beta1`): a change that adds or drops one has no state to move.
        let names = |s: [bool; 3]| {
            let held: Vec<String> = (0..3)
                .filter(|&k| s[k])
                .map(|k| format!("state{}", k + 1))
                .collect();
            if held.is_empty() {
                "none".into()
            } else {
                held.join(", ")
            }
        };
        return Err(EngineError::Config(format!(
            "group {group}'s new hyperparameters change which states it keeps ({} before, {} \
             after; e.g. Adafactor's beta1 between None and a number): a running optimizer \
             cannot add or drop a state; nothing was changed (put the old value back, or create \
             the optimizer again)",
            names(before),
            names(after)
        )));
    }
    let mut saved = save(engine, buffers)?;
    for (s, e) in saved.iter_mut().zip(&engine.params) {
        if e.group != group {
            continue;
        }
        let mut m: Meta = serde_json::from_str(&s.meta)
            .map_err(|err| state_err(&e.name, format!("metadata: {err}")))?;
        m.requested = m.requested.with_hyper(config.hyper);
        s.meta = serde_json::to_string(&m)
            .map_err(|err| state_err(&e.name, format!("metadata: {err}")))?;
    }
    let mut groups = engine.groups.clone();
    groups[group].config = config.with_grad(lpmm_optim::Storage::None);
    load_parts(&engine.params, &groups, &engine.opt, &saved, buffers)
}

#[cfg(test)]
mod tests {
    use lpmm_optim::{MissingGradientPolicy, OptimizerOptions};

    use super::*;
    use crate::config;

    fn engine(storage: &str, w: &mut [half::bf16]) -> Engine {
        let mut e = Engine::new(
            OptimizerOptions::default().with_seed(3),
            MissingGradientPolicy::Ignore,
        )
        .unwrap();
        e.add_group(config::preset("adamw_8bit", 1e-2).unwrap(), storage)
            .unwrap();
        e.add_param("w", &[64, 80], HostValuesMut::Bf16(w), 0)
            .unwrap();
        e
    }

    fn step(e: &mut Engine, w: &mut [half::bf16], k: usize) {
        let g: Vec<f32> = (0..w.len())
            .map(|i| (((i * 31 + k * 7) % 23) as f32 - 11.0) * 1e-3)
            .collect();
        let g: Vec<half::bf16> = g.iter().map(|&x| half::bf16::from_f32(x)).collect();
        e.step(
            &mut [Some(HostValuesMut::Bf16(w))],
            &[Some(HostValues::Bf16(&g))],
        )
        .unwrap();
    }

    /// Saved after 2 steps and loaded into a fresh engine (the tensor loaded after the state, as
    /// a model's state dict may be), 2 more steps give the bits of 4 uninterrupted ones; with a
    /// Kahan compensation, whose parameter values are saved beside it.
    #[test]
    fn saved_state_resumes_bit_for_bit() {
        for storage in ["auto", "bf16_kahan"] {
            let init = vec![half::bf16::from_f32(0.5); 64 * 80];
            let mut a_w = init.clone();
            let mut a = engine(storage, &mut a_w);
            for k in 0..4 {
                step(&mut a, &mut a_w, k);
            }
            let mut b_w = init.clone();
            let mut b = engine(storage, &mut b_w);
            for k in 0..2 {
                step(&mut b, &mut b_w, k);
            }
            let saved = save(&b, &mut [Some(HostValuesMut::Bf16(&mut b_w))]).unwrap();
            let keys: Vec<&str> = saved[0].regions.iter().map(|(k, _)| k.as_str()).collect();
            assert_eq!(keys.contains(&"param"), storage == "bf16_kahan", "{keys:?}");
            let mut c_w = init.clone();
            let c = engine(storage, &mut c_w);
            if storage == "auto" {
                c_w.clone_from(&b_w); // the model's state dict
            }
            let mut c = load(&c, &saved, &mut [Some(HostValuesMut::Bf16(&mut c_w))]).unwrap();
            assert_eq!(c_w, b_w);
            for k in 2..4 {
                step(&mut c, &mut c_w, k);
            }
            assert_eq!(c_w, a_w, "{storage}");
            // A state of another shape is refused and the engine is left as it was.
            let mut d_w = vec![half::bf16::ONE; 10];
            let mut d =
                Engine::new(OptimizerOptions::default(), MissingGradientPolicy::Ignore).unwrap();
            d.add_group(config::preset("adamw_8bit", 1e-2).unwrap(), storage)
                .unwrap();
            d.add_param("w", &[10], HostValuesMut::Bf16(&mut d_w), 0)
                .unwrap();
            let e = load(&d, &saved, &mut [Some(HostValuesMut::Bf16(&mut d_w))]).unwrap_err();
            assert!(e.to_string().contains("shape"), "{e}");
            assert!(d_w.iter().all(|x| *x == half::bf16::ONE));
        }
    }
}
