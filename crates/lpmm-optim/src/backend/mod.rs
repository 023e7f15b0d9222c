//! The backend seam, for implementors of backends: where model memory lives and where the numeric
//! work runs. Users need only [`crate::Optimizer`] and a backend value; this module is what a
//! backend (lpmm-backend's device layer, the CPU reference here) is written against.
//!
//! The [`crate::Optimizer`] keeps the bookkeeping (names, groups, counters, policies, the
//! checkpoint format) and, through its step executor, the schedule of a step (the order of the
//! phases, the lent-buffer checks, the batching, the host combines: [`run_step`], [`run_batch`]);
//! a [`Backend`] owns every parameter's slots and does the operations on them, a step as
//! primitives ([`Backend::fold`], [`Backend::fused`], ...).
//! The CPU backend ([`crate::Cpu`]) defines the semantics ([docs/OPTIMIZERS.md],
//! [docs/FORMATS.md]); a device backend implements the same operations on device memory and is
//! tested against it bit for bit by the conformance suite (`lpmm_optim::conformance_tests!`,
//! feature `testing`).
//!
//! Every operation is fallible ([`BackendError`]). Values come in and go out through the
//! backend's own buffer types ([`Backend::Input`], [`Backend::Output`]: host slices on the CPU,
//! device buffers on a GPU), so a framework's tensors reach a device backend without host copies,
//! and a parameter whose primary region has a framework dtype (f32, bf16) may *be* the caller's
//! buffer ([`ParamLayout::lent`]): the backend steps it in place and allocates no copy.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md
//! [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md

use std::sync::atomic::AtomicU32;

use lpmm_formats::bf16;
use lpmm_quant::RandomStream;

pub use crate::error::BackendError;
pub use crate::format::{
    Extent, FoldInput, Format, HostRegion, HostSlot, KERNELS as FORMAT_KERNELS,
    LIMITS as FORMAT_LIMITS, Place, RegionSpec, Walked,
};
pub use crate::rule::{
    FieldType, KernelStruct, Limits, MAX_STATS, Moment, NewtonSchulz, RuleConsts, RuleState,
    StepFlags, Updated,
};

pub use crate::exec::run_batch;
pub use crate::fixed::{fold as fixed_fold, frac_bits as fixed_frac_bits, total as fixed_total};
pub use crate::plan::{
    Mat, MatrixOp, MatrixShape, Phase, PlanKey, PlanRunner, STATS_PASSES, StepPlan, newton_schulz,
    run_step,
};
pub use crate::vocab::{Dtype, F32_MAX_BITS, ParamId, SLOTS, SlotKind, fits};

pub use crate::exact::{EXACT_WORDS, ExactSum, NORM_RUN, add_squares};

/// How one parameter is laid out: fixed when it is registered.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamLayout {
    /// Its shape as the backend holds it (row-major; a shard's is `[len]`).
    pub shape: Vec<usize>,
    /// Its element count.
    pub numel: usize,
    /// Each slot's format (resolved by the minimum-size and shape rules), `None` where the slot
    /// is not allocated (no gradient accumulator, states the rule does not use).
    pub formats: [Option<Format>; SLOTS],
    /// The logical parameter index that keys its random streams (its own index, or for a shard
    /// the logical parameter's index in the unsharded model).
    pub stream: u64,
    /// For a shard, the logical index of its first element (random words are keyed by logical
    /// element index, so a shard draws the bits the unsharded tensor would); 0 otherwise.
    pub offset: u64,
    /// The parameter slot's primary region is the caller's buffer ([`Format::lendable`] dtype),
    /// lent to every call that touches it; the backend allocates only the other regions.
    pub lent: bool,
}

impl ParamLayout {
    /// The format of `slot`.
    pub fn format(&self, slot: SlotKind) -> Option<Format> {
        self.formats[slot as usize]
    }

