//! lpmm-candle as a user meets it: Vars stepped in place, the same bits in every process,
//! resume in a fresh process, gradient release, skipped steps, parameter groups, lpmm-held
//! layers, and the bad inputs a careless user sends.
//!
//! The cross-process tests re-run this test binary as a child (`LPMM_CANDLE_CHILD` names what
//! the child does) and compare what it prints with what this process computed.

use lpmm_optim::SlotKind;
use std::process::Command;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Init, Optimizer as _, VarBuilder, VarMap};
use lpmm_candle::{LpmmConfig, LpmmOptimizer};
use lpmm_optim::{Adam, Hyper, OptimizerOptions, ParamConfig, presets};

const CHILD: &str = "LPMM_CANDLE_CHILD";
const CHECKPOINT: &str = "LPMM_CANDLE_CHECKPOINT";

/// A three-layer MLP whose Vars are created through a VarMap (HashMap order), initialised from a
/// fixed seed-free pattern so every process starts from the same values.
struct Mlp {
    varmap: VarMap,
    layers: Vec<candle_nn::Linear>,
}

fn mlp(dtype: DType) -> candle_core::Result<Mlp> {
    let dev = Device::Cpu;
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &dev);
    let dims = [12, 32, 32, 4];
    let mut layers = Vec::new();
    for (k, w) in dims.windows(2).enumerate() {
        let (i, o) = (w[0], w[1]);
        // Deterministic values: candle's random init would differ between processes.
        let weight = vb.get_with_hints((o, i), &format!("l{k}.weight"), Init::Const(0.0))?;
        let bias = vb.get_with_hints(o, &format!("l{k}.bias"), Init::Const(0.0))?;
        let values: Vec<f32> = (0..o * i)
            .map(|j| (((j * 7919 + k * 31) % 1000) as f32 / 1000.0 - 0.5) / (i as f32).sqrt())
            .collect();
        // bf16 values in either dtype, so bf16 and f32 models start from the same values.
        let init = Tensor::from_vec(values, (o, i), &dev)?
            .to_dtype(DType::BF16)?
            .to_dtype(dtype)?;
        varmap.set_one(format!("l{k}.weight"), init)?;
        // Distinct biases: `LpmmOptimizer::new` orders unnamed Vars by shape and values, and
        // Vars that tie cannot be told apart (a warning says so).
        let bias_init: Vec<f32> = (0..o).map(|j| (j + k) as f32 / 64.0).collect();
        let bias_init = Tensor::from_vec(bias_init, o, &dev)?
            .to_dtype(DType::BF16)?
            .to_dtype(dtype)?;
        varmap.set_one(format!("l{k}.bias"), bias_init)?;
        layers.push(candle_nn::Linear::new(weight, Some(bias)));
    }
    Ok(Mlp { varmap, layers })
}

impl Mlp {
    fn loss(&self, step: usize) -> candle_core::Result<Tensor> {
        let dev = Device::Cpu;
        let n = 16;
        let x: Vec<f32> = (0..n * 12)
            .map(|j| (((j + 13 * step) * 2654435761usize % 997) as f32 / 997.0) - 0.5)
            .collect();
        let y: Vec<f32> = (0..n * 4)
            .map(|j| (((j + 7 * step) * 40503 % 101) as f32 / 101.0) - 0.5)
            .collect();
        let dtype = self.layers[0].weight().dtype();
        let mut h = Tensor::from_vec(x, (n, 12), &dev)?.to_dtype(dtype)?;
        for (k, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if k + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        let y = Tensor::from_vec(y, (n, 4), &dev)?;
        h.to_dtype(DType::F32)?.sub(&y)?.sqr()?.mean_all()
    }

    /// Every Var's bits, in name order.
    fn bits(&self) -> candle_core::Result<Vec<u32>> {
        let data = self.varmap.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        let mut out = Vec::new();
        for name in names {
            let t = data[name].as_tensor().flatten_all()?.to_dtype(DType::F32)?;
            out.extend(t.to_vec1::<f32>()?.into_iter().map(f32::to_bits));
        }
        Ok(out)
    }
}

fn sr_config() -> LpmmConfig {
    LpmmConfig::from(
        presets::adamw_8bit_bf16_sr(1e-2)
            .with_min_quantized_size(0)
            .build(),
    )
    .with_options(OptimizerOptions::default().with_seed(7))
}

fn train(
    model: &Mlp,
    opt: &mut LpmmOptimizer,
    steps: std::ops::Range<usize>,
) -> candle_core::Result<()> {
    for step in steps {
        opt.backward_step(&model.loss(step)?)?;
    }
    Ok(())
}

fn digest(bits: &[u32]) -> String {
    // FNV-1a over the bits: a short line to print and compare.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bits {
        for byte in b.to_le_bytes() {
            h = (h ^ byte as u64).wrapping_mul(0x100000001b3);
        }
    }
    format!("{h:016x}/{}", bits.len())
}

