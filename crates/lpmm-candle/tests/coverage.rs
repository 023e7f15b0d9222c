//! "Does my model train?": a model built with candle-nn's fused operators that have no backward
//! pass (`LayerNorm`, `RmsNorm`, `softmax_last_dim`) leaves parameters without a gradient, and
//! lpmm-candle reports exactly which, refuses the step under the error policy with nothing
//! changed, and warns on stderr where no `tracing` subscriber is installed. The same models with
//! `lpmm_candle::ops` report full coverage; frozen `Var`s and lpmm's layers raise nothing.
//!
//! The stderr test re-runs this test binary as a child (`LPMM_CANDLE_CHILD`), a process with no
//! `tracing` subscriber, as a user's program built like the README's snippet.

use lpmm_optim::Parts;
use std::process::Command;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer as _, VarBuilder, VarMap};
use lpmm_candle::{LpmmConfig, LpmmOptimizer};
use lpmm_optim::{MissingGradientPolicy, SlotKind, presets};

const CHILD: &str = "LPMM_CANDLE_CHILD";

/// Which operator sits in the model.
#[derive(Debug, Clone, Copy)]
enum Op {
    LayerNorm,
    RmsNorm,
    Softmax,
}

const OPS: [Op; 3] = [Op::LayerNorm, Op::RmsNorm, Op::Softmax];

impl Op {
    /// The `Var`s candle-nn's operator leaves without a gradient, in registration (name) order.
    fn cut(self) -> &'static [&'static str] {
        match self {
            Op::LayerNorm => &["a.bias", "a.weight", "ln.bias", "ln.weight"],
            Op::RmsNorm => &["a.bias", "a.weight", "rms.weight"],
            Op::Softmax => &["k.bias", "k.weight", "q.bias", "q.weight"],
        }
    }
}

/// A small model around `op`: candle-nn's fused operator, or (`lpmm_ops`) lpmm-candle's
/// differentiable one. LayerNorm / RmsNorm: `b(norm(a(x)))`; softmax: `b(softmax(q kᵀ) v)`.
struct Model {
    varmap: VarMap,
    op: Op,
    lpmm_ops: bool,
    layers: Vec<(String, candle_nn::Linear)>,
    ln: Option<candle_nn::LayerNorm>,
    rms: Option<candle_nn::RmsNorm>,
}

fn model(op: Op, lpmm_ops: bool) -> candle_core::Result<Model> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let names: &[&str] = match op {
        Op::Softmax => &["q", "k", "v", "b"],
        _ => &["a", "b"],
    };
    let mut layers = Vec::new();
    for &name in names {
        let (inp, out) = if name == "b" { (16, 4) } else { (8, 16) };
        layers.push((name.to_string(), candle_nn::linear(inp, out, vb.pp(name))?));
    }
    let ln = matches!(op, Op::LayerNorm)
        .then(|| candle_nn::layer_norm(16, 1e-5, vb.pp("ln")))
        .transpose()?;
    let rms = matches!(op, Op::RmsNorm)
        .then(|| candle_nn::rms_norm(16, 1e-5, vb.pp("rms")))
        .transpose()?;
    Ok(Model {
        varmap,
        op,
        lpmm_ops,
        layers,
        ln,
        rms,
    })
}

impl Model {
    fn layer(&self, name: &str) -> &candle_nn::Linear {
        &self
            .layers
            .iter()
            .find(|(n, _)| n == name)
            .expect("a layer")
            .1
    }

    fn loss(&self, step: usize) -> candle_core::Result<Tensor> {
        let n = 6;
        let x: Vec<f32> = (0..n * 8)
            .map(|j| ((j * 37 + step * 11) % 19) as f32 / 19.0 - 0.5)
            .collect();
        let x = Tensor::from_vec(x, (n, 8), &Device::Cpu)?;
        let h = match self.op {
            Op::LayerNorm | Op::RmsNorm => {
                let h = self.layer("a").forward(&x)?;
                match (self.op, self.lpmm_ops) {
                    (Op::LayerNorm, false) => self.ln.as_ref().unwrap().forward(&h)?,
                    (Op::LayerNorm, true) => {
                        let ln: lpmm_candle::ops::LayerNorm = self.ln.clone().unwrap().into();
                        ln.forward(&h)?
                    }
                    (_, false) => self.rms.as_ref().unwrap().forward(&h)?,
                    (_, true) => {
                        let rms: lpmm_candle::ops::RmsNorm = self.rms.clone().unwrap().into();
                        rms.forward(&h)?
                    }
                }
            }
            Op::Softmax => {
                let q = self.layer("q").forward(&x)?;
                let k = self.layer("k").forward(&x)?;
                let v = self.layer("v").forward(&x)?;
                let scores = q.matmul(&k.t()?)?;
                let att = if self.lpmm_ops {
                    lpmm_candle::ops::softmax_last_dim(&scores)?
                } else {
                    candle_nn::ops::softmax_last_dim(&scores)?
                };
                att.matmul(&v)?
            }
        };
        let y = self.layer("b").forward(&h)?;
        let target = Tensor::ones((n, 4), DType::F32, &Device::Cpu)?;
        y.sub(&target)?.sqr()?.mean_all()
    }