    /// What the step may store into the parameter and states ([`Format::limit`]; f32's for an
    /// unallocated slot, and for the parameter when `flags` does not move it).
    pub fn limits(&self, flags: StepFlags) -> Limits {
        let limit = |slot: SlotKind| self.format(slot).map_or(F32_MAX_BITS, |f| f.limit_bits());
        Limits {
            param: if flags.has(StepFlags::UPDATE_PARAM) {
                limit(SlotKind::Param)
            } else {
                F32_MAX_BITS
            },
            state1: limit(SlotKind::State1),
            state2: limit(SlotKind::State2),
            state3: limit(SlotKind::State3),
        }
    }

    /// The step's flags for this layout: `flags` with the states given where they are a
    /// factorized reconstruction ([`StepFlags::GIVEN_V`], [`StepFlags::GIVEN_W`]).
    pub fn step_flags(&self, flags: StepFlags) -> StepFlags {
        let given = |slot: SlotKind| {
            self.format(slot)
                .is_some_and(|f| f.folds().contains(&FoldInput::MomentGradient))
        };
        flags
            .with(StepFlags::GIVEN_V, given(SlotKind::State2))
            .with(StepFlags::GIVEN_W, given(SlotKind::State3))
    }

    /// The random stream of `slot` at `counter` (the step, or for the gradient accumulator its
    /// accumulate count): [docs/OPTIMIZERS.md].
    ///
    /// [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md
    pub fn stream(&self, seed: u64, slot: SlotKind, counter: u64) -> RandomStream {
        RandomStream::new(seed, stream_tensor(self.stream, slot), counter)
    }
}

/// The tensor id of a slot's random stream: `stream << 2 | slot` for the parameter, the
/// accumulator and states 1 and 2; state 3 is `2^63 | stream << 2` (a space no other slot
/// reaches while `stream < 2^61`).
pub fn stream_tensor(stream: u64, slot: SlotKind) -> u64 {
    match slot {
        SlotKind::State3 => 1 << 63 | stream << 2,
        _ => stream << 2 | slot as u64,
    }
}

/// What one parameter's step does: decided by the optimizer for each step call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamStep {
    /// The parameter's step plan, compiled when it was registered ([`StepPlan::new`]).
    pub plan: StepPlan,
    /// The 1-based step: the random-stream counter of the parameter and its states.
    pub t: u64,
    /// First step, whether the parameter moves ([`StepFlags`]).
    pub flags: StepFlags,
    /// The rule's constants for this step.
    pub rule: RuleConsts,
    /// Gradients are multiplied by this first (global-norm clipping).
    pub clip: f32,
}

/// Host values, as a buffer every backend accepts.
#[derive(Debug, Clone, Copy)]
pub enum HostValues<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 values.
    Bf16(&'a [bf16]),
}

/// Writable host values.
#[derive(Debug)]
pub enum HostValuesMut<'a> {
    /// f32 values.
    F32(&'a mut [f32]),
    /// bf16 values.
    Bf16(&'a mut [bf16]),
}

impl HostValues<'_> {
    /// Element type and count.
    pub fn info(&self) -> (Dtype, usize) {
        match self {
            HostValues::F32(v) => (Dtype::F32, v.len()),
            HostValues::Bf16(v) => (Dtype::Bf16, v.len()),
        }
    }

    /// The values as little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            HostValues::F32(v) => bytemuck::cast_slice(v),
            HostValues::Bf16(v) => bytemuck::cast_slice(v),
        }
    }

    /// Elements `range` as f32 into `out`.
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        match self {
            HostValues::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
            HostValues::Bf16(v) => {
                lpmm_formats::simd::bf16_to_f32(&v[start..start + out.len()], out)
            }
        }
    }
}

