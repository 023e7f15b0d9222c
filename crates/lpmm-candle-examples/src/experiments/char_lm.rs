//! The character-level language-model task: its recipe, training run and evaluation.

use candle_core::{D, DType, Device, Result, Tensor};
use candle_nn::VarMap;
use serde::Serialize;

use lpmm_candle::LpmmOptimizer;

use super::run::{finish, train};
use super::{Budget, CharLm, LmShape, Preset, Rng, RunResult, Text, seeded_var_builder};

/// How the character-level language model is built and trained.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LmRecipe {
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
    /// Context length (tokens per training window).
    pub context: usize,
    /// Steps and sequences per step.
    pub budget: Budget,
    /// Peak learning rate of the AdamW presets.
    pub adamw_lr: f64,
    /// Peak learning rate of the SGD presets.
    pub sgd_lr: f64,
    /// Peak learning rate of Muon in the Muon hybrids (their AdamW part takes `adamw_lr`).
    pub muon_lr: f64,
    /// Steps of linear warmup to the peak.
    pub warmup: usize,
    /// The last step's learning rate as a fraction of the peak (cosine decay after the warmup).
    pub final_lr_fraction: f64,
    /// Initialisation scale (see [`CharLm::init`]); 0 keeps candle's initialisation (its
    /// embeddings N(0, 1), its linear weights Kaiming-normal N(0, 2 / fan-in)), drawn from the
    /// seed by [`seeded_var_builder`].
    pub init_std: f64,
    /// Validation windows of `context` tokens: `None` tiles the whole validation split (every
    /// token predicted once, the last window ending at the split's end); `Some(n)`: `n` windows
    /// spread evenly over it (for short runs).
    pub val_windows: Option<usize>,
}

impl LmRecipe {
    /// The comparison's default (the README's main command).
    pub fn default_run() -> LmRecipe {
        LmRecipe {
            width: 64,
            heads: 4,
            layers: 2,
            context: 64,
            budget: Budget {
                steps: 1000,
                batch: 32,
            },
            adamw_lr: 6e-3,
            sgd_lr: 0.3,
            muon_lr: 0.02,
            warmup: 50,
            final_lr_fraction: 0.01,
            init_std: 0.02,
            val_windows: None,
        }
    }

    /// The model's shape for a vocabulary of `vocab` tokens.
    pub fn shape(&self, vocab: usize) -> LmShape {
        LmShape {
            vocab,
            width: self.width,
            heads: self.heads,
            layers: self.layers,
            context: self.context,
        }
    }

