//! The kernel ABI: everything the host and the kernels must agree on, defined once here and
//! written out for WGSL and CUDA C by `cargo xtask codegen` ([`crate::codegen`]). The generated
//! files are committed; a test in each backend fails, naming the command, when they are stale.
//!
//! A launch covers a list of *items* (a range of at most [`TILE`]-aligned elements of one
//! parameter piece), each described by a [`Desc`]. Item `k` owns tiles `tile_begin[k] ..
//! tile_begin[k + 1]`; a tile is [`TILE`] consecutive elements handled by one workgroup (block)
//! of [`THREADS`] threads, thread `t` owning elements `PER * t .. PER * t + PER` of the tile.
//! [`PER`] = 16 is a multiple of every packing (bf16 pairs, 8- and 4-bit codes), so every
//! storage word belongs to one thread, and 16 elements are one ChaCha block of random words.

use bytemuck::{Pod, Zeroable};
use lpmm_optim::MapKind;
use lpmm_optim::backend::{MAX_STATS, SLOTS};

/// Elements per tile (the CPU's chunk): every quantization block divides it.
pub const TILE: u32 = 4096;
/// Elements per thread.
pub const PER: u32 = 16;
/// Threads per tile.
pub const THREADS: u32 = TILE / PER;
/// Regions a slot's descriptor addresses (element regions first, then tensor-wide ones).
pub const SLOT_REGIONS: usize = 5;
/// 32-bit words of rule constants a descriptor carries.
pub const CONST_WORDS: usize = 16;
/// Dimensions a descriptor's shape carries (rank-1 states: up to this many).
pub const MAX_DIMS: usize = 8;

/// [`Desc::flags`]: the parameter's first step.
pub const F_FIRST: u32 = lpmm_optim::backend::StepFlags::FIRST;
/// [`Desc::flags`]: the parameter moves (not optimizer accumulation).
pub const F_UPDATE_PARAM: u32 = lpmm_optim::backend::StepFlags::UPDATE_PARAM;
/// [`Desc::flags`]: state 2 is given (a factorized reconstruction) and not updated.
pub const F_GIVEN_V: u32 = lpmm_optim::backend::StepFlags::GIVEN_V;
/// [`Desc::flags`]: state 3 is given (a factorized reconstruction) and not updated.
pub const F_GIVEN_W: u32 = lpmm_optim::backend::StepFlags::GIVEN_W;
/// [`Desc::flags`]: only the parameter moves, by the rule's transform (no gradient, no state).
pub const F_TRANSFORM: u32 = lpmm_optim::backend::StepFlags::TRANSFORM;
/// [`Desc::flags`]: the item has an input (a gradient to add, initial values).
pub const F_INPUT: u32 = 1 << 8;
/// [`Desc::flags`]: the input holds bf16 values (else f32).
pub const F_INPUT_BF16: u32 = 1 << 9;
/// [`Desc::flags`]: decoded values go out as bf16 (else f32).
pub const F_OUTPUT_BF16: u32 = 1 << 10;

/// One slot of an item: its format ([`lpmm_optim::backend::Format::kernel_id`], 0 for none),
/// the format's parameters and the addresses of its regions. An element region's address is
/// that of the item's first element; a tensor-wide region's is the region's start. An address
/// is what the runtime says ([`crate::Runtime::address`]): a pointer on CUDA, a word index and
/// a binding on wgpu.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct SlotDesc {
    /// Format id.
    pub format: u32,
    /// Format parameters.
    pub aux: u32,
    /// Region addresses.
    pub region: [u64; SLOT_REGIONS],
}

/// One item of a launch.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
pub struct Desc {
    /// Elements.
    pub len: u64,
    /// The logical index of element 0 (random words are keyed by it).
    pub key: u64,
    /// The tensor index of element 0 (rank-1 and factorized states index by it).
    pub global: u64,
    /// The parameter's random-stream id (`tensor = stream << 2 | slot`).
    pub stream: u64,
    /// The parameter's and states' stream counter (the step).
    pub step: u64,
    /// The gradient accumulator's stream counter (the accumulate count).
    pub acc: u64,
    /// The seed.
    pub seed: u64,
    /// The first tile of the launch that works on this item.
    pub tile_begin: u64,
    /// Where element 0's input or output value is (an element offset in the io binding on wgpu,
    /// an address on CUDA).
    pub io: u64,
    /// `F_*` bits.
    pub flags: u32,
    /// Which word of the flag buffer a non-finite value sets.
    pub flag_index: u32,
    /// The rule's id ([`lpmm_optim::backend::RuleConsts::kernel_id`]).
    pub rule: u32,
    /// Decode: which slot; fold: which pass.
    pub mode: u32,
    /// Gradients are multiplied by this.
    pub clip: f32,
    /// Dimensions in `shape`.
    pub ndim: u32,
    /// The tensor's shape (rank-1 and factorized states).
    pub shape: [u32; MAX_DIMS],
    /// The rule's constants ([`lpmm_optim::backend::RuleConsts::words`]).
    pub consts: [u32; CONST_WORDS],
    /// The slots: parameter, gradient accumulator, states 1, 2 and 3.
    pub slots: [SlotDesc; SLOTS],
}

