//! The optimizer: parameters registered with their configuration, micro-batch gradient
//! accumulation, the fused step, gradient release, learning-rate control, clipping and the
//! non-finite-gradient policy. The CPU backend defines the semantics.

use lpmm_quant::RandomStream;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::config::{ParamConfig, Storage};
use crate::error::OptimError;
use crate::rule::Rule;
use crate::slot::{CHUNK, Slot, SlotData};
use lpmm_quant::Rank1;

/// Elements per piece: large tensors are cut into pieces of this size (a multiple of every block
/// size) so the step can run pieces of one tensor, and many small tensors, in parallel without
/// per-tensor overhead.
pub(crate) const PIECE: usize = 1 << 20;

/// Which slot a random stream is for (part of the stream's tensor id).
#[derive(Debug, Clone, Copy)]
pub(crate) enum SlotKind {
    Param = 0,
    Grad = 1,
    State1 = 2,
    State2 = 3,
}

/// A registered parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub(crate) usize);

impl ParamId {
    /// The parameter's index in registration order.
    pub fn index(self) -> usize {
        self.0
    }
}

/// What to do with a gradient that holds NaN or ±Inf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum NonFinitePolicy {
    /// Skip the whole step (no parameter or state changes), consume the gradients, and report
    /// it (like AMP's GradScaler). Costs one read of the gradients before the step.
    #[default]
    SkipStep,
    /// Leave every element whose gradient is not finite unchanged (parameter and states) and update
    /// the others (bitsandbytes skips such elements too, but zeroes their states).
    SkipElements,
}

/// Settings that apply to the whole optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptimizerOptions {
    /// Seed of every stochastic-rounding stream.
    pub seed: u64,
    /// Clip the global L2 norm of all gradients to this value before the step (`None`: off).
    pub max_grad_norm: Option<f64>,
    /// What to do with non-finite gradients.
    pub non_finite: NonFinitePolicy,
}

impl Default for OptimizerOptions {
    fn default() -> Self {
        OptimizerOptions {
            seed: 0,
            max_grad_norm: None,
            non_finite: NonFinitePolicy::SkipStep,
        }
    }
}

/// What a step did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepReport {
    /// Parameters that were updated.
    pub updated: usize,
    /// Whether the whole step was skipped for a non-finite gradient.
    pub skipped: bool,
    /// Parameters whose gradient held a non-finite value.
    pub non_finite: Vec<ParamId>,
    /// The global gradient norm, when it was computed (clipping or the skip policy).
    pub grad_norm: Option<f64>,
}

/// Per-parameter bookkeeping.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub name: String,
    pub shape: Vec<usize>,
    pub numel: usize,
    /// The configuration asked for.
    pub requested: ParamConfig,
    /// The configuration in force (minimum-size policy applied).
    pub config: ParamConfig,
    pub group: usize,
    /// Steps taken by this parameter.
    pub steps: u64,
    /// `accumulate` calls so far (the gradient slot's random-stream counter).
    pub accumulations: u64,
    /// Whether the accumulator holds gradients not yet consumed.
    pub pending: bool,
    /// The pieces of this parameter: `first_piece ..first_piece + pieces`.
    pub first_piece: usize,
    pub pieces: usize,
    /// This step's rule (refreshed before each fused pass).
    pub rule: Rule,
    /// Whether this parameter takes part in the current fused pass.
    pub active: bool,
    /// Tensor-wide scales of a rank-1 second moment.
    pub rank1: Option<Rank1State>,
    /// False during an optimizer-accumulation pass: states are updated, the parameter is not.
    pub update_param: bool,
}

/// The per-dimension maxima of a rank-1 normalized second moment: `scales` decode the stored
/// codes; `next` receives the maxima of the updated state during a step, then the two swap.
#[derive(Debug, Clone)]
pub(crate) struct Rank1State {
    pub q: Rank1<'static>,
    pub scales: Vec<f32>,
    pub next: Vec<f32>,
}

/// A contiguous range of one parameter with its slots.
#[derive(Debug, Clone)]
pub(crate) struct Piece {
    pub param_index: usize,
    pub offset: usize,
    pub len: usize,
    pub param: Slot,
    pub grad: Slot,
    pub state1: Slot,
    pub state2: Slot,
    /// Results of the last pass, kept here so the step allocates nothing: the gradient's sum of
    /// squares and finiteness (pre-pass), and whether the fused pass met a non-finite gradient.
    pub grad_sum_squares: f64,
    pub grad_finite: bool,
    pub saw_non_finite: bool,
    /// This piece's share of a rank-1 state's new maxima (empty otherwise).
    pub partial: Vec<f32>,
}

