use lpmm_quant::QuantError;
use thiserror::Error;

/// Everything that can go wrong in the optimizer core. Each variant says what to change.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum OptimError {
    /// A hyperparameter is out of its range (negative or non-finite learning rate, beta outside
    /// [0, 1), ...).
    #[error("hyperparameter {name} = {value} is out of range")]
    Hyperparameter { name: &'static str, value: f64 },
    /// PyTorch's rule: Nesterov momentum needs momentum > 0 and dampening = 0.
    #[error("nesterov momentum needs momentum > 0 and dampening = 0")]
    Nesterov,
    /// A storage format was asked for in a slot that cannot use it.
    #[error("the {slot} slot cannot be stored as {storage}")]
    StorageNotAllowed { slot: &'static str, storage: String },
    /// No parameter has this id or name.
    #[error("unknown parameter {0}")]
    UnknownParam(String),
    /// A parameter with this name is registered already.
    #[error("a parameter named {0} exists already")]
    DuplicateName(String),
    /// A buffer's length does not match the parameter it is for.
    #[error("parameter {param}: {what} has {actual} elements, {expected} expected")]
    Length {
        param: String,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A shape with a zero dimension, or whose element count overflows.
    #[error("parameter {param}: shape {shape:?} is empty or too large")]
    Shape { param: String, shape: Vec<usize> },
    /// A rule that steps matrices (Muon) was given a tensor of another number of dimensions.
    #[error(
        "parameter {param}: {rule} steps matrices (tensors of 2 dimensions), not shape {shape:?}: give it another rule (lpmm_optim::Hybrid routes matrices to Muon and the rest to AdamW)"
    )]
    NotAMatrix {
        /// The parameter.
        param: String,
        /// The rule.
        rule: &'static str,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// Initial parameter values must be finite.
    #[error("parameter {param}: initial value {index} is {value}")]
    NonFiniteParam {
        param: String,
        index: usize,
        value: f32,
    },
    /// An initial parameter value is finite but beyond the largest magnitude its storage holds
    /// (it would be stored as ±Inf, or its visible bf16 half would be).
    #[error(
        "parameter {param}: initial value {index} = {value:e} does not fit its storage {storage} (largest magnitude {limit:e})"
    )]
    ParamOverflow {
        /// The parameter.
        param: String,
        /// The element.
        index: usize,
        /// Its value.
        value: f32,
        /// The storage.
        storage: String,
        /// The largest magnitude the storage holds.
        limit: f32,
    },
    /// Adding the micro-batch would give an accumulated gradient beyond what the accumulator's
    /// format holds (a sum that overflows f32 in a quantized accumulator): nothing was added.
    #[error(
        "parameter {param}: the accumulated gradient would not fit its {storage} accumulator (a sum beyond {limit:e}); nothing was added"
    )]
    AccumulatorOverflow {
        /// The parameter.
        param: String,
        /// The accumulator's storage.
        storage: String,
        /// The largest magnitude it holds.
        limit: f32,
    },
    /// A state slot that does not exist (states are 1, 2 and 3; slots are named by `SlotKind`).
    #[error("optimizer state {0} does not exist: the states are 1, 2 and 3")]
    UnknownState(usize),
    /// A step or accumulation counter beyond [`crate::MAX_COUNTER`] (2^53: the largest count
    /// the f64 bias corrections and the checkpoint format hold exactly).
    #[error("{what} would be {value}, beyond the largest counter 2^53")]
    Counter {
        /// Which counter.
        what: String,
        /// The value it would take.
        value: u64,
    },
    /// The parameter has no gradient accumulator (`Storage::None`): use `Step::param` or
    /// `Step::states_only`.
    #[error(
        "parameter {0} has no gradient accumulator (gradient storage None): use Step::param or Step::states_only"
    )]
    NoAccumulator(String),
    /// No parameter group has this index.
    #[error("unknown parameter group {0}")]
    UnknownGroup(usize),
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: String, reason: String },
    /// Host contents for a slot do not fit its storage (layout, length, non-finite values).
    #[error("parameter {param}: {reason}")]
    Slot {
        /// The parameter.
        param: String,
        /// What does not fit.
        reason: String,
    },
    /// A shard of a parameter that cannot be registered (lpmm-dist).
    #[error("parameter {param}: {reason}")]
    Shard {
        /// The parameter.
        param: String,
        /// Why.
        reason: String,
    },
    /// A lent parameter (one that lives in the caller's buffer) was used without its buffer, or
    /// cannot be lent.
    #[error("lent parameter {param}: {reason}")]
    Lent {
        /// The parameter.
        param: String,
        /// What is wrong.
        reason: String,
    },
    /// A gradient for a quantized accumulator holds a non-finite value (it cannot be stored).
    #[error(
        "parameter {param}: the gradient holds a non-finite value, which a quantized accumulator cannot hold"
    )]
    NonFiniteGradient {
        /// The parameter.
        param: String,
    },
    /// A step was asked for while the parameters hold their evaluation point
    /// (`Optimizer::set_mode` with `Mode::Eval`): `Mode::Train` first.
    #[error(
        "the optimizer is in evaluation mode (parameters hold their evaluation point): call Optimizer::set_mode(Mode::Train, ..) (an integration's train()) before stepping"
    )]
    EvalMode,
    /// Parameters that expect a gradient received none in a step, under
    /// `MissingGradientPolicy::Error`: the step was refused and nothing changed (no parameter,
    /// state or counter moved, no gradient was consumed).
    #[error(
        "step {step}: {count} of {checked} parameters received no gradient: {}; the step was refused and nothing changed. {help}",
        name_list(names, *count)
    )]
    MissingGradient {
        /// The step that was refused (the optimizer's step counter plus one).
        step: u64,
        /// How many parameters received no gradient.
        count: usize,
        /// How many were checked (those that expect a gradient).
        checked: usize,
        /// The first `lpmm_optim::MISSING_NAMES` of their names, in registration order.
        names: Vec<String>,
        /// Likely causes and what to do.
        help: String,
    },
    /// The backend failed (device lost, out of memory, unsupported, driver error).
    #[error(transparent)]
    Backend(BackendError),
    /// An error from the quantization layer.
    #[error(transparent)]
    Quant(#[from] QuantError),
}