    /// Every Var's values, in name order.
    fn values(&self) -> candle_core::Result<Vec<(String, Vec<u32>)>> {
        let data = self.varmap.data().lock().unwrap();
        let mut out: Vec<(String, Vec<u32>)> = data
            .iter()
            .map(|(k, v)| {
                let bits = v
                    .as_tensor()
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .into_iter()
                    .map(f32::to_bits)
                    .collect();
                Ok((k.clone(), bits))
            })
            .collect::<candle_core::Result<_>>()?;
        out.sort();
        Ok(out)
    }

    fn var_count(&self) -> usize {
        self.varmap.all_vars().len()
    }
}

fn config(policy: MissingGradientPolicy) -> LpmmConfig {
    LpmmConfig::from(presets::adamw_8bit(1e-2).with_min_quantized_size(0))
        .with_missing_gradient(policy)
}

/// The optimizer's states and counters: with the Vars, what "nothing changed" compares.
fn states(opt: &LpmmOptimizer, m: &Model) -> candle_core::Result<Vec<String>> {
    let names: Vec<String> = m.values()?.into_iter().map(|(n, _)| n).collect();
    opt.with_optimizer(|o| {
        let mut out = vec![format!("steps {}", o.status().steps)];
        for name in &names {
            let id = o.param(name).map(|p| p.id).unwrap();
            for slot in [SlotKind::State1, SlotKind::State2] {
                out.push(format!(
                    "{name} {:?}",
                    Parts::of(o).export_slot(id, slot, None).unwrap()
                ));
            }
            out.push(format!(
                "{name} {}",
                o.param(id).map(|p| p.received_gradient).unwrap()
            ));
        }
        out
    })
}

#[test]
fn candle_nn_operators_leave_exactly_these_parameters_without_a_gradient() -> candle_core::Result<()>
{
    for op in OPS {
        for lpmm_ops in [false, true] {
            let m = model(op, lpmm_ops)?;
            let mut opt =
                LpmmOptimizer::from_varmap(&m.varmap, config(MissingGradientPolicy::Ignore))?;
            for step in 0..3 {
                let report = opt.step_grads(&mut m.loss(step)?.backward()?)?;
                let missing = &report.missing_gradients;
                let want: &[&str] = if lpmm_ops { &[] } else { op.cut() };
                assert_eq!(missing.names, want, "{op:?}, lpmm ops {lpmm_ops}");
                assert_eq!(missing.count, want.len());
                assert_eq!(missing.checked, m.var_count(), "{op:?}");
                assert_eq!(report.updated, m.var_count() - want.len(), "{op:?}");
            }
            // Accumulated micro-batches are checked the same way.
            opt.accumulate(m.loss(3)?.backward()?)?;
            opt.accumulate(m.loss(4)?.backward()?)?;
            let report = opt.apply()?;
            let want: &[&str] = if lpmm_ops { &[] } else { op.cut() };
            assert_eq!(report.missing_gradients.names, want, "{op:?} accumulated");
        }
    }
    Ok(())
}

#[test]
fn the_error_policy_refuses_the_step_naming_them_and_changes_nothing() -> candle_core::Result<()> {
    for op in OPS {
        let m = model(op, false)?;
        let mut opt = LpmmOptimizer::from_varmap(&m.varmap, config(MissingGradientPolicy::Error))?;
        let (vars, before) = (m.values()?, states(&opt, &m)?);
        let mut grads: GradStore = m.loss(0)?.backward()?;
        let e = opt.step_grads(&mut grads).unwrap_err().to_string();
        let names = op.cut().join(", ");
        assert!(
            e.contains(&format!(
                "{} of {} parameters received no gradient: {names}",
                op.cut().len(),
                m.var_count()
            )) && e.contains("nothing changed")
                && e.contains("candle_nn::RmsNorm")
                && e.contains("LpmmConfig::with_frozen"),
            "{op:?}: {e}"
        );
        assert_eq!(m.values()?, vars, "{op:?}: a Var moved");
        assert_eq!(
            states(&opt, &m)?,
            before,
            "{op:?}: a state or counter moved"
        );
        assert!(opt.last_report().is_none());
        // No gradient was consumed: the store still holds every one candle computed.
        let held = m
            .varmap
            .all_vars()
            .iter()
            .filter(|v| grads.get(v.as_tensor()).is_some())
            .count();
        assert_eq!(held, m.var_count() - op.cut().len(), "{op:?}");
        // candle-nn's trait methods refuse it too.
        assert!(opt.backward_step(&m.loss(1)?).is_err());
        assert_eq!(m.values()?, vars, "{op:?}: a Var moved");
    }
    // With lpmm-candle's operators the same policy steps.
    for op in OPS {
        let m = model(op, true)?;
        let mut opt = LpmmOptimizer::from_varmap(&m.varmap, config(MissingGradientPolicy::Error))?;
        let vars = m.values()?;
        opt.backward_step(&m.loss(0)?)?;
        assert_ne!(m.values()?, vars, "{op:?}");
    }
    Ok(())
}

