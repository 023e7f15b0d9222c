//! The words every layer of the crate shares: a parameter's slots and id, the element types of
//! stored regions, the limits a stored value must fit, and the piece sizes the CPU reference
//! and the formats agree on. It imports nothing from the crate (docs/ARCHITECTURE.md, "Layers").

/// Slots per parameter: the parameter, its gradient accumulator and three states.
pub const SLOTS: usize = 5;

/// A registered parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub(crate) usize);

impl ParamId {
    /// The parameter's index in registration order.
    pub fn index(self) -> usize {
        self.0
    }
}

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
    /// State 3 (AdEMAMix's slow first moment, CAME's instability).
    State3 = 4,
}

impl SlotKind {
    /// All of them, in checkpoint order.
    pub const ALL: [SlotKind; SLOTS] = [
        SlotKind::Param,
        SlotKind::Grad,
        SlotKind::State1,
        SlotKind::State2,
        SlotKind::State3,
    ];

    /// The slot's name in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            SlotKind::Param => "param",
            SlotKind::Grad => "grad",
            SlotKind::State1 => "state1",
            SlotKind::State2 => "state2",
            SlotKind::State3 => "state3",
        }
    }
}

/// The element type of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    Bf16,
    /// 16-bit unsigned integers.
    U16,
    /// Bytes (packed codes).
    U8,
    /// 32-bit unsigned integers.
    U32,
}

impl Dtype {
    /// Bytes per value.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::U32 => 4,
            Dtype::Bf16 | Dtype::U16 => 2,
            Dtype::U8 => 1,
        }
    }

    /// The name in checkpoints and messages ("f32", "bf16", ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::U16 => "u16",
            Dtype::U8 => "u8",
            Dtype::U32 => "u32",
        }
    }
}

/// The bit pattern of `f32::MAX`: the limit of a format that stores every finite f32.
pub const F32_MAX_BITS: u32 = 0x7F7F_FFFF;

/// Whether `x` is finite and at most `limit` (an f32 bit pattern) in magnitude: one comparison
/// of the bits with the sign cleared (NaN and ±Inf patterns exceed every finite one). The same
/// test in the kernels (`fits`).
#[inline(always)]
pub fn fits(x: f32, limit: u32) -> bool {
    x.to_bits() & 0x7FFF_FFFF <= limit
}

/// Elements the fused step handles at a time: a multiple of every block size (all are powers of
/// two up to 4096), so every slot's blocks fall whole inside a chunk.
pub(crate) const CHUNK: usize = 4096;

/// Elements of a tile: the stash holds one tile of the gradient, the parameter, each state and
/// the increments (2 KiB each, 12 KiB in all; with the random draws, the codes and the next
/// tile prefetched, within L1: 512 measured faster than 256 and 1024).
pub(crate) const TILE: usize = 512;