/// A kernel entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Entry {
    /// Stores the input values as the parameter (stream counter 0).
    Init = 0,
    /// Adds the input gradient into the accumulator.
    Accumulate = 1,
    /// Decodes slot `mode` into the io binding.
    Decode = 2,
    /// Clears the gradient accumulator.
    Clear = 3,
    /// The fused step.
    Step = 4,
    /// Fold pass `mode` of a two-phase step.
    Fold = 5,
    /// Sets the item's flag if its input holds a non-finite value.
    Check = 6,
}

impl Entry {
    /// Every entry, in id order.
    pub const ALL: [Entry; 7] = [
        Entry::Init,
        Entry::Accumulate,
        Entry::Decode,
        Entry::Clear,
        Entry::Step,
        Entry::Fold,
        Entry::Check,
    ];

    /// The kernel's name.
    pub fn name(self) -> &'static str {
        match self {
            Entry::Init => "lpmm_init",
            Entry::Accumulate => "lpmm_accumulate",
            Entry::Decode => "lpmm_decode",
            Entry::Clear => "lpmm_clear",
            Entry::Step => "lpmm_step",
            Entry::Fold => "lpmm_fold",
            Entry::Check => "lpmm_check",
        }
    }
}

/// Words per parameter of the rule's tensor-wide sums (`RuleConsts::stats`) in the flag buffer,
/// which holds one non-finite flag per parameter, then for each parameter `i` these words at
/// `n + STAT_WORDS * i` (`n` parameters): `MAX_STATS` exponents, then `MAX_STATS` 64-bit sums (low
/// word first), the layout of lpmm-optim's `fixed` folds. A fold pass of the sums (`FOLD_STATS`)
/// gives the item's block in [`Desc::flag_index`]; a step reads back only the `n` flags.
pub const STAT_WORDS: u32 = 3 * MAX_STATS as u32;
/// Where a parameter's sum words start in its block (its exponents start at 0).
pub const STAT_SUM: u32 = MAX_STATS as u32;

/// [`Desc::mode`] of a fold pass: `phase | target << 8 | input << 16`; `target` is the slot
/// whose statistics fold (state 2 or 3) or [`FOLD_STATS`], `input` [`FOLD_UPDATED`] or
/// [`FOLD_MOMENT`] (ignored for the rule's sums).
pub const FOLD_STATS: u32 = 255;
/// A fold pass's input: the slot's updated value (the rule applied, nothing stored).
pub const FOLD_UPDATED: u32 = 0;
/// A fold pass's input: the rule's moment input for the slot.
pub const FOLD_MOMENT: u32 = 1;

/// Where a region lives, for runtimes that bind buffers (wgpu): the binding its address refers
/// to. Runtimes with pointers (CUDA) ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Binding {
    /// The arena of the launch's pieces.
    Arena = 0,
    /// A lent parameter's buffer.
    Lent = 1,
    /// The arena of tensor-wide regions.
    Wide = 2,
}

/// The code-map table the kernels read: map `k`'s 256 values at `MAP_STRIDE * k`, its decision
/// thresholds at `MAP_STRIDE * k + 256` (f32 bits), and its number of values at `MAP_LENS + k`.
pub const MAP_STRIDE: u32 = 512;
/// Where the maps' lengths start in the table.
pub const MAP_LENS: u32 = MAP_STRIDE * MapKind::ALL.len() as u32;