/// The optimizer over all registered parameters (CPU backend).
#[derive(Debug, Clone)]
pub struct Optimizer {
    pub(crate) options: OptimizerOptions,
    pub(crate) groups: Vec<ParamConfig>,
    pub(crate) metas: Vec<Meta>,
    pub(crate) pieces: Vec<Piece>,
    /// Steps taken by `step()` (the global counter; per-parameter counters are in `Meta`).
    pub(crate) global_steps: u64,
}

fn stream(seed: u64, param: usize, slot: SlotKind, counter: u64) -> RandomStream {
    RandomStream::new(seed, (param as u64) << 2 | slot as u64, counter)
}

impl Optimizer {
    /// An optimizer with no parameters.
    pub fn new(options: OptimizerOptions) -> Result<Self, OptimError> {
        if let Some(n) = options.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return Err(OptimError::Hyperparameter {
                    name: "max_grad_norm",
                    value: n,
                });
            }
        }
        Ok(Optimizer {
            options,
            groups: Vec::new(),
            metas: Vec::new(),
            pieces: Vec::new(),
            global_steps: 0,
        })
    }

    /// Adds a parameter group: parameters added to it take `config` (unless given their own),
    /// and [`Optimizer::set_group_lr`] sets their learning rate together. Returns its index.
    pub fn add_group(&mut self, config: ParamConfig) -> Result<usize, OptimError> {
        config.validate()?;
        self.groups.push(config);
        Ok(self.groups.len() - 1)
    }

    /// Registers a parameter of `shape` with initial values `init` in `group`, with the group's
    /// configuration.
    pub fn add_param(
        &mut self,
        name: &str,
        shape: &[usize],
        init: &[f32],
        group: usize,
    ) -> Result<ParamId, OptimError> {
        let config = *self
            .groups
            .get(group)
            .ok_or(OptimError::UnknownGroup(group))?;
        self.add_param_with(name, shape, init, group, config)
    }

    /// Registers a parameter with its own configuration (a per-parameter override of formats or
    /// hyperparameters); it still belongs to `group` for learning-rate changes.
    pub fn add_param_with(
        &mut self,
        name: &str,
        shape: &[usize],
        init: &[f32],
        group: usize,
        config: ParamConfig,
    ) -> Result<ParamId, OptimError> {
        if group >= self.groups.len() {
            return Err(OptimError::UnknownGroup(group));
        }
        config.validate()?;
        if self.metas.iter().any(|m| m.name == name) {
            return Err(OptimError::DuplicateName(name.to_string()));
        }
        let numel = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| n > 0 && n <= usize::MAX / 8)
            .ok_or_else(|| OptimError::Shape {
                param: name.to_string(),
                shape: shape.to_vec(),
            })?;
        if init.len() != numel {
            return Err(OptimError::Length {
                param: name.to_string(),
                what: "initial values",
                expected: numel,
                actual: init.len(),
            });
        }
        if let Some(index) = init.iter().position(|v| !v.is_finite()) {
            return Err(OptimError::NonFiniteParam {
                param: name.to_string(),
                index,
                value: init[index],
            });
        }
        let index = self.metas.len();
        let resolved = config.resolve(numel, shape);
        let rank1 = match resolved.state2 {
            Storage::Rank1 { map, .. } if resolved.hyper.states() >= 2 => {
                let q = Rank1::new(map.shared(), shape)?;
                let n = q.scales_len();
                Some(Rank1State {
                    q,
                    scales: vec![0.0; n],
                    next: vec![0.0; n],
                })
            }
            _ => None,
        };
        let states = resolved.hyper.states();
        let first_piece = self.pieces.len();
        for (k, values) in init.chunks(PIECE).enumerate() {
            let offset = k * PIECE;
            let at = |slot| stream(self.options.seed, index, slot, 0);
            let mut param = Slot::new(resolved.param, values.len());
            for (c, chunk) in values.chunks(CHUNK).enumerate() {
                param.encode_keyed(
                    c * CHUNK,
                    chunk,
                    at(SlotKind::Param),
                    (offset + c * CHUNK) as u64,
                );
            }
            self.pieces.push(Piece {
                param_index: index,
                offset,
                len: values.len(),
                param,
                grad: Slot::new(resolved.grad, values.len()),
                state1: if states >= 1 {
                    Slot::new(resolved.state1, values.len())
                } else {
                    Slot::empty()
                },
                state2: if states >= 2 {
                    Slot::new(resolved.state2, values.len())
                } else {
                    Slot::empty()
                },
                grad_sum_squares: 0.0,
                grad_finite: true,
                saw_non_finite: false,
                partial: match (&rank1, states >= 2) {
                    (Some(r), true) => vec![0.0; r.scales.len()],
                    _ => Vec::new(),
                },
            });
        }
        self.metas.push(Meta {
            name: name.to_string(),
            shape: shape.to_vec(),
            numel,
            requested: config,
            config: resolved,
            group,
            steps: 0,
            accumulations: 0,
            pending: false,
            first_piece,
            pieces: self.pieces.len() - first_piece,
            rule: Rule::new(&resolved.hyper, 1),
            rank1,
            update_param: true,
            active: false,
        });
        Ok(ParamId(index))
    }

    /// The parameter named `name`.
    pub fn param_id(&self, name: &str) -> Result<ParamId, OptimError> {
        self.metas
            .iter()
            .position(|m| m.name == name)
            .map(ParamId)
            .ok_or_else(|| OptimError::UnknownParam(name.to_string()))
    }

    /// Number of registered parameters.
    pub fn len(&self) -> usize {
        self.metas.len()
    }

    /// Whether no parameter is registered.
    pub fn is_empty(&self) -> bool {
        self.metas.is_empty()
    }

    /// The name of a parameter.
    pub fn name(&self, id: ParamId) -> Result<&str, OptimError> {
        Ok(&self.meta(id)?.name)
    }

    /// The configuration in force for a parameter (after the minimum-size policy).
    pub fn config(&self, id: ParamId) -> Result<ParamConfig, OptimError> {
        Ok(self.meta(id)?.config)
    }

    /// Steps taken by `step()`.
    pub fn steps(&self) -> u64 {
        self.global_steps
    }

    pub(crate) fn meta(&self, id: ParamId) -> Result<&Meta, OptimError> {
        self.metas
            .get(id.0)
            .ok_or_else(|| OptimError::UnknownParam(format!("#{}", id.0)))
    }

    /// Sets the learning rate of every parameter.
    pub fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
        for g in 0..self.groups.len() {
            self.set_group_lr(g, lr)?;
        }
        Ok(())
    }

    /// Sets the learning rate of every parameter of `group` (those with their own configuration
    /// too), effective from the next step.
    pub fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<(), OptimError> {
        if group >= self.groups.len() {
            return Err(OptimError::UnknownGroup(group));
        }
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(OptimError::Hyperparameter {
                name: "lr",
                value: lr,
            });
        }
        self.groups[group].hyper.set_lr(lr);
        for m in self.metas.iter_mut().filter(|m| m.group == group) {
            m.config.hyper.set_lr(lr);
            m.requested.hyper.set_lr(lr);
        }
        Ok(())
    }

    fn check_len(&self, id: ParamId, what: &'static str, len: usize) -> Result<&Meta, OptimError> {
        let meta = self.meta(id)?;
        if len != meta.numel {
            return Err(OptimError::Length {
                param: meta.name.clone(),
                what,
                expected: meta.numel,
                actual: len,
            });
        }
        Ok(meta)
    }

    /// Adds a micro-batch gradient into the parameter's gradient accumulator (in its storage
    /// format, stochastically rounded if configured so). The next step consumes and resets it.
    /// Non-finite values are stored as they are and handled by the step's policy... except in
    /// quantized accumulators, which cannot hold them: there the call fails and nothing changes.
    pub fn accumulate(&mut self, id: ParamId, grad: &[f32]) -> Result<(), OptimError> {
        let meta = self.check_len(id, "gradient", grad.len())?;
        if meta.config.grad == Storage::None {
            return Err(OptimError::NoAccumulator(meta.name.clone()));
        }
        if matches!(meta.config.grad, Storage::Quantized { .. }) {
            if let Some(index) = grad.iter().position(|v| !v.is_finite()) {
                return Err(lpmm_quant::QuantError::NonFinite {
                    index,
                    value: grad[index],
                }
                .into());
            }
        }
        let seed = self.options.seed;
        let counter = meta.accumulations;
        let (first, count) = (meta.first_piece, meta.pieces);
        let add = |piece: &mut Piece| {
            let s = stream(seed, id.0, SlotKind::Grad, counter);
            let mut acc = [0f32; CHUNK];
            let g = &grad[piece.offset..piece.offset + piece.len];
            for (c, gc) in g.chunks(CHUNK).enumerate() {
                let start = c * CHUNK;
                let acc = &mut acc[..gc.len()];
                piece.grad.decode(start, acc);
                acc.iter_mut().zip(gc).for_each(|(a, &x)| *a += x);
                piece
                    .grad
                    .encode_keyed(start, acc, s, (piece.offset + start) as u64);
            }
        };
        for_pieces(&mut self.pieces[first..first + count], add);
        let meta = &mut self.metas[id.0];
        meta.accumulations += 1;
        meta.pending = true;
        Ok(())
    }

    /// Reads the parameter's current value as f32 into `out`.
    pub fn read_param(&self, id: ParamId, out: &mut [f32]) -> Result<(), OptimError> {
        let meta = self.check_len(id, "output", out.len())?;
        for piece in &self.pieces[meta.first_piece..meta.first_piece + meta.pieces] {
            let out = &mut out[piece.offset..piece.offset + piece.len];
            for (c, o) in out.chunks_mut(CHUNK).enumerate() {
                piece.param.decode(c * CHUNK, o);
            }
        }
        Ok(())
    }

    /// Reads a state (1 or 2) of the parameter as f32 into `out` (zeros if the optimizer has no
    /// such state).
    pub fn read_state(&self, id: ParamId, state: usize, out: &mut [f32]) -> Result<(), OptimError> {
        let meta = self.check_len(id, "output", out.len())?;
        for piece in &self.pieces[meta.first_piece..meta.first_piece + meta.pieces] {
            let slot = if state == 1 {
                &piece.state1
            } else {
                &piece.state2
            };
            let out = &mut out[piece.offset..piece.offset + piece.len];
            for (c, o) in out.chunks_mut(CHUNK).enumerate() {
                match (&meta.rank1, state) {
                    (Some(r), 2) => {
                        slot.decode_rank1(c * CHUNK, piece.offset + c * CHUNK, o, &r.q, &r.scales)
                    }
                    _ => slot.decode(c * CHUNK, o),
                }
            }
        }
        Ok(())
    }

    /// Steps every parameter whose accumulator holds gradients, consuming them.
    pub fn step(&mut self) -> Result<StepReport, OptimError> {
        let mut report = StepReport::default();
        let policy = self.options.non_finite;
        // Pre-pass over the gradients when the norm is needed (clipping) or the step may be
        // skipped: one read of each accumulator.
        let mut clip = 1.0f32;
        if self.options.max_grad_norm.is_some() || policy == NonFinitePolicy::SkipStep {
            let metas = &self.metas;
            self.pieces
                .par_iter_mut()
                .filter(|p| metas[p.param_index].pending)
                .for_each(|p| {
                    let mut acc = [0f32; CHUNK];
                    let (mut sum, mut finite) = (0.0f64, true);
                    for c in (0..p.len).step_by(CHUNK) {
                        let a = &mut acc[..CHUNK.min(p.len - c)];
                        p.grad.decode(c, a);
                        for &g in a.iter() {
                            finite &= g.is_finite();
                            sum += f64::from(g) * f64::from(g);
                        }
                    }
                    p.grad_sum_squares = sum;
                    p.grad_finite = finite;
                });
            // A fixed-order sum: the same norm for any thread count.
            let mut total = 0.0f64;
            for p in self.pieces.iter().filter(|p| metas[p.param_index].pending) {
                total += p.grad_sum_squares;
                if !p.grad_finite && !report.non_finite.contains(&ParamId(p.param_index)) {
                    report.non_finite.push(ParamId(p.param_index));
                }
            }
            let norm = total.sqrt();
            report.grad_norm = Some(norm);
            if let Some(max) = self.options.max_grad_norm {
                if norm.is_finite() && norm > max {
                    clip = (max / (norm + 1e-6)) as f32;
                }
            }
            if !report.non_finite.is_empty() && policy == NonFinitePolicy::SkipStep {
                report.skipped = true;
                for meta in self.metas.iter_mut().filter(|m| m.pending) {
                    meta.pending = false;
                }
                for piece in &mut self.pieces {
                    piece.grad.clear(0, piece.len);
                }
                return Ok(report);
            }
        }
        for meta in &mut self.metas {
            meta.active = meta.pending;
            if meta.active {
                meta.rule = Rule::new(&meta.config.hyper, meta.steps + 1);
            }
        }
        let seed = self.options.seed;
        self.rank1_maxima(clip, None);
        let metas = &self.metas;
        self.pieces
            .par_iter_mut()
            .filter(|p| metas[p.param_index].active)
            .for_each(|piece| {
                let meta = &metas[piece.param_index];
                piece.saw_non_finite = fused_step(piece, meta, seed, clip, None);
            });
        for piece in self.pieces.iter().filter(|p| p.saw_non_finite) {
            if !report.non_finite.contains(&ParamId(piece.param_index)) {
                report.non_finite.push(ParamId(piece.param_index));
            }
        }
        for meta in self.metas.iter_mut().filter(|m| m.active) {
            if let Some(r) = &mut meta.rank1 {
                std::mem::swap(&mut r.scales, &mut r.next);
            }
            meta.steps += 1;
            meta.pending = false;
            meta.active = false;
            report.updated += 1;
        }
        self.global_steps += 1;
        Ok(report)
    }

    /// Phase A for active parameters with a rank-1 second moment: each piece folds the maxima of
    /// its updated second moment (recomputed, nothing written), then the pieces' maxima are
    /// combined in a fixed order into `next`. `grad`: the gradient of `step_param` (one active
    /// parameter), added to the accumulator as in the fused pass.
    fn rank1_maxima(&mut self, clip: f32, grad: Option<&[f32]>) {
        if !self.metas.iter().any(|m| m.active && m.rank1.is_some()) {
            return;
        }
        let metas = &self.metas;
        self.pieces
            .par_iter_mut()
            .filter(|p| metas[p.param_index].active && metas[p.param_index].rank1.is_some())
            .for_each(|piece| {
                let g = grad.map(|g| &g[piece.offset..piece.offset + piece.len]);
                rank1_fold(piece, &metas[piece.param_index], clip, g);
            });
        for meta in self.metas.iter_mut().filter(|m| m.active) {
            let Some(r) = &mut meta.rank1 else { continue };
            r.next.fill(0.0);
            for piece in &self.pieces[meta.first_piece..meta.first_piece + meta.pieces] {
                r.next
                    .iter_mut()
                    .zip(&piece.partial)
                    .for_each(|(a, &b)| *a = a.max(b));
            }
        }
    }

    /// Gradient release: steps one parameter now with `grad` (plus anything its accumulator
    /// holds), so a training loop can step each parameter from its backward hook and never hold
    /// all gradients. Global-norm clipping needs every gradient and is not applied here.
    pub fn step_param(&mut self, id: ParamId, grad: &[f32]) -> Result<StepReport, OptimError> {
        self.release_step(id, grad, true)
    }

    /// Optimizer accumulation (optimi's, after Zhang et al.'s AdamAccumulation): folds a
    /// micro-batch gradient straight into the optimizer states — the rule's state update with
    /// this gradient, the step counter advancing — without weight decay and without moving the
    /// parameter. Finish the accumulation with [`Optimizer::step_param`] on the last micro-batch.
    /// With gradient storage `None` no gradient memory is ever held.
    pub fn accumulate_states(
        &mut self,
        id: ParamId,
        grad: &[f32],
    ) -> Result<StepReport, OptimError> {
        self.release_step(id, grad, false)
    }

    fn release_step(
        &mut self,
        id: ParamId,
        grad: &[f32],
        update_param: bool,
    ) -> Result<StepReport, OptimError> {
        let meta = self.check_len(id, "gradient", grad.len())?;
        let mut report = StepReport::default();
        if grad.iter().any(|g| !g.is_finite()) {
            report.non_finite.push(id);
            if self.options.non_finite == NonFinitePolicy::SkipStep {
                report.skipped = true;
                return Ok(report);
            }
        }
        let rule = Rule::new(&meta.config.hyper, meta.steps + 1);
        let (first, count) = (meta.first_piece, meta.pieces);
        for (i, m) in self.metas.iter_mut().enumerate() {
            m.active = i == id.0;
        }
        self.metas[id.0].rule = rule;
        self.metas[id.0].update_param = update_param;
        self.rank1_maxima(1.0, Some(grad));
        let seed = self.options.seed;
        let meta = &self.metas[id.0];
        for_pieces(&mut self.pieces[first..first + count], |piece| {
            let g = &grad[piece.offset..piece.offset + piece.len];
            piece.saw_non_finite = fused_step(piece, meta, seed, 1.0, Some(g));
        });
        let m = &mut self.metas[id.0];
        m.active = false;
        m.update_param = true;
        if let Some(r) = &mut m.rank1 {
            std::mem::swap(&mut r.scales, &mut r.next);
        }
        m.steps += 1;
        m.pending = false;
        report.updated = 1;
        Ok(report)
    }
}