    /// The learning rate at `step` for the peak `peak`: linear warmup over `warmup` steps, then
    /// cosine decay to `final_lr_fraction * peak` at the last step.
    pub fn lr(&self, peak: f64, step: usize) -> f64 {
        let steps = self.budget.steps;
        if step < self.warmup {
            return peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = steps.saturating_sub(self.warmup + 1).max(1);
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        let f = self.final_lr_fraction;
        peak * (f + (1.0 - f) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
    }
}

/// The validation loss and next-character accuracy of `model` on `tokens`, over windows of the
/// model's context (every prediction of every window counts): with `windows` `None`, windows
/// that tile `tokens` (the last one ending at its end); with `Some(n)`, `n` windows spread
/// evenly.
pub fn evaluate(model: &CharLm, tokens: &[u32], windows: Option<usize>) -> Result<(f64, f64)> {
    let t = model.shape.context;
    let dev = model.device.clone();
    if tokens.len() < t + 1 {
        return Err(candle_core::Error::Msg(format!(
            "{} tokens cannot hold a window of {t} and its next token",
            tokens.len()
        )));
    }
    let span = tokens.len() - t - 1; // the last start
    let count = windows.unwrap_or(span.div_ceil(t) + 1).clamp(1, span + 1);
    let starts = window_starts(count, span);
    let (mut loss_sum, mut correct) = (0.0f64, 0.0f64);
    for chunk in starts.chunks(64) {
        let (x, y) = windows_of(tokens, chunk, t, &dev)?;
        let logits = model
            .forward(&x)?
            .reshape((chunk.len() * t, model.shape.vocab))?;
        loss_sum += f64::from(candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()?)
            * chunk.len() as f64;
        correct += f64::from(
            logits
                .argmax(D::Minus1)?
                .eq(&y)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?,
        );
    }
    Ok((loss_sum / count as f64, correct / (count * t) as f64))
}

/// `count` window starts spread evenly over `0..=span` (the first at 0, the last at `span`).
pub(crate) fn window_starts(count: usize, span: usize) -> Vec<usize> {
    (0..count)
        .map(|k| {
            if count == 1 {
                0
            } else {
                k * span / (count - 1)
            }
        })
        .collect()
}

/// Inputs `(starts, t)` and next-token targets `(starts * t)` for windows at `starts`.
pub(crate) fn windows_of(
    tokens: &[u32],
    starts: &[usize],
    t: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let x: Vec<u32> = starts
        .iter()
        .flat_map(|&s| tokens[s..s + t].iter().copied())
        .collect();
    let y: Vec<u32> = starts
        .iter()
        .flat_map(|&s| tokens[s + 1..s + t + 1].iter().copied())
        .collect();
    Ok((
        Tensor::from_vec(x, (starts.len(), t), dev)?,
        Tensor::from_vec(y, starts.len() * t, dev)?,
    ))
}

/// Tokens sampled after training (at temperature 0.8, after `context / 2` tokens of the
/// validation split from its first line start).
const SAMPLE_TOKENS: usize = 320;

/// Trains the character-level transformer on `text` with `preset` and `recipe`;
/// `progress(step)` after every step. The data order is the same for every preset and seed.
pub fn run_char_lm(
    text: &Text,
    preset: &Preset,
    seed: u64,
    recipe: &LmRecipe,
    progress: impl FnMut(usize),
) -> Result<RunResult> {
    let dev = Device::Cpu;
    let shape = recipe.shape(text.vocab.len());
    let t = shape.context;
    if text.train.len() < t + 2 || text.val.len() < t + 2 {
        return Err(candle_core::Error::Msg(format!(
            "the text is too short for windows of {t} tokens"
        )));
    }
    let varmap = VarMap::new();
    let model = CharLm::new(shape, seeded_var_builder(&varmap, seed, &dev), &dev)?;
    if recipe.init_std > 0.0 {
        model.init(&varmap, seed, recipe.init_std)?;
    }
    let lr = if preset.sgd {
        recipe.sgd_lr
    } else {
        recipe.adamw_lr
    };
    let config = preset.lpmm_config(lr, recipe.muon_lr);
    // The schedule's peak is the rate the preset configures (Lion's and CAME's are a fraction
    // of the task's); a Muon hybrid's matrices keep their rate's ratio to it.
    let lr = config.param.hyper.lr();
    let mut opt = LpmmOptimizer::from_varmap(&varmap, config)?;
    let budget = recipe.budget;
    let mut data_rng = Rng::new(4321); // the same data order for every preset and seed
    let starts = || {
        (0..budget.batch)
            .map(|_| data_rng.below(text.train.len() - t - 1))
            .collect()
    };
    let loss_of = |micro: &[usize]| {
        let (x, y) = windows_of(&text.train, micro, t, &dev)?;
        let logits = model.forward(&x)?.reshape((micro.len() * t, shape.vocab))?;
        candle_nn::loss::cross_entropy(&logits, &y)
    };
    let lr_at = |step| recipe.lr(lr, step);
    let training = train(
        &mut opt,
        preset,
        budget.steps,
        lr_at,
        starts,
        loss_of,
        progress,
    )?;
    let (val_loss, accuracy) = evaluate(&model, &text.val, recipe.val_windows)?;
    // The prompt: half a context from the validation split, from its first line start.
    let from = (1..text.val.len() - t / 2)
        .find(|&i| text.vocab[text.val[i - 1] as usize] == b'\n')
        .unwrap_or(0);
    let prompt = &text.val[from..from + t / 2];
    let mut sample_rng = Rng::new(777);
    let sample = model.sample(prompt, SAMPLE_TOKENS, 0.8, &mut sample_rng)?;
    let mut r = finish(&text.name, preset, seed, &opt, training, val_loss, accuracy)?;
    r.sample = format!("{}|{}", text.decode(prompt), text.decode(&sample));
    Ok(r)
}