/// Where the maps' search scans start: map `k`'s [`CodeMap::bucket_scan`] at `MAP_SCANS + k`.
///
/// [`CodeMap::bucket_scan`]: lpmm_formats::CodeMap::bucket_scan
pub const MAP_SCANS: u32 = MAP_LENS + MapKind::ALL.len() as u32;
/// Where the maps' search buckets start: map `k`'s [`CodeMap::bucket_starts`] (2^16 bytes, four
/// to a word, little-endian) at `MAP_BUCKETS + k * MAP_BUCKET_WORDS`.
///
/// [`CodeMap::bucket_starts`]: lpmm_formats::CodeMap::bucket_starts
pub const MAP_BUCKETS: u32 = MAP_SCANS + MapKind::ALL.len() as u32;
/// Words of one map's search buckets.
pub const MAP_BUCKET_WORDS: u32 = 1 << (32 - lpmm_formats::CodeMap::BUCKET_SHIFT - 2);
/// Where the maps' key tables start: map `k`'s [`CodeMap::key_table`] at `MAP_KEYS + k *
/// MAP_KEY_WORDS` — its 64 meta entries, one per word, then its at most 512 bucket counts, four
/// to a word, little-endian (all zero for a map without one). The specialized steps copy a map's
/// values, thresholds and key table into shared memory and find a nearest code with two reads
/// and one comparison.
///
/// [`CodeMap::key_table`]: lpmm_formats::CodeMap::key_table
pub const MAP_KEYS: u32 = MAP_BUCKETS + MapKind::ALL.len() as u32 * MAP_BUCKET_WORDS;
/// Words of one map's key table: 64 meta words and 512 bucket counts.
pub const MAP_KEY_WORDS: u32 = 64 + 512 / 4;

/// The table (see [`MAP_STRIDE`], [`MAP_SCANS`], [`MAP_BUCKETS`], [`MAP_KEYS`]).
pub fn map_table() -> Vec<u32> {
    let kinds = MapKind::ALL.len();
    let mut table = vec![0u32; MAP_KEYS as usize + kinds * MAP_KEY_WORDS as usize];
    for kind in MapKind::ALL {
        let k = kind.id() as usize;
        let map = kind.shared();
        let base = MAP_STRIDE as usize * k;
        for (j, v) in map.values().iter().enumerate() {
            table[base + j] = v.to_bits();
        }
        for (j, t) in map.thresholds().iter().enumerate() {
            table[base + 256 + j] = t.to_bits();
        }
        table[MAP_LENS as usize + k] = map.len() as u32;
        table[MAP_SCANS as usize + k] = map.bucket_scan() as u32;
        let buckets = MAP_BUCKETS as usize + k * MAP_BUCKET_WORDS as usize;
        for (j, w) in map.bucket_starts().chunks_exact(4).enumerate() {
            table[buckets + j] = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        }
        if let Some((meta, starts)) = map.key_table() {
            let keys = MAP_KEYS as usize + k * MAP_KEY_WORDS as usize;
            for (j, &m) in meta.iter().enumerate() {
                table[keys + j] = u32::from(m);
            }
            for (j, w) in starts.chunks(4).take(128).enumerate() {
                let mut b = [0u8; 4];
                b[..w.len()].copy_from_slice(w);
                table[keys + 64 + j] = u32::from_le_bytes(b);
            }
        }
    }
    table
}

/// A field of [`Desc`] as the kernels see it: its name, byte offset and type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// The field's name.
    pub name: &'static str,
    /// Its byte offset in [`Desc`].
    pub offset: usize,
    /// Its C type ("uint64_t", "uint32_t", "float"); arrays carry their length.
    pub ty: &'static str,
    /// Array length (1 for a scalar).
    pub len: usize,
}

macro_rules! fields {
    ($($name:ident : $ty:literal $(* $len:expr)?),* $(,)?) => {
        /// Every field of [`Desc`] but `slots`, in memory order.
        pub const DESC_FIELDS: &[Field] = &[$(Field {
            name: stringify!($name),
            offset: std::mem::offset_of!(Desc, $name),
            ty: $ty,
            len: 1 $(* $len)?,
        },)*];
    };
}

fields! {
    len: "uint64_t", key: "uint64_t", global: "uint64_t", stream: "uint64_t", step: "uint64_t",
    acc: "uint64_t", seed: "uint64_t", tile_begin: "uint64_t", io: "uint64_t",
    flags: "uint32_t", flag_index: "uint32_t", rule: "uint32_t", mode: "uint32_t",
    clip: "float", ndim: "uint32_t", shape: "uint32_t" * MAX_DIMS,
    consts: "uint32_t" * CONST_WORDS,
}

/// The byte offset of [`Desc::slots`].
pub const SLOTS_OFFSET: usize = std::mem::offset_of!(Desc, slots);

const _: () = assert!(std::mem::size_of::<SlotDesc>() == 8 + 8 * SLOT_REGIONS);
const _: () = assert!(SLOTS_OFFSET.is_multiple_of(8));
const _: () =
    assert!(std::mem::size_of::<Desc>() == SLOTS_OFFSET + SLOTS * std::mem::size_of::<SlotDesc>());
