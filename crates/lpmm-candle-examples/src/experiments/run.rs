//! One run of a preset, and the digits task: the step with micro-batches, the learning-rate
//! schedule, the loss curve and the measurements a run reports.

use std::time::Instant;

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Optimizer as _, VarMap};
use serde::Serialize;

use lpmm_candle::LpmmOptimizer;
use lpmm_optim::Storage;

use super::{Digits, Mlp, Preset, Rng, seeded_var_builder};

/// One run's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// "digits", or the language model's text (`shakespeare`, or the file's name).
    pub task: String,
    /// The preset's name.
    pub preset: String,
    /// The preset it is compared with.
    pub reference: String,
    /// The initialisation seed.
    pub seed: u64,
    /// Parameters trained.
    pub params: usize,
    /// Model memory (parameters in their storage — a `Var` lent to lpmm as the parameter
    /// included —, gradient accumulators, states), bytes per parameter.
    pub bytes_per_param: f64,
    /// Mean training loss over the last 10% of steps.
    pub final_train_loss: f64,
    /// Validation loss (cross-entropy, nats).
    pub val_loss: f64,
    /// Validation accuracy (digits: classification; language model: next character), in [0, 1].
    pub val_accuracy: f64,
    /// Wall time per optimizer step, milliseconds.
    pub ms_per_step: f64,
    /// Training loss every `curve_every` steps.
    pub curve: Vec<f64>,
    /// Steps between curve points.
    pub curve_every: usize,
    /// Language model: the prompt, `|`, and a continuation sampled after training (empty for
    /// digits).
    pub sample: String,
}

/// How long a task trains.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Budget {
    /// Optimizer steps.
    pub steps: usize,
    /// Examples (digits) or sequences (language model) per step.
    pub batch: usize,
}