impl HostValuesMut<'_> {
    /// Element type and count.
    pub fn info(&self) -> (Dtype, usize) {
        match self {
            HostValuesMut::F32(v) => (Dtype::F32, v.len()),
            HostValuesMut::Bf16(v) => (Dtype::Bf16, v.len()),
        }
    }

    /// A shorter-lived view.
    pub fn reborrow(&mut self) -> HostValuesMut<'_> {
        match self {
            HostValuesMut::F32(v) => HostValuesMut::F32(v),
            HostValuesMut::Bf16(v) => HostValuesMut::Bf16(v),
        }
    }

    /// The values as little-endian bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostValuesMut::F32(v) => bytemuck::cast_slice_mut(v),
            HostValuesMut::Bf16(v) => bytemuck::cast_slice_mut(v),
        }
    }
}

/// What a new parameter starts from.
pub enum Init<'a, B: Backend> {
    /// These values, stored in the parameter's format (rounded as it rounds; random stream
    /// counter 0).
    Values(B::Input<'a>),
    /// The caller's buffer is the parameter ([`ParamLayout::lent`]): its other regions start at
    /// zero (a Kahan compensation, a split remainder).
    Lent,
    /// Every slot as freshly allocated (zeros; quantized codes as [`Format::fresh`] says), the
    /// parameter included: its contents are imported next (a checkpoint being loaded), so no
    /// initial values are stored or even held.
    Fresh,
}

impl<B: Backend> std::fmt::Debug for Init<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Init::Values(_) => "Init::Values",
            Init::Lent => "Init::Lent",
            Init::Fresh => "Init::Fresh",
        })
    }
}

/// One batch of a step, as each step primitive of a [`Backend`] receives it: the parameters
/// that step (`plans[i]` is `Some`), each with its plan. The step executor
/// (`lpmm_optim`'s `exec` module) has checked every lent buffer: each parameter of the batch
/// that is lent ([`ParamLayout::lent`]) has exactly one buffer in `lent`, of its dtype and size,
/// and no other parameter has one.
pub struct StepWork<'a, 'r, 'l, B: Backend> {
    /// Every parameter.
    pub params: &'a mut [B::Param],
    /// Their layouts.
    pub layouts: &'a [ParamLayout],
    /// The plan of each parameter that steps in this batch.
    pub plans: &'a [Option<ParamStep>],
    /// Gradient release: parameter `.0` adds this gradient to what its accumulator holds.
    pub released: Option<(usize, B::Input<'r>)>,
    /// The buffers of the batch's lent parameters.
    pub lent: &'a mut [(ParamId, B::Output<'l>)],
    /// The seed of every random stream.
    pub seed: u64,
}

impl<B: Backend> std::fmt::Debug for StepWork<'_, '_, '_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepWork")
            .field("params", &self.params.len())
            .field("lent", &self.lent.len())
            .field("released", &self.released.map(|(i, _)| i))
            .finish()
    }
}

