//! The backend seam: where model memory lives and where the numeric work runs.
//!
//! The [`crate::Optimizer`] keeps the bookkeeping (parameters, groups, counters, policies,
//! checkpoint format); a [`Backend`] owns every parameter's slots and performs the operations on
//! them. The CPU backend ([`Cpu`]) defines the semantics (docs/OPTIMIZERS.md, docs/FORMATS.md);
//! a GPU backend implements the same operations on device buffers and is tested against it.

use crate::config::ParamConfig;
use crate::error::OptimError;
use crate::exact::ExactSum;
use crate::rule::Rule;

/// Which slot of a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SlotKind {
    /// The parameter itself.
    Param = 0,
    /// The gradient accumulator.
    Grad = 1,
    /// State 1 (momentum, first moment).
    State1 = 2,
    /// State 2 (second moment).
    State2 = 3,
}

impl SlotKind {
    /// All four, in checkpoint order.
    pub const ALL: [SlotKind; 4] = [
        SlotKind::Param,
        SlotKind::Grad,
        SlotKind::State1,
        SlotKind::State2,
    ];

    /// The slot's name in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            SlotKind::Param => "param",
            SlotKind::Grad => "grad",
            SlotKind::State1 => "state1",
            SlotKind::State2 => "state2",
        }
    }
}

/// What a backend needs to know about one parameter for an operation. The optimizer keeps these
/// up to date (counters, this step's rule) before each call.
#[derive(Debug, Clone)]
pub struct ParamMeta {
    /// The parameter's name.
    pub name: String,
    /// Its shape (row-major).
    pub shape: Vec<usize>,
    /// Its element count.
    pub numel: usize,
    /// The configuration asked for.
    pub requested: ParamConfig,
    /// The configuration in force (storages resolved by the minimum-size and rank-1 rules).
    pub config: ParamConfig,
    /// Its parameter group.
    pub group: usize,
    /// Steps taken so far (this step is `steps + 1`).
    pub steps: u64,
    /// `accumulate` calls so far (the gradient slot's random-stream counter).
    pub accumulations: u64,
    /// Whether the accumulator holds gradients not yet consumed.
    pub pending: bool,
    /// This step's rule constants.
    pub rule: Rule,
    /// Whether the parameter takes part in the current operation.
    pub active: bool,
    /// False during optimizer accumulation: states are updated, the parameter is not.
    pub update_param: bool,
    /// How the parameter's learning rate follows its group's.
    pub lr_rule: LrRule,
    /// The parameter index that keys its random streams: its own index, or for a shard the
    /// logical parameter's index in the unsharded model.
    pub stream: usize,
    /// For a shard, the index of its first element in the logical parameter (random words are
    /// keyed by logical element index, so a shard draws the bits the unsharded tensor would);
    /// 0 otherwise. A multiple of `ParamConfig::shard_alignment` (at least 256).
    pub offset: usize,
}

/// How a parameter's learning rate follows its group's when the group's changes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize, Default)]
pub enum LrRule {
    /// The group's learning rate.
    #[default]
    Group,
    /// The group's learning rate times this factor (a parameter registered with its own rate).
    Scaled(f64),
    /// Its own learning rate, unchanged (registered with its own rate while the group's was 0).
    Fixed,
}

