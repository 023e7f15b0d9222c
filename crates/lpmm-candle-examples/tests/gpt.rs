//! The GPT example's model and arms at a toy size on the CPU: every arm trains (its loss falls)
//! with every parameter receiving a gradient, the parameter count matches the shape's, and
//! lpmm's `adamw_f32` follows candle-nn's AdamW from the same initialisation.

use candle_core::Device;
use lpmm_candle_examples::experiments;
use lpmm_candle_examples::gpt::{self, GptShape, Recipe};

fn toy() -> Recipe {
    Recipe {
        shape: GptShape {
            layers: 1,
            width: 32,
            heads: 2,
            context: 16,
        },
        batch: 4,
        steps: 12,
        warmup: 2,
        adamw_lr: 1e-2,
        val_windows: 4,
        ..Recipe::tiny_quality()
    }
}

#[test]
fn every_arm_trains_the_toy_gpt() -> candle_core::Result<()> {
    let text = experiments::shakespeare()?;
    let (train, val) = gpt::byte_split(&text);
    let recipe = toy();
    let mut runs = Vec::new();
    for arm in gpt::arms() {
        let run = gpt::train(&arm, &recipe, 0, &Device::Cpu, &train, &val, |_, _| {})?;
        assert_eq!(run.params, recipe.shape.params(), "{}", arm.key);
        assert!(run.cuda.is_none());
        let (val_loss, acc) = (run.val_loss.unwrap(), run.val_accuracy.unwrap());
        assert!(
            val_loss.is_finite() && (0.0..=1.0).contains(&acc),
            "{run:?}"
        );
        assert!(
            run.final_train_loss < run.first_loss - 0.5,
            "{}: loss {} -> {}",
            arm.key,
            run.first_loss,
            run.final_train_loss
        );
        runs.push(run);
    }
    // The same weights at the start: the first loss of every arm with f32 weights is the same.
    let (candle, lpmm_f32) = (&runs[0], &runs[1]);
    assert_eq!(candle.first_loss, lpmm_f32.first_loss);
    // candle-nn's AdamW and lpmm's adamw_f32: the same update up to rounding.
    for (a, b) in candle.curve.iter().zip(&lpmm_f32.curve) {
        assert!((a - b).abs() < 1e-3 * a.abs(), "{a} vs {b}");
    }
    Ok(())
}

#[test]
fn the_sizes_are_the_documented_ones() {
    // Recipe::memory's 302.8M and Recipe::quality's 10.9M (the docs and the example's help).
    assert_eq!(Recipe::memory().shape.params(), 302_826_496);
    assert_eq!(Recipe::quality().shape.params(), 10_916_736);
}
