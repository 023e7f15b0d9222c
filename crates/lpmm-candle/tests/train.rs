//! Training with candle through lpmm.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Linear, Module, Optimizer as _, VarBuilder, VarMap};
use lpmm_candle::{LpmmConfig, LpmmOptimizer};
use lpmm_optim::{Storage, presets};

/// A linear regression y = 3x - 2 (candle's own optimizer example, with lpmm).
#[test]
fn linear_regression_converges_with_every_preset() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let xs: Vec<f32> = (0..64).map(|i| i as f32 / 32.0 - 1.0).collect();
    let x = Tensor::from_vec(xs.clone(), (64, 1), &dev)?;
    let y = Tensor::from_vec(
        xs.iter().map(|v| 3.0 * v - 2.0).collect::<Vec<f32>>(),
        (64, 1),
        &dev,
    )?;
    for (name, config) in [
        ("adamw f32", presets::adamw_f32(0.1).build()),
        (
            "adamw 8-bit bf16 SR",
            presets::adamw_8bit_bf16_sr(0.1).build(),
        ),
        ("adamw 4-bit split", presets::adamw_4bit_split(0.1).build()),
        ("lpmm sgdm", presets::lpmm_sgdm(0.1, 0.9).build()),
    ] {
        // Quantize even these tiny tensors, so the quantized paths are what trains.
        let config = config.with_min_quantized_size(0);
        let w = Var::new(&[[0.0f32]], &dev)?;
        let b = Var::new(&[0.0f32], &dev)?;
        let mut opt = LpmmOptimizer::new(vec![w.clone(), b.clone()], LpmmConfig::from(config))?;
        let model = Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
        let loss0 = model
            .forward(&x)?
            .sub(&y)?
            .sqr()?
            .mean_all()?
            .to_scalar::<f32>()?;
        for _ in 0..300 {
            let loss = model.forward(&x)?.sub(&y)?.sqr()?.mean_all()?;
            opt.backward_step(&loss)?;
        }
        let loss = model
            .forward(&x)?
            .sub(&y)?
            .sqr()?
            .mean_all()?
            .to_scalar::<f32>()?;
        let (w, b) = (
            w.as_tensor().to_vec2::<f32>()?[0][0],
            b.as_tensor().to_vec1::<f32>()?[0],
        );
        assert!(
            loss < 1e-2 * loss0,
            "{name}: loss {loss0} -> {loss}, w {w}, b {b}"
        );
        assert!(
            (w - 3.0).abs() < 0.15 && (b + 2.0).abs() < 0.15,
            "{name}: w {w}, b {b}"
        );
    }
    Ok(())
}

#[test]
fn vars_hold_exactly_what_lpmm_stores() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let layer = candle_nn::linear(16, 8, vb.pp("l"))?;
    let config = presets::adamw_f32(1e-2)
        .with_param(Storage::Bf16(lpmm_optim::StoreRounding::Stochastic))
        .build();
    let mut opt = LpmmOptimizer::new(varmap.all_vars(), LpmmConfig::from(config))?;
    // After registration and after a step, every Var value is a bf16 value.
    let check = |opt: &LpmmOptimizer| -> candle_core::Result<()> {
        for v in varmap.all_vars() {
            for x in v.as_tensor().flatten_all()?.to_vec1::<f32>()? {
                assert_eq!(x.to_bits() & 0xFFFF, 0, "{x} is not a bf16 value");
            }
        }
        assert_eq!(opt.candle_bytes(), 4 * (16 * 8 + 8));
        Ok(())
    };
    check(&opt)?;
    let x = Tensor::ones((4, 16), DType::F32, &dev)?;
    let loss = layer.forward(&x)?.sqr()?.mean_all()?;
    opt.backward_step(&loss)?;
    check(&opt)?;
    // The memory report counts bf16 parameters.
    assert_eq!(opt.memory_report().slot_totals()[0], 2 * (16 * 8 + 8));
    Ok(())
}

#[test]
fn learning_rate_changes_apply_and_bad_ones_are_reported() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[1.0f32, 2.0], &dev)?;
    let mut opt = LpmmOptimizer::new(
        vec![w.clone()],
        LpmmConfig::from(presets::sgdm_f32(0.1, 0.0).build()),
    )?;
    assert_eq!(opt.learning_rate(), 0.1);
    opt.set_learning_rate(0.5);
    assert_eq!(opt.learning_rate(), 0.5);
    let loss = w.as_tensor().sum_all()?; // gradient 1 for each element
    opt.backward_step(&loss)?;
    assert_eq!(w.as_tensor().to_vec1::<f32>()?, vec![0.5, 1.5]);
    opt.set_learning_rate(f64::NAN);
    let loss = w.as_tensor().sum_all()?;
    assert!(
        opt.backward_step(&loss).is_err(),
        "a rejected learning rate is reported, not ignored"
    );
    Ok(())
}