/// One slot's contents in the canonical host layout (the whole tensor, unsharded): the
/// interchange format of checkpoints and of moving state between backends.
#[derive(Debug, Clone, PartialEq)]
pub enum HostSlot {
    /// The slot is not allocated.
    Empty,
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values as bit patterns.
    Bf16(Vec<u16>),
    /// bf16 values and bf16 Kahan compensations, as bit patterns.
    Kahan {
        /// Values.
        value: Vec<u16>,
        /// Compensations.
        comp: Vec<u16>,
    },
    /// Split f32: bf16 visible halves and 16-bit remainders.
    Split {
        /// Visible bf16 halves.
        hi: Vec<u16>,
        /// Remainders.
        rem: Vec<u16>,
    },
    /// Packed codes and one absmax per block.
    Quantized {
        /// Packed codes.
        codes: Vec<u8>,
        /// Block scales.
        absmax: Vec<f32>,
    },
    /// A factorized second moment: the moving averages of the row and column means.
    Factored {
        /// One per row (the leading dimensions together).
        row: Vec<f32>,
        /// One per column (the last dimension).
        col: Vec<f32>,
    },
    /// Packed codes of a rank-1 state and its per-dimension maxima.
    Rank1 {
        /// Packed codes.
        codes: Vec<u8>,
        /// Per-dimension maxima, dimension 0's first.
        scales: Vec<f32>,
    },
}

/// Where model memory lives and where the step runs.
///
/// Contract: results equal the CPU backend's (bit for bit where the backend's arithmetic allows;
/// otherwise within a bound the backend documents); random words follow docs/FORMATS.md §9 with
/// the stream ids of docs/OPTIMIZERS.md, so stochastic rounding draws the same bits everywhere.
pub trait Backend: Clone + std::fmt::Debug + Send + Sync {
    /// Everything the backend holds for one parameter (its slots and scales).
    type Param: Clone + std::fmt::Debug + Send + Sync;

    /// A short name ("cpu", "wgpu", ...).
    fn name(&self) -> &'static str;

    /// Allocates parameter `index` (slots zero-filled) and stores `init` as its value.
    fn allocate(
        &self,
        index: usize,
        meta: &ParamMeta,
        init: &[f32],
        seed: u64,
    ) -> Result<Self::Param, OptimError>;

    /// Adds a micro-batch gradient into the accumulator (`meta.accumulations` keys its random
    /// stream). `grad` is finite if the accumulator is quantized.
    fn accumulate(
        &self,
        index: usize,
        param: &mut Self::Param,
        meta: &ParamMeta,
        grad: &[f32],
        seed: u64,
    );

    /// For every active parameter: the sum of squares of its accumulated gradient's finite
    /// values and whether they are all finite, in `out[index]`. The sum is exact over one f64
    /// partial per 256 elements of the parameter (each the sum of its squares in element
    /// order), so that it does not depend on how chunks are distributed.
    fn gradient_stats(
        &self,
        params: &mut [Self::Param],
        metas: &[ParamMeta],
        out: &mut [(ExactSum, bool)],
    );

    /// The fused step of every active parameter (gradients scaled by `clip`), or of parameter
    /// `released.0` alone with the extra gradient `released.1` (gradient release). Sets
    /// `non_finite[index]` where a non-finite gradient was met (those elements are unchanged).
    fn step(
        &self,
        params: &mut [Self::Param],
        metas: &[ParamMeta],
        seed: u64,
        clip: f32,
        released: Option<(usize, &[f32])>,
        non_finite: &mut [bool],
    );

    /// Clears every gradient accumulator.
    fn clear_gradients(&self, params: &mut [Self::Param]);

    /// Decodes one slot into `out` (f32, `meta.numel` elements; zeros for an unused slot).
    fn read(&self, param: &Self::Param, meta: &ParamMeta, slot: SlotKind, out: &mut [f32]);

    /// One slot in the canonical host layout.
    fn export(&self, param: &Self::Param, meta: &ParamMeta, slot: SlotKind) -> HostSlot;

    /// Replaces one slot with host contents of the same storage; a mismatch is an error naming
    /// it, and leaves the slot unchanged.
    fn import(
        &self,
        param: &mut Self::Param,
        meta: &ParamMeta,
        slot: SlotKind,
        host: HostSlot,
    ) -> Result<(), String>;

    /// Bytes each slot of the parameter occupies on the backend (scratch it keeps for the
    /// parameter included).
    fn bytes(&self, param: &Self::Param) -> [usize; 4];
}