/// Runs `f` on every piece of one parameter: inline for a single piece (a small tensor must not
/// pay a thread-pool dispatch per call), in parallel otherwise.
fn for_pieces(pieces: &mut [Piece], f: impl Fn(&mut Piece) + Sync + Send) {
    match pieces {
        [one] => f(one),
        many => many.par_iter_mut().for_each(f),
    }
}

/// The fused step of one piece: for each chunk, decode gradient, parameter and states, apply the
/// rule, requantize the states with their new absmax, store the parameter, clear the gradient.
/// Returns whether a non-finite gradient was met (its elements were left unchanged).
fn fused_step(piece: &mut Piece, meta: &Meta, seed: u64, clip: f32, grad: Option<&[f32]>) -> bool {
    let index = piece.param_index;
    let t = meta.steps + 1;
    let first = meta.steps == 0;
    let rule = if meta.update_param {
        meta.rule
    } else {
        meta.rule.without_decay()
    };
    let kahan = matches!(piece.param.data, SlotData::Kahan { .. });
    let (mut g, mut p, mut m, mut v, mut d) = (
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
        [0f32; CHUNK],
    );
    let mut saw_non_finite = false;
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        let (g, p, m, v, d) = (
            &mut g[..n],
            &mut p[..n],
            &mut m[..n],
            &mut v[..n],
            &mut d[..n],
        );
        piece.grad.decode(start, g);
        if let Some(extra) = grad {
            g.iter_mut()
                .zip(&extra[start..start + n])
                .for_each(|(a, &b)| *a += b);
        }
        piece.param.decode(start, p);
        piece.state1.decode(start, m);
        match &meta.rank1 {
            Some(r) => piece
                .state2
                .decode_rank1(start, piece.offset + start, v, &r.q, &r.scales),
            None => piece.state2.decode(start, v),
        }
        for i in 0..n {
            let gi = g[i] * clip;
            if !gi.is_finite() {
                saw_non_finite = true;
                d[i] = 0.0;
                continue;
            }
            let u = rule.apply(p[i], gi, &mut m[i], &mut v[i], first);
            p[i] = u.param;
            d[i] = u.delta;
        }
        let global = (piece.offset + start) as u64;
        piece
            .state1
            .encode_keyed(start, m, stream(seed, index, SlotKind::State1, t), global);
        piece
            .state2
            .encode_keyed(start, v, stream(seed, index, SlotKind::State2, t), global);
        if let Some(r) = &meta.rank1 {
            piece
                .state2
                .encode_rank1(start, piece.offset + start, v, &r.q, &r.next);
        }
        if meta.update_param {
            if kahan {
                piece.param.kahan_add(start, d);
            } else {
                piece
                    .param
                    .encode_keyed(start, p, stream(seed, index, SlotKind::Param, t), global);
            }
        }
        piece.grad.clear(start, n);
    }
    saw_non_finite
}

