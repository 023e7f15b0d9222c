//! What a careless or hostile candle user did to lpmm-candle (each case once a defect, found by
//! trying it from outside the repository): a checkpoint saved under a learning-rate schedule,
//! a write into a Var lpmm keeps a copy of, the same Var twice, a rate set after a rejected one.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer as _;
use lpmm_candle::{LpmmConfig, LpmmOptimizer};
use lpmm_optim::{OptimizerOptions, presets};

fn config(lr: f64) -> LpmmConfig {
    LpmmConfig::from(
        presets::adamw_8bit_bf16_sr(lr)
            .with_min_quantized_size(0)
            .build(),
    )
    .with_options(OptimizerOptions::default().with_seed(5))
}

/// A bf16 matrix Var (the preset's storage dtype: stepped in place).
fn var(dtype: DType) -> candle_core::Result<Var> {
    let values: Vec<f32> = (0..96)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 200.0)
        .collect();
    Var::from_tensor(&Tensor::from_vec(values, (8, 12), &Device::Cpu)?.to_dtype(dtype)?)
}

fn loss(w: &Var, step: usize) -> candle_core::Result<Tensor> {
    let x: Vec<f32> = (0..12).map(|i| ((i + step) % 5) as f32 - 2.0).collect();
    let x = Tensor::from_vec(x, (12, 1), &Device::Cpu)?.to_dtype(w.dtype())?;
    w.as_tensor()
        .matmul(&x)?
        .to_dtype(DType::F32)?
        .sqr()?
        .sum_all()
}

fn bits(w: &Var) -> candle_core::Result<Vec<u32>> {
    let v = w
        .as_tensor()
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    Ok(v.into_iter().map(f32::to_bits).collect())
}