/// Runs this test binary's `test` as a child with `env`, returns the digest it printed.
fn child(test: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.split_once("DIGEST ").map(|(_, d)| d.trim()))
        .unwrap_or_else(|| panic!("no digest in: {stdout}"))
        .to_string()
}

#[test]
fn the_same_seed_gives_the_same_bits_in_every_process() -> candle_core::Result<()> {
    // Named by VarMap path, or (candle's `Optimizer::new`) given `all_vars()` in hash order.
    let run = || -> candle_core::Result<String> {
        let model = mlp(DType::BF16)?;
        let mut opt = LpmmOptimizer::from_varmap(&model.varmap, sr_config())?;
        train(&model, &mut opt, 0..6)?;
        let named = digest(&model.bits()?);
        let model = mlp(DType::BF16)?;
        let mut opt = LpmmOptimizer::new(model.varmap.all_vars(), sr_config())?;
        train(&model, &mut opt, 0..6)?;
        Ok(format!("{named} {}", digest(&model.bits()?)))
    };
    if std::env::var(CHILD).as_deref() == Ok("determinism") {
        println!("DIGEST {}", run()?);
        return Ok(());
    }
    let here = run()?;
    // Two other processes (each with its own HashMap seeds, so its own VarMap order).
    for _ in 0..2 {
        let there = child(
            "the_same_seed_gives_the_same_bits_in_every_process",
            &[(CHILD, "determinism")],
        );
        assert_eq!(
            here, there,
            "stochastic rounding gave other bits in another process"
        );
    }
    // And a different seed gives different bits (the comparison can fail).
    let model = mlp(DType::BF16)?;
    let config = sr_config().with_options(OptimizerOptions::default().with_seed(8));
    let mut opt = LpmmOptimizer::from_varmap(&model.varmap, config)?;
    train(&model, &mut opt, 0..6)?;
    assert!(!here.starts_with(&digest(&model.bits()?)));
    Ok(())
}