/// What a tensor-wide phase folded into, handed to the host combine ([`Backend::folded`]).
#[derive(Debug)]
pub enum Folded<'a> {
    /// The rule's sums of squares: [`MAX_STATS`] exponent words, then [`MAX_STATS`] 64-bit
    /// fixed-point sums as word pairs ([`fixed_total`] reads them).
    Stats(&'a [AtomicU32]),
    /// A state slot's tensor-wide regions (the combine writes its results into them).
    Wide(&'a [Box<[AtomicU32]>]),
}

/// Words of a parameter's rule sums ([`Folded::Stats`]): [`MAX_STATS`] exponents, then
/// [`MAX_STATS`] 64-bit sums.
pub const STAT_WORDS: usize = 3 * MAX_STATS;

/// What a backend without the matrix phase answers to its primitives.
pub fn no_matrix_phase(backend: &'static str) -> BackendError {
    BackendError::Unsupported {
        backend,
        what: "the matrix phase (Muon's Newton-Schulz iterations: docs/BACKENDS.md)".into(),
    }
}

/// Where model memory lives and where the step runs.
///
/// Contract: results equal the CPU backend's bit for bit where the backend's arithmetic allows
/// (otherwise within a bound the backend documents); random words follow [docs/FORMATS.md] §9 with
/// the stream ids of [`ParamLayout::stream`]. Every method returns an error rather than panic.
///
/// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
pub trait Backend: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// Everything the backend holds for one parameter (its slots' regions). Not `Clone`: a copy of
    /// model memory is never made implicitly.
    type Param: std::fmt::Debug + Send + Sync;
    /// A read-only buffer of one tensor's values in the backend's memory (a gradient; a lent
    /// parameter's values).
    type Input<'a>: Copy + Send + Sync;
    /// A writable buffer of one tensor's values (decoded reads; a lent parameter).
    type Output<'a>: Send;
    /// The workspace of the matrix phase ([`MatrixOp`]: Muon's Newton–Schulz iterations), sized
    /// for the largest matrix registered; the step executor holds one and lends it to the
    /// matrix primitives, one parameter at a time. `()` for a backend without the phase.
    type Matrices: std::fmt::Debug + Send + Sync;

    /// A short name ("cpu", "wgpu", ...).
    fn name(&self) -> &'static str;

    /// Host values as an input (every backend accepts them; a device backend uploads them).
    fn host_input<'a>(&self, values: HostValues<'a>) -> Self::Input<'a>;
    /// A host buffer as an output.
    fn host_output<'a>(&self, out: HostValuesMut<'a>) -> Self::Output<'a>;
    /// An input's element type and count.
    fn input_info(&self, input: &Self::Input<'_>) -> (Dtype, usize);
    /// An output's element type and count.
    fn output_info(&self, output: &Self::Output<'_>) -> (Dtype, usize);

    /// Whether a buffer of `(element type, length)` `info` can be the lent parameter of
    /// `layout`: the storage's lendable element type and the parameter's length (what lending
    /// it checks). Nothing is read or written.
    fn check_lent(&self, layout: &ParamLayout, info: (Dtype, usize)) -> Result<(), BackendError> {
        let want = layout
            .format(SlotKind::Param)
            .and_then(|f| f.lendable())
            .ok_or_else(|| BackendError::Unsupported {
                backend: self.name(),
                what: "lending a parameter of this storage".into(),
            })?;
        let (dtype, len) = info;
        if (dtype, len) != (want, layout.numel) {
            return Err(BackendError::Buffer {
                what: format!(
                    "a lent parameter buffer must hold {} {} values, not {len} {}",
                    layout.numel,
                    want.name(),
                    dtype.name()
                ),
            });
        }
        Ok(())
    }

    /// Allocates a parameter (slots zero-filled, quantized codes as [`Format::fresh`] says) and
    /// stores its initial value. A backend may defer the gradient accumulator's element regions
    /// to the first `accumulate` or `import` of that slot (the CPU backend does, so a parameter
    /// stepped only from given gradients never holds one); until then the accumulator reads,
    /// steps and exports as a fresh one, and [`Backend::bytes`] does not count it.
    fn allocate(
        &self,
        layout: &ParamLayout,
        init: Init<'_, Self>,
        seed: u64,
    ) -> Result<Self::Param, BackendError>;

    /// Adds a micro-batch gradient into the accumulator; `counter` (the accumulate count) keys
    /// its random stream. If the accumulator's format cannot hold non-finite values
    /// ([`Format::holds_non_finite`]) the caller has checked [`Backend::accumulate_fits`].
    fn accumulate(
        &self,
        param: &mut Self::Param,
        layout: &ParamLayout,
        counter: u64,
        grad: Self::Input<'_>,
        seed: u64,
    ) -> Result<(), BackendError>;

    /// Whether every value of `values` is finite.
    fn finite(&self, values: Self::Input<'_>) -> Result<bool, BackendError> {
        self.fits(values, f32::MAX)
    }

    /// Whether every value of `values` is finite and at most `limit` in magnitude
    /// ([`fits`]; a format's [`Format::limit`]).
    fn fits(&self, values: Self::Input<'_>, limit: f32) -> Result<bool, BackendError>;

    /// Whether adding `grad` to the parameter's gradient accumulator gives, for every element,
    /// a sum (`accumulator + grad` in f32, as [`Backend::accumulate`] computes it) that fits the
    /// accumulator's format ([`fits`] with [`Format::limit`]). Nothing changes.
    fn accumulate_fits(
        &self,
        param: &Self::Param,
        layout: &ParamLayout,
        grad: Self::Input<'_>,
    ) -> Result<bool, BackendError>;

    /// The gradient statistics of a caller's gradient buffer, as [`Backend::gradient_stats`]
    /// defines them for an accumulator: the exact sum of squares of its finite values (one f64
    /// partial per 256 elements) and whether all are finite.
    fn input_stats(&self, values: Self::Input<'_>) -> Result<(ExactSum, bool), BackendError>;

    /// For every selected parameter: the sum of squares of its accumulated gradient's finite
    /// values and whether they are all finite, in `out[index]`. The sum is exact over one f64
    /// partial per 256 elements of the parameter (each the sum of its squares in element order),
    /// so that it does not depend on how the work is split.
    fn gradient_stats(
        &self,
        params: &mut [Self::Param],
        layouts: &[ParamLayout],
        select: &[bool],
        out: &mut [(ExactSum, bool)],
    ) -> Result<(), BackendError>;

    /// The step primitives: the executor runs a batch as [`run_step`] orders them —
    /// `prepare`, then each tensor-wide phase a plan takes (`begin_phase`, its `fold` passes,
    /// `folded` for the host combine), then `fused`, then `swap_wide` — and a backend does
    /// each over every parameter of the batch at once where it can (one launch on a device).
    /// Checks a batch's buffers the way only this backend can (a device backend: lent and
    /// released buffers are its device buffers) and readies what its primitives share, before
    /// anything moves. The default checks nothing.
    fn prepare(&self, _work: &mut StepWork<'_, '_, '_, Self>) -> Result<(), BackendError> {
        Ok(())
    }

    /// Zeroes what `phase` folds into ([`Format::fold_targets`]; the rule's sums), for each
    /// parameter of the batch whose plan takes the phase.
    fn begin_phase(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        phase: Phase,
    ) -> Result<(), BackendError>;

    /// Fold pass `pass` of `phase` ([`StepPlan::fold_input`]; the rule's sums of squares,
    /// [`RuleConsts::stats`]) for each parameter of the batch whose plan takes more than `pass`
    /// passes of it: every element folded into the targets by atomic max and exact addition,
    /// in any order.
    fn fold(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        phase: Phase,
        pass: usize,
    ) -> Result<(), BackendError>;

    /// Hands what `phase` folded for each parameter with `ran[i]` to `combine(i, ..)` on the
    /// host, and keeps what the combine writes into a slot's tensor-wide regions.
    fn folded(
        &self,
        params: &mut [Self::Param],
        layouts: &[ParamLayout],
        ran: &[bool],
        phase: Phase,
        combine: &mut dyn FnMut(usize, Folded<'_>),
    ) -> Result<(), BackendError>;

    /// The fused pass of every parameter of the batch ([docs/OPTIMIZERS.md], "The step"): decode,
    /// the rule, encode, one pass over memory. With [`StepFlags::TRANSFORM`] only the parameter
    /// moves (no gradient is read or cleared, no state is stored). `non_finite[i]` is set where
    /// a non-finite gradient or result was met (those elements are left unchanged).
    ///
    /// [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md
    fn fused(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        non_finite: &mut [bool],
    ) -> Result<(), BackendError>;

    /// Trades tensor-wide regions `a` and `b` of `slot` (after the fused pass:
    /// [`StepPlan::swaps`]).
    fn swap_wide(&self, param: &mut Self::Param, slot: SlotKind, a: usize, b: usize);

    /// The matrix primitives (a parameter whose plan takes the matrix phase,
    /// [`StepPlan::matrix`], steps through them instead of [`Backend::fused`], on its own: see
    /// [`run_step`]). A workspace for the matrix phase of any [`MatrixShape`] with at most
    /// `elements` elements and an `m × m` of at most `square` elements, allocated when a
    /// parameter is registered. The default, for a backend without the phase, is
    /// [`no_matrix_phase`]: such a parameter cannot be registered on it.
    fn matrices(&self, _elements: usize, _square: usize) -> Result<Self::Matrices, BackendError> {
        Err(no_matrix_phase(self.name()))
    }

    /// Bytes the workspace holds.
    fn matrices_bytes(&self, _matrices: &Self::Matrices) -> usize {
        0
    }

    /// Gathers parameter `index`'s matrix input ([`RuleConsts::matrix_input`] of each element,
    /// the batch's gradient and lent buffer as [`Backend::fused`] reads them) into
    /// [`Mat::Update`] of `matrices`, for a phase of `shape` (the parameter's). Nothing of the
    /// parameter changes.
    fn matrix_in(
        &self,
        _work: &mut StepWork<'_, '_, '_, Self>,
        _index: usize,
        _shape: MatrixShape,
        _matrices: &mut Self::Matrices,
    ) -> Result<(), BackendError> {
        Err(no_matrix_phase(self.name()))
    }

    /// One operation on the workspace, on the shape of the last [`Backend::matrix_in`]. Its
    /// result must not depend on the thread count.
    fn matrix_op(&self, _matrices: &mut Self::Matrices, _op: MatrixOp) -> Result<(), BackendError> {
        Err(no_matrix_phase(self.name()))
    }

    /// The fused pass of parameter `index` alone, each element reading its entry of
    /// [`Mat::Update`] as the rule's `v` operand ([`crate::backend::NewtonSchulz`]); returns
    /// whether a non-finite value was met (as [`Backend::fused`] reports it).
    fn matrix_out(
        &self,
        _work: &mut StepWork<'_, '_, '_, Self>,
        _index: usize,
        _matrices: &Self::Matrices,
    ) -> Result<bool, BackendError> {
        Err(no_matrix_phase(self.name()))
    }

    /// Clears the gradient accumulator of parameter `only`, or of every parameter.
    fn clear_gradients(
        &self,
        params: &mut [Self::Param],
        layouts: &[ParamLayout],
        only: Option<usize>,
    ) -> Result<(), BackendError>;

    /// Decodes one slot into `out` (f32; `layout.numel` elements; zeros for an unused slot).
    fn read(
        &self,
        param: &Self::Param,
        layout: &ParamLayout,
        slot: SlotKind,
        out: Self::Output<'_>,
    ) -> Result<(), BackendError>;

    /// One slot in the canonical host layout; `lent` is the caller's buffer of a lent parameter
    /// slot.
    fn export(
        &self,
        param: &Self::Param,
        layout: &ParamLayout,
        slot: SlotKind,
        lent: Option<Self::Input<'_>>,
    ) -> Result<HostSlot, BackendError>;

    /// Replaces one slot with canonical host contents ([`Format::validate`]d by the caller); a
    /// lent parameter slot writes its primary region into `lent`.
    fn import(
        &self,
        param: &mut Self::Param,
        layout: &ParamLayout,
        slot: SlotKind,
        host: &HostSlot,
        lent: Option<Self::Output<'_>>,
    ) -> Result<(), BackendError>;

    /// Bytes each slot of the parameter occupies on the backend (scratch it keeps for the
    /// parameter included, a lent region and a deferred accumulator excluded).
    fn bytes(&self, param: &Self::Param, layout: &ParamLayout) -> [usize; SLOTS];
}