#[test]
fn frozen_vars_and_lpmm_layers_raise_nothing() -> candle_core::Result<()> {
    let m = model(Op::RmsNorm, true)?;
    // A Var the forward pass does not use (a pretrained table kept fixed, say).
    let table = m.varmap.get(
        (3, 16),
        "frozen.table",
        candle_nn::Init::Const(0.5),
        DType::F32,
        &Device::Cpu,
    )?;
    let strict = config(MissingGradientPolicy::Error);
    let mut opt = LpmmOptimizer::from_varmap(&m.varmap, strict.clone())?;
    let e = opt.backward_step(&m.loss(0)?).unwrap_err().to_string();
    assert!(e.contains("received no gradient: frozen.table"), "{e}");
    let mut opt = LpmmOptimizer::from_varmap(&m.varmap, strict.clone().with_frozen("frozen.*"))?;
    for step in 0..2 {
        let report = opt.step_grads(&mut m.loss(step)?.backward()?)?;
        assert!(report.missing_gradients.is_empty());
        assert_eq!(report.missing_gradients.checked, m.var_count() - 1);
    }
    assert!(!opt.copied_vars().contains(&"frozen.table".to_string()));
    assert_eq!(table.flatten_all()?.to_vec1::<f32>()?, vec![0.5; 48]);

    // lpmm's layers: gradients accumulated in the backward pass, or released steps taken there.
    for config in [
        presets::adamw_8bit(1e-2).with_min_quantized_size(0).build(),
        presets::adamw_4bit_bf16_sr_released(1e-2)
            .with_min_quantized_size(0)
            .build(),
    ] {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let head = candle_nn::linear(16, 4, vb.pp("head"))?;
        let opt_config =
            LpmmConfig::from(config).with_missing_gradient(MissingGradientPolicy::Error);
        let mut opt = LpmmOptimizer::from_varmap(&varmap, opt_config)?;
        let w = Tensor::ones((16, 8), DType::F32, &Device::Cpu)?.affine(0.01, 0.0)?;
        let b = Tensor::zeros(16, DType::F32, &Device::Cpu)?;
        let layer = opt.linear("l", &w, Some(&b))?;
        for step in 0..2 {
            let x = Tensor::ones((5, 8), DType::F32, &Device::Cpu)?.affine(1.0, step as f64)?;
            let loss = head
                .forward(&layer.forward(&x)?.relu()?)?
                .sqr()?
                .mean_all()?;
            let report = opt.step_grads(&mut loss.backward()?)?;
            assert!(report.missing_gradients.is_empty(), "{report:?}");
            assert_eq!(report.missing_gradients.checked, 4);
        }
    }
    Ok(())
}

/// What the child prints after its steps, so the parent knows it ran to the end.
const DONE: &str = "CHILD DONE";

#[test]
fn the_warning_reaches_stderr_without_a_tracing_subscriber() -> candle_core::Result<()> {
    if std::env::var(CHILD).as_deref() == Ok("warn") {
        // A user's program: the README's swap, the default policy, no tracing subscriber.
        let m = model(Op::RmsNorm, false)?;
        let mut opt =
            LpmmOptimizer::from_varmap(&m.varmap, LpmmConfig::from(presets::adamw_8bit(1e-2)))?;
        for step in 0..3 {
            opt.backward_step(&m.loss(step)?)?;
        }
        println!("{DONE}");
        return Ok(());
    }
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([
            "the_warning_reaches_stderr_without_a_tracing_subscriber",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "warn")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains(DONE),
        "child failed: {stdout}\n{stderr}"
    );
    // Once for three steps that miss the same set, naming them, the causes and the remedies.
    assert_eq!(stderr.matches("lpmm warning:").count(), 1, "{stderr}");
    for text in [
        "lpmm warning: step 1: 3 of 5 parameters received no gradient: a.bias, a.weight, rms.weight",
        "candle_nn::RmsNorm",
        "candle_nn::ops::softmax_last_dim",
        "lpmm_candle::ops::",
        "Does my model train?",
        "detached",
        "LpmmConfig::with_frozen",
        "LpmmConfig::with_missing_gradient(MissingGradientPolicy::Ignore)",
    ] {
        assert!(stderr.contains(text), "{text:?} not in: {stderr}");
    }
    Ok(())
}