#[test]
fn a_checkpoint_resumes_bit_exactly_in_a_fresh_process() -> candle_core::Result<()> {
    if std::env::var(CHILD).as_deref() == Ok("resume") {
        let path = std::env::var(CHECKPOINT).unwrap();
        // A fresh process: a new model with the initial values, the checkpoint loaded into it.
        let model = mlp(DType::BF16)?;
        let mut opt = LpmmOptimizer::from_varmap(&model.varmap, sr_config())?;
        opt.load(&path)?;
        train(&model, &mut opt, 4..8)?;
        println!("DIGEST {}", digest(&model.bits()?));
        return Ok(());
    }
    let dir = std::env::temp_dir().join(format!("lpmm-candle-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("opt.safetensors");
    let model = mlp(DType::BF16)?;
    let mut opt = LpmmOptimizer::from_varmap(&model.varmap, sr_config())?;
    train(&model, &mut opt, 0..4)?;
    opt.save(&path)?;
    train(&model, &mut opt, 4..8)?;
    let uninterrupted = digest(&model.bits()?);
    let resumed = child(
        "a_checkpoint_resumes_bit_exactly_in_a_fresh_process",
        &[(CHILD, "resume"), (CHECKPOINT, path.to_str().unwrap())],
    );
    assert_eq!(uninterrupted, resumed);

    // A checkpoint of another model is refused with an error, and changes nothing.
    let other = mlp(DType::F32)?;
    let mut wrong =
        LpmmOptimizer::from_varmap(&other.varmap, LpmmConfig::from(presets::adamw_f32(1e-2)))?;
    let before = other.bits()?;
    assert!(wrong.load(&path).is_err());
    assert_eq!(before, other.bits()?);
    // So is a missing or corrupt file.
    assert!(opt.load(dir.join("missing")).is_err());
    std::fs::write(dir.join("junk"), b"not a checkpoint").unwrap();
    assert!(opt.load(dir.join("junk")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn vars_of_the_storage_dtype_are_stepped_in_place_with_the_bits_of_a_copy()
-> candle_core::Result<()> {
    // bf16 Vars with bf16 storage: lent, no copy. f32 Vars with the same storage: lpmm holds a
    // bf16 copy and sets the Vars after each step. Both must give the same bits.
    let lent_model = mlp(DType::BF16)?;
    let lent = LpmmOptimizer::from_varmap(&lent_model.varmap, sr_config())?;
    let copy_model = mlp(DType::F32)?;
    let copy = LpmmOptimizer::from_varmap(&copy_model.varmap, sr_config())?;
    assert!(lent.copied_vars().is_empty());
    assert_eq!(copy.copied_vars().len(), 6);
    let numel = 12 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4;
    // lpmm holds no parameter bytes for lent Vars, and no gradient accumulator when stepping
    // from candle's gradients.
    assert_eq!(lent.memory_report().slot_totals()[0], 0);
    assert_eq!(copy.memory_report().slot_totals()[0], 2 * numel);
    assert_eq!(lent.candle_bytes(), 2 * numel);
    assert_eq!(copy.candle_bytes(), 4 * numel);
    // The f32 model computes its forward pass in f32, so its gradients differ: feed both the
    // bf16 model's exact gradients (as f32 for the f32 model) through accumulate + apply.
    drop((lent, copy, lent_model, copy_model));
    let model_a = mlp(DType::BF16)?;
    let mut a = LpmmOptimizer::from_varmap(&model_a.varmap, sr_config())?;
    let model_b = mlp(DType::F32)?;
    let mut b = LpmmOptimizer::from_varmap(&model_b.varmap, sr_config())?;
    for step in 0..4 {
        let grads = model_a.loss(step)?.backward()?;
        // The same gradient values, as f32, keyed by model_b's Vars.
        let mut store = model_b.loss(step)?.backward()?;
        for (name, var_a) in model_a.varmap.data().lock().unwrap().iter() {
            let var_b = model_b.varmap.data().lock().unwrap()[name].clone();
            let g = grads.get(var_a.as_tensor()).unwrap().to_dtype(DType::F32)?;
            store.insert(var_b.as_tensor(), g);
        }
        a.accumulate(grads)?;
        a.apply()?;
        b.accumulate(store)?;
        b.apply()?;
    }
    assert_eq!(model_a.bits()?, model_b.bits()?);
    assert!(a.copied_vars().is_empty());
    Ok(())
}

#[test]
fn released_gradients_train_with_no_accumulator() -> candle_core::Result<()> {
    let model = mlp(DType::BF16)?;
    let config = LpmmConfig::from(
        presets::adamw_4bit_bf16_sr_released(1e-2)
            .with_min_quantized_size(0)
            .build(),
    );
    let mut opt = LpmmOptimizer::from_varmap(&model.varmap, config)?;
    assert!(opt.copied_vars().is_empty());
    let first = model.loss(0)?.to_scalar::<f32>()?;
    for _ in 0..60 {
        opt.backward_step(&model.loss(0)?)?;
    }
    let last = model.loss(0)?.to_scalar::<f32>()?;
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    let report = opt.memory_report();
    assert_eq!(report.slot_totals()[0], 0, "the Vars are the parameters");
    assert_eq!(report.slot_totals()[1], 0, "no gradient memory");
    // Accumulating into a configuration without an accumulator is an error, not a silent drop.
    assert!(opt.accumulate(model.loss(0)?.backward()?).is_err());
    Ok(())
}

#[test]
fn a_non_finite_loss_skips_the_step_and_says_so() -> candle_core::Result<()> {
    let model = mlp(DType::F32)?;
    let mut opt =
        LpmmOptimizer::from_varmap(&model.varmap, LpmmConfig::from(presets::adamw_8bit(1e-2)))?;
    opt.backward_step(&model.loss(0)?)?;
    assert!(!opt.last_report().unwrap().skipped);
    let before = model.bits()?;
    let nan = (model.loss(1)? * f64::NAN)?;
    opt.backward_step(&nan)?;
    let report = opt.last_report().unwrap();
    assert!(report.skipped);
    assert_eq!(report.non_finite.len(), 6);
    assert_eq!(before, model.bits()?, "a skipped step changes nothing");
    // Training goes on afterwards.
    opt.backward_step(&model.loss(2)?)?;
    assert!(!opt.last_report().unwrap().skipped);
    assert_ne!(before, model.bits()?);
    Ok(())
}

#[test]
fn parameter_groups_by_name() -> candle_core::Result<()> {
    // Weight decay for weights, none for biases: the same gradient moves both by the learning
    // rate (Adam's first step), and only the decayed one also shrinks by lr * wd.
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let w = varmap.get(2, "w", Init::Const(1.0), DType::F32, &dev)?;
    let b = varmap.get(2, "b.bias", Init::Const(1.0), DType::F32, &dev)?;
    let decay = ParamConfig::f32(Hyper::Adam(Adam::adamw(0.1).weight_decay(0.5)));
    let none = ParamConfig::f32(Hyper::Adam(Adam::adamw(0.1).weight_decay(0.0)));
    let config = LpmmConfig::from(decay).with_group("*bias", none);
    let mut opt = LpmmOptimizer::from_varmap(&varmap, config)?;
    let loss = (w.sum_all()? + b.sum_all()?)?;
    opt.backward_step(&loss)?;
    for (v, expect) in [(b.to_vec1::<f32>()?, 0.9), (w.to_vec1::<f32>()?, 0.85)] {
        for x in v {
            assert!((x - expect).abs() < 1e-6, "{x} != {expect}");
        }
    }
    // The learning rate moves every group together.
    opt.set_learning_rate(0.0);
    let before = w.to_vec1::<f32>()?;
    let loss = w.sum_all()?;
    opt.backward_step(&loss)?;
    assert_eq!(before, w.to_vec1::<f32>()?);
    Ok(())
}

/// An lpmm layer against candle's own: the same output, the same input gradient, and (with
/// f32 SGD at learning rate 1, no momentum) a step that subtracts exactly candle's gradient.
#[test]
fn lpmm_layers_match_candles_layers() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (i, o, n) = (6, 5, 4);
    let wv: Vec<f32> = (0..o * i).map(|j| (j as f32 * 0.37).sin()).collect();
    let bv: Vec<f32> = (0..o).map(|j| (j as f32 * 0.71).cos()).collect();
    let xv: Vec<f32> = (0..n * i).map(|j| (j as f32 * 0.13).cos()).collect();
    let w0 = Tensor::from_vec(wv, (o, i), &dev)?;
    let b0 = Tensor::from_vec(bv, o, &dev)?;
    let sgd = LpmmConfig::from(presets::sgdm_f32(1.0, 0.0));

    // candle's Linear over Vars.
    let (w, b) = (Var::from_tensor(&w0)?, Var::from_tensor(&b0)?);
    let x = Var::from_tensor(&Tensor::from_vec(xv.clone(), (n, i), &dev)?)?;
    let reference = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
    let y_ref = reference.forward(x.as_tensor())?;
    let loss_ref = (y_ref.sqr()?.sum_all()? * 0.5)?;
    let g_ref = loss_ref.backward()?;

    // The lpmm layer.
    let opt_held = LpmmOptimizer::empty(sgd.clone())?;
    let layer = opt_held.linear("fc", &w0, Some(&b0))?;
    let x2 = Var::from_tensor(&Tensor::from_vec(xv, (n, i), &dev)?)?;
    let y = layer.forward(x2.as_tensor())?;
    assert_eq!(y.to_vec2::<f32>()?, y_ref.to_vec2::<f32>()?);
    let mut opt_held = opt_held;
    let loss = (y.sqr()?.sum_all()? * 0.5)?;
    let mut grads = loss.backward()?;
    let dx = grads.get(x2.as_tensor()).unwrap().to_vec2::<f32>()?;
    let dx_ref = g_ref.get(x.as_tensor()).unwrap().to_vec2::<f32>()?;
    for (a, r) in dx.iter().flatten().zip(dx_ref.iter().flatten()) {
        assert!((a - r).abs() <= 1e-5 * r.abs().max(1.0), "dx {a} vs {r}");
    }
    opt_held.step_grads(&mut grads)?;
    let numel = o * i;
    let stepped = opt_held.with_optimizer(|opt| {
        let mut wv = vec![0f32; numel];
        opt.read(
            opt.param("fc.weight").map(|p| p.id).unwrap(),
            SlotKind::Param,
            &mut wv,
        )
        .unwrap();
        wv
    })?;
    let expect = (w0 - g_ref.get(w.as_tensor()).unwrap())?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for (a, r) in stepped.iter().zip(&expect) {
        assert!((a - r).abs() <= 1e-5 * r.abs().max(1.0), "w {a} vs {r}");
    }
    // No Var holds the weight: lpmm does (f32 here), and candle holds none of it.
    assert_eq!(opt_held.candle_bytes(), 0);
    assert_eq!(opt_held.memory_report().slot_totals()[0], 4 * (o * i + o));

    // Embedding: rows by id, the table's gradient scattered (a repeated id adds up).
    let table = Tensor::from_vec(
        (0..5 * 3).map(|j| j as f32).collect::<Vec<f32>>(),
        (5, 3),
        &dev,
    )?;
    let mut opt_e = LpmmOptimizer::empty(sgd)?;
    let emb = opt_e.embedding("emb", &table)?;
    let ids = Tensor::new(&[[1u32, 3], [1, 0]], &dev)?;
    let rows = emb.forward(&ids)?;
    let reference = candle_nn::Embedding::new(table.clone(), 3).forward(&ids)?;
    assert_eq!(rows.to_vec3::<f32>()?, reference.to_vec3::<f32>()?);
    let mut grads = rows.sum_all()?.backward()?;
    opt_e.step_grads(&mut grads)?;
    let after = opt_e.with_optimizer(|o| {
        let mut v = vec![0f32; 15];
        o.read(
            o.param("emb.weight").map(|p| p.id).unwrap(),
            SlotKind::Param,
            &mut v,
        )
        .unwrap();
        v
    })?;
    let counts = [1.0, 2.0, 0.0, 1.0, 0.0];
    for (r, &c) in counts.iter().enumerate() {
        for k in 0..3 {
            assert_eq!(after[r * 3 + k], (r * 3 + k) as f32 - c, "row {r}");
        }
    }
    Ok(())
}

#[test]
fn lpmm_sgdm_trains_through_lpmm_layers() -> candle_core::Result<()> {
    // LPMM-SGDM keeps 8-bit parameters: no Var can hold them, the layers do.
    let dev = Device::Cpu;
    let opt = LpmmOptimizer::empty(LpmmConfig::from(presets::lpmm_sgdm(0.05, 0.9)))?;
    let w1: Vec<f32> = (0..32 * 12)
        .map(|j| ((j * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.5)
        .collect();
    let w2: Vec<f32> = (0..4 * 32)
        .map(|j| ((j * 104729 % 1000) as f32 / 1000.0 - 0.5) * 0.3)
        .collect();
    let l1 = opt.linear(
        "l1",
        &Tensor::from_vec(w1, (32, 12), &dev)?,
        Some(&Tensor::zeros(32, DType::F32, &dev)?),
    )?;
    let l2 = opt.linear("l2", &Tensor::from_vec(w2, (4, 32), &dev)?, None)?;
    let mut opt = opt;
    let x: Vec<f32> = (0..64 * 12)
        .map(|j| ((j * 31 % 97) as f32 / 97.0) - 0.5)
        .collect();
    let x = Tensor::from_vec(x, (64, 12), &dev)?;
    let y = x.narrow(1, 0, 4)?.affine(2.0, 0.1)?;
    let loss = |l1: &lpmm_candle::nn::QLinear, l2: &lpmm_candle::nn::QLinear| {
        l2.forward(&l1.forward(&x)?.relu()?)?
            .sub(&y)?
            .sqr()?
            .mean_all()
    };
    let first = loss(&l1, &l2)?.to_scalar::<f32>()?;
    for _ in 0..150 {
        opt.backward_step(&loss(&l1, &l2)?)?;
    }
    let last = loss(&l1, &l2)?.to_scalar::<f32>()?;
    assert!(last < 0.3 * first, "loss {first} -> {last}");
    // Everything lpmm holds is 8-bit: 1 byte per element and a 4-byte scale per 64 for
    // parameter, accumulator and momentum.
    let numel = 32 * 12 + 32 + 4 * 32;
    let bytes = opt.memory_report().total();
    assert!(
        bytes < 3 * numel + 3 * 4 * numel / 32,
        "{bytes} bytes for {numel} parameters"
    );
    assert_eq!(opt.candle_bytes(), 0);
    Ok(())
}

#[test]
fn bad_inputs_are_errors() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let opt = LpmmOptimizer::empty(LpmmConfig::from(presets::adamw_f32(1e-3)))?;
    let w = Tensor::zeros((3, 4), DType::F32, &dev)?;
    // A bias of the wrong length; a weight that is not a matrix.
    assert!(
        opt.linear("a", &w, Some(&Tensor::zeros(4, DType::F32, &dev)?))
            .is_err()
    );
    assert!(
        opt.linear("b", &Tensor::zeros(4, DType::F32, &dev)?, None)
            .is_err()
    );
    assert!(
        opt.embedding("c", &Tensor::zeros(4, DType::F32, &dev)?)
            .is_err()
    );
    // The same name twice.
    opt.linear("d", &w, None)?;
    assert!(opt.linear("d", &w, None).is_err());
    // A non-finite initial value is refused (a typed lpmm error inside candle's error).
    let nan = Tensor::new(&[f32::NAN, 1.0], &dev)?;
    let mut varmap = VarMap::new();
    varmap.get(2, "nan", Init::Const(0.0), DType::F32, &dev)?;
    varmap.set_one("nan", nan)?;
    assert!(
        LpmmOptimizer::from_varmap(&varmap, LpmmConfig::from(presets::adamw_8bit_bf16_sr(1e-3)))
            .is_err()
    );
    // An invalid configuration.
    let bad = ParamConfig::f32(Hyper::adamw(-1.0));
    assert!(LpmmOptimizer::empty(LpmmConfig::from(bad)).is_err());
    // Integer Vars are not trainable and are left alone.
    let varmap = VarMap::new();
    varmap.get(3, "ids", Init::Const(0.0), DType::U32, &dev)?;
    let opt = LpmmOptimizer::from_varmap(&varmap, LpmmConfig::from(presets::adamw_f32(1e-3)))?;
    assert_eq!(opt.candle_bytes(), 0);
    Ok(())
}