/// `names` joined by commas, with how many more of `count` there are.
pub(crate) fn name_list(names: &[String], count: usize) -> String {
    let mut list = names.join(", ");
    if count > names.len() {
        list.push_str(&format!(" and {} more", count - names.len()));
    }
    list
}

/// Why a backend operation failed. After a device is lost every later call returns the same
/// error; nothing panics.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The device is gone (driver reset, device removed, a previous fatal error).
    #[error("the {backend} device was lost: {reason}")]
    DeviceLost {
        /// The backend.
        backend: &'static str,
        /// What the driver said.
        reason: String,
    },
    /// An allocation failed.
    #[error("the {backend} device is out of memory ({bytes} bytes asked for)")]
    OutOfMemory {
        /// The backend.
        backend: &'static str,
        /// The size of the failed allocation.
        bytes: u64,
    },
    /// The backend cannot hold or run this ([docs/BACKENDS.md] lists what each supports).
    ///
    /// [docs/BACKENDS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/BACKENDS.md
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        /// The backend.
        backend: &'static str,
        /// What was asked.
        what: String,
    },
    /// Host contents do not fit a slot (layout, length, non-finite values).
    #[error("{slot} slot: {reason}")]
    SlotMismatch {
        /// The slot.
        slot: &'static str,
        /// What does not fit.
        reason: String,
    },
    /// A caller's buffer does not fit (dtype, length, device).
    #[error("{what}")]
    Buffer {
        /// What is wrong with it.
        what: String,
    },
    /// A driver call failed.
    #[error("{backend} driver: {what}")]
    Driver {
        /// The backend.
        backend: &'static str,
        /// The call and the driver's message.
        what: String,
        /// The driver's error, where it has one.
        #[source]
        source: Option<std::sync::Arc<dyn std::error::Error + Send + Sync>>,
    },
}