/// Phase A of a rank-1 step for one piece: recompute the updated second moment exactly as
/// [`fused_step`] will, and fold its per-dimension maxima into `piece.partial`.
fn rank1_fold(piece: &mut Piece, meta: &Meta, clip: f32, grad: Option<&[f32]>) {
    let Some(r) = &meta.rank1 else { return };
    let first = meta.steps == 0;
    let rule = if meta.update_param {
        meta.rule
    } else {
        meta.rule.without_decay()
    };
    piece.partial.fill(0.0);
    let (mut g, mut p, mut m, mut v) = ([0f32; CHUNK], [0f32; CHUNK], [0f32; CHUNK], [0f32; CHUNK]);
    for start in (0..piece.len).step_by(CHUNK) {
        let n = CHUNK.min(piece.len - start);
        let (g, p, m, v) = (&mut g[..n], &mut p[..n], &mut m[..n], &mut v[..n]);
        piece.grad.decode(start, g);
        if let Some(extra) = grad {
            g.iter_mut()
                .zip(&extra[start..start + n])
                .for_each(|(a, &b)| *a += b);
        }
        piece.param.decode(start, p);
        piece.state1.decode(start, m);
        piece
            .state2
            .decode_rank1(start, piece.offset + start, v, &r.q, &r.scales);
        for i in 0..n {
            let gi = g[i] * clip;
            if gi.is_finite() {
                rule.apply(p[i], gi, &mut m[i], &mut v[i], first);
            }
        }
        r.q.fold_maxima(v, piece.offset + start, &mut piece.partial);
    }
}