#[test]
fn a_checkpoint_saved_under_a_schedule_resumes_with_its_learning_rate() -> candle_core::Result<()> {
    // set_learning_rate is how candle schedules a rate: the checkpoint holds the rate of its
    // last step, which differs from a fresh optimizer's. It was refused ("its parameter groups
    // differ"), with a remedy lpmm-candle does not offer.
    let dir = std::env::temp_dir().join(format!("lpmm-candle-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("opt.safetensors");
    let rate = |step: usize| 1e-2 * (1.0 - step as f64 / 10.0);
    let w = var(DType::BF16)?;
    let mut opt = LpmmOptimizer::new(vec![w.clone()], config(1e-2))?;
    for step in 0..3 {
        opt.set_learning_rate(rate(step));
        opt.backward_step(&loss(&w, step)?)?;
    }
    opt.save(&path)?;
    let w2 = var(DType::BF16)?;
    let mut resumed = LpmmOptimizer::new(vec![w2.clone()], config(1e-2))?;
    resumed.load(&path)?;
    assert_eq!(resumed.learning_rate(), rate(2), "the saved rate");
    for step in 3..6 {
        for o in [&mut opt, &mut resumed] {
            o.set_learning_rate(rate(step));
        }
        opt.backward_step(&loss(&w, step)?)?;
        resumed.backward_step(&loss(&w2, step)?)?;
    }
    assert_eq!(bits(&w)?, bits(&w2)?);
    // Another configuration than the rate is still refused, and changes nothing.
    let w3 = var(DType::BF16)?;
    let other = LpmmConfig::from(
        presets::adamw_8bit_bf16_sr(1e-2)
            .with_min_quantized_size(0)
            .weight_decay(0.5)
            .build(),
    )
    .with_options(OptimizerOptions::default().with_seed(5));
    let mut refused = LpmmOptimizer::new(vec![w3.clone()], other)?;
    let before = bits(&w3)?;
    assert!(refused.load(&path).is_err());
    assert_eq!(bits(&w3)?, before);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn a_write_into_a_copied_var_is_refused_at_the_step_not_lost() -> candle_core::Result<()> {
    // An f32 Var under a bf16 preset: lpmm holds the value and sets the Var after each step. A
    // write by the user (VarMap::load after creating the optimizer, as fine-tuning does) was
    // overwritten by lpmm's old copy at the next step.
    let w = var(DType::F32)?;
    let mut opt = LpmmOptimizer::new(vec![w.clone()], config(0.0))?;
    opt.backward_step(&loss(&w, 0)?)?; // no write: steps
    let pretrained = Tensor::full(0.25f32, (8, 12), &Device::Cpu)?;
    w.set(&pretrained)?;
    let err = opt.backward_step(&loss(&w, 1)?).unwrap_err().to_string();
    assert!(err.contains("was written since lpmm's last step"), "{err}");
    assert_eq!(bits(&w)?, vec![0.25f32.to_bits(); 96], "the write is kept");
    // A Var stepped in place takes the write.
    let v = var(DType::BF16)?;
    let mut lent = LpmmOptimizer::new(vec![v.clone()], config(0.0))?;
    v.set(&pretrained.to_dtype(DType::BF16)?)?;
    lent.backward_step(&loss(&v, 0)?)?;
    assert_eq!(bits(&v)?, vec![0.25f32.to_bits(); 96]);
    Ok(())
}

#[test]
fn the_same_var_twice_is_refused_before_anything_is_registered() -> candle_core::Result<()> {
    // It was taken: one path stepped it twice a step, the other refused the step mid-way.
    let w = var(DType::BF16)?;
    let err = LpmmOptimizer::new(vec![w.clone(), w.clone()], config(1e-2)).unwrap_err();
    assert!(err.to_string().contains("given twice"), "{err}");
    let mut opt = LpmmOptimizer::new(vec![w.clone()], config(1e-2))?;
    let err = opt.add_vars(vec![("again".into(), w.clone())]).unwrap_err();
    assert!(err.to_string().contains("given twice"), "{err}");
    let before = bits(&w)?;
    opt.backward_step(&loss(&w, 0)?)?;
    let once = bits(&w)?;
    assert_ne!(once, before);
    // One step, as a lone registration steps it.
    let w2 = var(DType::BF16)?;
    let mut single = LpmmOptimizer::new(vec![w2.clone()], config(1e-2))?;
    single.backward_step(&loss(&w2, 0)?)?;
    assert_eq!(bits(&w2)?, once);
    Ok(())
}

#[test]
fn a_valid_rate_set_after_a_rejected_one_steps() -> candle_core::Result<()> {
    // The rejection of NaN outlived a later valid set_learning_rate.
    let w = var(DType::BF16)?;
    let mut opt = LpmmOptimizer::new(vec![w.clone()], config(1e-2))?;
    opt.set_learning_rate(f64::NAN);
    opt.set_learning_rate(0.2);
    assert_eq!(opt.learning_rate(), 0.2);
    let before = bits(&w)?;
    opt.backward_step(&loss(&w, 0)?)?;
    assert_ne!(bits(&w)?, before);
    // A rejected rate alone is still refused at the step, which changes nothing.
    opt.set_learning_rate(f64::INFINITY);
    let before = bits(&w)?;
    assert!(opt.backward_step(&loss(&w, 1)?).is_err());
    assert_eq!(bits(&w)?, before);
    Ok(())
}

#[test]
fn a_var_without_elements_is_left_out_not_refused() -> candle_core::Result<()> {
    // One [0, 4] Var (an unused prefix, say) made from_varmap fail for the whole model.
    let varmap = candle_nn::VarMap::new();
    let dev = Device::Cpu;
    varmap.get(
        (0, 4),
        "unused_prefix",
        candle_nn::Init::Const(0.0),
        DType::BF16,
        &dev,
    )?;
    let w = varmap.get((8, 12), "w", candle_nn::Init::Const(0.5), DType::BF16, &dev)?;
    let mut opt = LpmmOptimizer::from_varmap(&varmap, config(1e-2))?;
    let before = w.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let x = Tensor::ones((12, 1), DType::BF16, &dev)?;
    opt.backward_step(&w.matmul(&x)?.to_dtype(DType::F32)?.sqr()?.sum_all()?)?;
    assert_ne!(
        w.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?,
        before
    );
    Ok(())
}