/// The learning rate at `step` of `steps`: cosine decay from `peak` to 1% of it. Every preset
/// follows the same schedule; the small late rates are where round-to-nearest storage stalls.
pub fn schedule(peak: f64, step: usize, steps: usize) -> f64 {
    let progress = step as f64 / steps.max(1) as f64;
    peak * (0.01 + 0.99 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

/// One optimizer step on `batch`: split into the preset's micro-batches (never more than there
/// are items), each micro-batch's mean loss scaled by 1/count and its gradients accumulated in
/// lpmm's accumulator, then one step. Returns the batch's mean loss.
fn train_step(
    opt: &mut LpmmOptimizer,
    preset: &Preset,
    batch: &[usize],
    loss_of: impl Fn(&[usize]) -> Result<Tensor>,
) -> Result<f64> {
    let size = batch
        .len()
        .div_ceil(preset.micro_batches.clamp(1, batch.len().max(1)))
        .max(1);
    let count = batch.len().div_ceil(size) as f64;
    // A preset without a gradient accumulator (AdaLomo's: each gradient released as it is
    // stepped) takes its one batch's gradients straight from the backward pass.
    let released = preset.hybrid.is_none() && (preset.config)(1e-3).grad == Storage::None;
    if released && count == 1.0 {
        let loss = loss_of(batch)?;
        let mean = f64::from(loss.to_scalar::<f32>()?);
        drop(opt.step_grads(&mut loss.backward()?)?);
        return Ok(mean);
    }
    let mut mean = 0.0;
    for micro in batch.chunks(size) {
        let loss = loss_of(micro)?;
        mean += f64::from(loss.to_scalar::<f32>()?) / count;
        opt.accumulate((loss / count)?.backward()?)?;
    }
    opt.apply()?;
    Ok(mean)
}

fn record(curve: &mut Vec<f64>, losses: &[f64], every: usize) {
    if losses.len().is_multiple_of(every) {
        let tail = &losses[losses.len() - every..];
        curve.push(tail.iter().sum::<f64>() / every as f64);
    }
}

fn final_loss(losses: &[f64]) -> f64 {
    let n = (losses.len() / 10).max(1);
    losses[losses.len() - n..].iter().sum::<f64>() / n as f64
}

/// What training gave: each step's loss, the loss curve and the time per step.
pub(super) struct Training {
    losses: Vec<f64>,
    curve: Vec<f64>,
    every: usize,
    ms_per_step: f64,
}

/// Trains as both tasks do: `steps` steps, each at the learning rate `lr_at(step)` (unless the
/// preset is schedule-free) on the items `batch()` draws ([`train_step`]), the loss curve
/// recorded and `progress(step)` called after it; then, for a schedule-free preset, the `Var`s
/// moved to the optimizer's evaluation point.
pub(super) fn train(
    opt: &mut LpmmOptimizer,
    preset: &Preset,
    steps: usize,
    lr_at: impl Fn(usize) -> f64,
    mut batch: impl FnMut() -> Vec<usize>,
    loss_of: impl Fn(&[usize]) -> Result<Tensor>,
    mut progress: impl FnMut(usize),
) -> Result<Training> {
    let (mut losses, mut curve, every) = (Vec::new(), Vec::new(), (steps / 50).max(1));
    let start = Instant::now();
    for step in 0..steps {
        if !preset.schedule_free {
            opt.set_learning_rate(lr_at(step));
        }
        let items = batch();
        losses.push(train_step(opt, preset, &items, &loss_of)?);
        record(&mut curve, &losses, every);
        progress(step + 1);
    }
    let ms_per_step = start.elapsed().as_secs_f64() * 1e3 / steps as f64;
    if preset.schedule_free {
        opt.eval()?;
    }
    Ok(Training {
        losses,
        curve,
        every,
        ms_per_step,
    })
}

/// Trains the digits MLP with `preset`; `progress(step)` is called after every step.
pub fn run_digits(
    d: &Digits,
    preset: &Preset,
    seed: u64,
    budget: Budget,
    progress: impl FnMut(usize),
) -> Result<RunResult> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(seeded_var_builder(&varmap, seed, &dev))?;
    let lr = if preset.sgd { 0.05 } else { 2e-3 };
    // A Muon hybrid's matrices at 10/3 of the AdamW rate, the language model's ratio (0.02
    // against 6e-3).
    let config = preset.lpmm_config(lr, lr * 10.0 / 3.0);
    // The schedule's peak is the rate the preset configures (Lion's and CAME's are a fraction
    // of the task's); a Muon hybrid's matrices keep their rate's ratio to it.
    let lr = config.param.hyper.lr();
    let mut opt = LpmmOptimizer::from_varmap(&varmap, config)?;
    let n = d.train_y.len();
    let mut order: Vec<usize> = (0..n).collect();
    let mut data_rng = Rng::new(1234); // the same data order for every preset and seed
    let mut at = n;
    let batch = || {
        let mut batch = Vec::with_capacity(budget.batch);
        while batch.len() < budget.batch {
            if at == n {
                for i in (1..n).rev() {
                    order.swap(i, data_rng.below(i + 1));
                }
                at = 0;
            }
            batch.push(order[at]);
            at += 1;
        }
        batch
    };
    let loss_of = |micro: &[usize]| {
        let xs: Vec<f32> = micro
            .iter()
            .flat_map(|&i| d.train_x[64 * i..64 * i + 64].iter().copied())
            .collect();
        let ys: Vec<u32> = micro.iter().map(|&i| d.train_y[i]).collect();
        let x = Tensor::from_vec(xs, (micro.len(), 64), &dev)?;
        let y = Tensor::from_vec(ys, micro.len(), &dev)?;
        candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)
    };
    let lr_at = |step| schedule(lr, step, budget.steps);
    let training = train(
        &mut opt,
        preset,
        budget.steps,
        lr_at,
        batch,
        loss_of,
        progress,
    )?;
    let x = Tensor::from_vec(d.val_x.clone(), (d.val_y.len(), 64), &dev)?;
    let y = Tensor::from_vec(d.val_y.clone(), d.val_y.len(), &dev)?;
    let logits = model.forward(&x)?;
    let val_loss = f64::from(candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()?);
    let correct = logits
        .argmax(D::Minus1)?
        .eq(&y)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    finish(
        "digits",
        preset,
        seed,
        &opt,
        training,
        val_loss,
        f64::from(correct) / d.val_y.len() as f64,
    )
}

/// A run's measurements from its training and validation.
pub(super) fn finish(
    task: &str,
    preset: &Preset,
    seed: u64,
    opt: &LpmmOptimizer,
    training: Training,
    val_loss: f64,
    val_accuracy: f64,
) -> Result<RunResult> {
    let Training {
        losses,
        curve,
        every,
        ms_per_step,
    } = training;
    let report = opt.memory_report();
    Ok(RunResult {
        task: task.to_string(),
        preset: preset.name.to_string(),
        reference: preset.reference.to_string(),
        seed,
        params: report.numel(),
        // The whole model memory: what lpmm holds and the `Var`s lent to it as its parameters.
        bytes_per_param: (report.total() + opt.lent_bytes()) as f64 / report.numel().max(1) as f64,
        final_train_loss: final_loss(&losses),
        val_loss,
        val_accuracy,
        ms_per_step,
        curve,
        curve_every: every,
        sample: String::new(),
    })
}
