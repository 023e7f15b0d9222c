//! Storage formats as data: one file per format, each implementing [`Codec`] — the regions the
//! format stores (their dtype and how a tensor's elements map onto them), its CPU chunk decode,
//! encode and clear (the reference every backend reproduces), the checks on loaded contents, and
//! the parameters its GPU kernels read. The registry at the bottom generates [`Format`] and the
//! dispatch; the kernels' dispatch (`fmt_<name>_load`, `..._store`, ...) is generated from the
//! same registry by `cargo xtask codegen`.
//!
//! A slot's canonical host contents ([`HostSlot`]) are its saved regions in the order the format
//! lists them, as little-endian bytes: checkpoints, sharding (cutting and joining), moving state
//! between backends and the conformance suite's bit comparison all work on regions and never
//! match on formats.

mod storage;

pub use storage::{MapKind, Storage, StoreRounding};

use std::sync::atomic::{AtomicU32, Ordering};

use lpmm_quant::RandomStream;

use crate::rule::RuleConsts;
use crate::vocab::{Dtype, F32_MAX_BITS, SlotKind, fits};

/// How a tensor's elements map onto a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Extent {
    /// `bits` bits per element, packed little-endian in element order (f32: 32, bf16: 16,
    /// codes: their width). Cut with the tensor: elements `a..b` are bits `a*bits .. b*bits`.
    Elements {
        /// Bits per element.
        bits: u32,
    },
    /// One value per block of `block` consecutive elements (the last block may be partial).
    Blocks {
        /// Elements per block.
        block: usize,
    },
    /// A fixed number of values for the whole tensor, never cut (rank-1 maxima, factorized
    /// statistics).
    Tensor {
        /// Values.
        len: usize,
    },
}

/// One region of a slot: a name suffix (the primary region's is empty), its dtype and extent,
/// and whether checkpoints hold it (scratch regions are rebuilt or recomputed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionSpec {
    /// Appended to the slot's name in checkpoints (`""`, `".comp"`, `".absmax"`, ...).
    pub suffix: &'static str,
    /// Element type.
    pub dtype: Dtype,
    /// How elements map onto it.
    pub extent: Extent,
    /// Whether checkpoints and the canonical layout hold it.
    pub saved: bool,
}

impl RegionSpec {
    const fn new(suffix: &'static str, dtype: Dtype, extent: Extent) -> Self {
        RegionSpec {
            suffix,
            dtype,
            extent,
            saved: true,
        }
    }

    const fn scratch(suffix: &'static str, dtype: Dtype, len: usize) -> Self {
        RegionSpec {
            suffix,
            dtype,
            extent: Extent::Tensor { len },
            saved: false,
        }
    }

    /// Whether the region is cut with the tensor (one per piece or shard) rather than held once.
    pub fn per_element(&self) -> bool {
        !matches!(self.extent, Extent::Tensor { .. })
    }

    /// Bytes for `n` elements (elements `0..n`; a tensor-wide region ignores `n`).
    pub fn bytes(&self, n: usize) -> usize {
        self.byte_range(0, n).end
    }

    /// Values for `n` elements.
    pub fn len(&self, n: usize) -> usize {
        self.bytes(n) / self.dtype.size()
    }

    /// 32-bit words for `n` elements (device regions and CPU storage are word-aligned).
    pub fn words(&self, n: usize) -> usize {
        self.bytes(n).div_ceil(4)
    }

    /// The bytes of elements `a..b` (`a` a multiple of the slot's alignment; a tensor-wide
    /// region is always whole).
    pub fn byte_range(&self, a: usize, b: usize) -> std::ops::Range<usize> {
        let size = self.dtype.size();
        match self.extent {
            Extent::Elements { bits } => {
                let bits = bits as usize;
                (a * bits / 8)..(b * bits).div_ceil(8)
            }
            Extent::Blocks { block } => (a / block * size)..(b.div_ceil(block) * size),
            Extent::Tensor { len } => 0..len * size,
        }
    }
}

/// Where a backend keeps one region of a slot: the `k`-th element region (cut with the tensor:
/// one per piece or shard; `Element(0)` is the primary region, a lent parameter's buffer) or the
/// `k`-th tensor-wide region (held once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// The `k`-th element region.
    Element(usize),
    /// The `k`-th tensor-wide region.
    Wide(usize),
}

/// One region of a slot on its way between a backend and the canonical host layout
/// ([`Format::walk`]): what it is, where the backend keeps it, and (importing) its canonical
/// bytes — `None` for a scratch region, which checkpoints do not hold.
#[derive(Debug, Clone, Copy)]
pub struct Walked<'h> {
    /// The region.
    pub spec: RegionSpec,
    /// Where the backend keeps it.
    pub place: Place,
    /// Its canonical bytes, when importing a saved region.
    pub bytes: Option<&'h [u8]>,
}

/// One region's contents in the canonical layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRegion {
    /// What the region is.
    pub spec: RegionSpec,
    /// Its values, little-endian.
    pub bytes: Vec<u8>,
}

/// One slot's contents in the canonical host layout (the whole tensor, unsharded): its saved
/// regions in the format's order. Empty for an unallocated slot. The interchange format of
/// checkpoints, shards and backends.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HostSlot {
    /// The saved regions.
    pub regions: Vec<HostRegion>,
}

impl HostSlot {
    /// An unallocated slot.
    pub fn empty() -> Self {
        HostSlot::default()
    }

    /// Whether the slot holds nothing.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// The region with this suffix.
    pub fn region(&self, suffix: &str) -> Option<&HostRegion> {
        self.regions.iter().find(|r| r.spec.suffix == suffix)
    }

    /// The values of the region with this suffix as f32 (for tests and reports).
    pub fn f32s(&self, suffix: &str) -> Option<Vec<f32>> {
        self.region(suffix).map(|r| {
            r.bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
    }
}

/// A slot's regions for one piece of a tensor on the CPU: byte views of the element regions
/// (in the format's order) and the tensor-wide regions.
#[derive(Debug)]
pub(crate) struct Regions<'a> {
    pub elem: [&'a [u8]; MAX_REGIONS],
    pub wide: &'a [Box<[AtomicU32]>],
    /// The tensor index of the piece's element 0 (multi-indices of rank-1 and factorized states).
    pub global: usize,
    /// The tensor's shape.
    pub shape: &'a [usize],
}

/// Writable element regions of one piece (tensor-wide regions are written through atomics).
#[derive(Debug)]
pub(crate) struct RegionsMut<'a> {
    pub elem: [&'a mut [u8]; MAX_REGIONS],
    pub wide: &'a [Box<[AtomicU32]>],
    pub global: usize,
    pub shape: &'a [usize],
}

/// Element regions a format may have.
pub(crate) const MAX_REGIONS: usize = 3;

/// The random bits of a stochastic store: element `j` of the values uses the draw of element
/// `index + j` of `stream` ([`RandomStream::draws_at`]; `index`: the element's logical index in
/// the whole tensor).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Random {
    pub stream: RandomStream,
    pub index: u64,
}

/// A fold pass of a two-phase step (tensor-wide statistics, gathered before the fused pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FoldInput {
    /// The pass folds each element's updated state 2 (the rule applied, nothing stored).
    UpdatedState2,
    /// The pass folds each element's moment input for the slot (the rule's
    /// [`RuleConsts::moment_input`](crate::backend::RuleConsts::moment_input): for a second moment, the gradient it sees).
    MomentGradient,
}

/// How the CPU's specialized step kernels (`crate::cpu::tile`) reach a format's values, a tile
/// of elements at a time: what a format that has them gives [`Codec::lanes`]. A format without
/// them is stepped by the generic element-wise path only. Each names its format's lane-level
/// codec ([`lanes`]), the one decode and encode that the format's [`Codec`] implementation
/// calls too.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Lanes {
    /// Plain f32 words (element `j` at bytes `4 j ..`): [`lanes::f32`].
    F32,
    /// bf16 values, rounded to nearest even or stochastically: [`lanes::bf16`].
    Bf16 {
        /// Stochastic rounding ([docs/FORMATS.md] §2) with the slot's draws.
        ///
        /// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
        stochastic: bool,
    },
    /// Split f32: the bf16 high halves, then the 16-bit remainders: [`lanes::split_f32`].
    Split,
    /// Block-wise absmax codes of at most 8 bits, one f32 absmax per block of 32 to 512
    /// elements (the kernels' tile): [`lanes::blockwise`].
    Quantized {
        /// The code map and the block.
        codes: lanes::blockwise::Codes,
        /// Stochastic rounding onto the map with the slot's draws.
        stochastic: bool,
    },
}

/// The lane-level codecs: each format's one decode, encode and clear on the CPU over a run of
/// its elements, in the format's own file. The format's [`Codec`] (the generic chunk path) and
/// the specialized step kernels (`crate::cpu::tile`, through [`Lanes`]) both call them, so the
/// two paths store the same bits by construction.
pub(crate) mod lanes {
    pub(crate) use super::bf16::lanes as bf16;
    pub(crate) use super::blockwise::lanes as blockwise;
    pub(crate) use super::f32::lanes as f32;
    pub(crate) use super::split_f32::lanes as split_f32;
}

impl Lanes {
    /// The byte ranges of the first two element regions that hold elements `a .. b` of a piece.
    pub(crate) fn bytes(&self, a: usize, b: usize) -> [std::ops::Range<usize>; 2] {
        match self {
            Lanes::F32 => [4 * a..4 * b, 0..0],
            Lanes::Bf16 { .. } => [2 * a..2 * b, 0..0],
            Lanes::Split => [2 * a..2 * b, 2 * a..2 * b],
            Lanes::Quantized { codes, .. } => [codes.code_bytes(a, b), codes.scale_bytes(a, b)],
        }
    }

    /// Decodes elements `at .. at + out.len()` of a piece's element regions `elem` (word-aligned:
    /// not a lent buffer) with the format's lane-level decode.
    pub(crate) fn decode(
        &self,
        elem: [&[u8]; MAX_REGIONS],
        at: usize,
        scratch: &mut lanes::blockwise::Scratch,
        out: &mut [f32],
    ) {
        let [r0, r1] = self.bytes(at, at + out.len());
        match self {
            Lanes::F32 => lanes::f32::decode(bytemuck::cast_slice(&elem[0][r0]), out),
            Lanes::Bf16 { .. } => lanes::bf16::decode(bytemuck::cast_slice(&elem[0][r0]), out),
            Lanes::Split => lanes::split_f32::decode(
                bytemuck::cast_slice(&elem[0][r0]),
                bytemuck::cast_slice(&elem[1][r1]),
                out,
            ),
            Lanes::Quantized { codes, .. } => codes.decode(
                &elem[0][r0],
                bytemuck::cast_slice(&elem[1][r1]),
                scratch,
                out,
            ),
        }
    }

    /// Zeroes elements `at .. at + n` of a piece's element regions `elem` (word-aligned) as the
    /// format's [`Codec::clear`] does: a consumed gradient accumulator.
    pub(crate) fn clear(&self, elem: &mut [&mut [u8]; MAX_REGIONS], at: usize, n: usize) {
        let [r0, r1] = self.bytes(at, at + n);
        let [e0, e1, _] = elem;
        match self {
            Lanes::F32 => lanes::f32::clear(bytemuck::cast_slice_mut(&mut e0[r0])),
            Lanes::Bf16 { .. } => lanes::bf16::clear(bytemuck::cast_slice_mut(&mut e0[r0])),
            Lanes::Split => lanes::split_f32::clear(
                bytemuck::cast_slice_mut(&mut e0[r0]),
                bytemuck::cast_slice_mut(&mut e1[r1]),
            ),
            Lanes::Quantized { codes, .. } => {
                codes.clear(&mut e0[r0], bytemuck::cast_slice_mut(&mut e1[r1]))
            }
        }
    }
}

/// The storages of a format that the backend conformance suite steps, declared in its file
/// ([`Codec::COVER`]): `lpmm_optim::testing` builds its storage covers from every format's, so a
/// new format enters the suite with its file.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))] // read by `testing`
pub(crate) struct Cover {
    /// As a parameter.
    pub params: &'static [Storage],
    /// As a gradient accumulator.
    pub grads: &'static [Storage],
    /// As state 1 and state 2 together (a first and a second moment).
    pub states: &'static [(Storage, Storage)],
    /// As a tensor-wide second moment, with the name the suite gives the case.
    pub tensor_wide: &'static [(&'static str, Storage)],
}

impl Cover {
    /// No storage: the rest of a format's cover (`..Cover::NONE`).
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))] // read by `testing`
    pub(crate) const NONE: Cover = Cover {
        params: &[],
        grads: &[],
        states: &[],
        tensor_wide: &[],
    };
}

/// The definition of one storage format.
pub(crate) trait Codec: Copy + std::fmt::Debug + PartialEq + Send + Sync + 'static {
    /// The stem of its kernel files and its name in the kernels' dispatch.
    const NAME: &'static str;
    /// The storages of this format the backend conformance suite steps.
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))] // read by `testing`
    const COVER: Cover;
    /// The largest magnitude (an f32 bit pattern) the format stores without overflow: a value
    /// beyond it (or non-finite) is never stored — registration refuses it, the step leaves the
    /// element unchanged and reports it, a quantized accumulator refuses the micro-batch. f32 and
    /// block-scaled codes hold every finite f32; bf16 what does not round to ±Inf.
    const LIMIT: u32 = F32_MAX_BITS;
    /// The format of `storage`, if it is this one.
    fn from_storage(storage: Storage) -> Option<Self>;
    /// A short name for reports and messages ("bf16-sr", "dynamic_signed_8/b256", ...).
    fn describe(&self) -> String;
    /// Every region (element regions first, then tensor-wide ones) of a tensor of `shape`.
    fn regions(&self, shape: &[usize]) -> Vec<RegionSpec>;
    /// The slots that may use it.
    fn allowed(&self, slot: SlotKind) -> bool;
    /// Subject to the minimum-size policy (kept in f32 below `min_quantized_size`).
    fn quantized(&self) -> bool {
        false
    }
    /// The storage a tensor of `shape` really uses (a fallback for shapes the format cannot hold).
    fn resolve(&self, _shape: &[usize]) -> Option<Storage> {
        None
    }
    /// A shard of the tensor must start at a multiple of this.
    fn alignment(&self) -> usize {
        1
    }
    /// Whether storing draws random bits.
    fn stochastic(&self) -> bool {
        false
    }
    /// The dtype of the primary region, if a caller's tensor of that dtype can be it.
    fn lendable(&self) -> Option<Dtype> {
        None
    }
    /// Whether it can hold ±Inf and NaN (float formats): a gradient accumulator that cannot
    /// refuses a micro-batch whose sum would not fit.
    fn holds_non_finite(&self) -> bool {
        false
    }
    /// Whether its primary region is the f32 values themselves, element `j` at bytes
    /// `4 j .. 4 j + 4`, so that `decode` and `encode` are copies: the CPU step then updates
    /// them in place instead of copying them into its scratch and back.
    fn plain_f32(&self) -> bool {
        false
    }
    /// How the CPU's specialized step kernels reach its values (`None`: only the generic path
    /// steps it).
    fn lanes(&self) -> Option<Lanes> {
        None
    }
    /// The format's parameters as its kernels read them.
    fn kernel_aux(&self) -> u32 {
        0
    }
    /// The code map it stores codes of (checkpoints record the maps in use).
    fn map(&self) -> Option<MapKind> {
        None
    }
    /// The fold passes of a two-phase step (none for element-wise formats).
    fn folds(&self) -> &'static [FoldInput] {
        &[]
    }
    /// Checks loaded contents (lengths are checked by the caller): scales and, when `values`,
    /// the values themselves must be finite.
    fn validate(&self, host: &HostSlot, values: bool) -> Result<(), String>;
    /// The raw words of freshly allocated element region `k` for `n` elements.
    fn fresh(&self, _k: usize, words: &mut [u32], _n: usize) {
        words.fill(0);
    }

    /// Decodes elements `at .. at + out.len()` of the piece (`at` a multiple of the chunk).
    fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]);
    /// Stores `values` as elements `at ..`.
    fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], random: Random);
    /// Zeroes elements `at .. at + len` (a consumed gradient accumulator).
    fn clear(&self, _r: &mut RegionsMut<'_>, _at: usize, _len: usize) {}
    /// Adds increments `d` to elements `at ..` instead of storing the new values (Kahan); false
    /// if the format stores values.
    fn add(&self, _r: &mut RegionsMut<'_>, _at: usize, _d: &[f32]) -> bool {
        false
    }
    /// Folds `values` (elements `at ..` of the piece) into the tensor-wide scratch in pass
    /// `pass`, by atomic max or add only, so that the result does not depend on the order; or
    /// into `local`, this piece's own words for the pass, which [`Codec::fold_flush`] applies
    /// after the piece's last chunk.
    fn fold(
        &self,
        _r: &Regions<'_>,
        _pass: usize,
        _at: usize,
        _values: &[f32],
        _local: &mut crate::fixed::Local,
    ) {
    }
    /// After a piece's folds in pass `pass`: applies what they left in `local`.
    fn fold_flush(&self, _r: &Regions<'_>, _pass: usize, _local: &crate::fixed::Local) {}
    /// The tensor-wide regions the folds accumulate into (zeroed before the first fold).
    fn fold_targets(&self) -> &'static [usize] {
        &[]
    }
    /// After the folds, before the fused pass: turns the folded scratch into the statistics the
    /// fused pass uses (host code, the same for every backend). True if a statistic would not
    /// fit and kept its old value (the step reports the parameter).
    fn combine(
        &self,
        _wide: &[Box<[AtomicU32]>],
        _shape: &[usize],
        _rule: &RuleConsts,
        _slot: SlotKind,
    ) -> bool {
        false
    }
    /// Two tensor-wide regions that trade places after the fused pass (rank-1: the next maxima
    /// become the current ones).
    fn swap_after_step(&self) -> Option<(usize, usize)> {
        None
    }
    /// Recomputes derived scratch after the saved tensor-wide regions were loaded (factorized:
    /// `mean(r)`).
    fn loaded(&self, _wide: &[Box<[AtomicU32]>], _shape: &[usize]) {}
}

/// Views a region's words as bytes, truncated to `n` bytes.
pub(crate) fn bytes_of(words: &[u32], n: usize) -> &[u8] {
    &bytemuck::cast_slice(words)[..n]
}

/// Mutable [`bytes_of`].
pub(crate) fn bytes_of_mut(words: &mut [u32], n: usize) -> &mut [u8] {
    &mut bytemuck::cast_slice_mut(words)[..n]
}

/// Reads word `i` of a tensor-wide region.
#[inline]
pub(crate) fn wide_f32(region: &[AtomicU32], i: usize) -> f32 {
    f32::from_bits(region[i].load(Ordering::Relaxed))
}

/// Writes word `i` of a tensor-wide region.
#[inline]
pub(crate) fn set_wide_f32(region: &[AtomicU32], i: usize, x: f32) {
    region[i].store(x.to_bits(), Ordering::Relaxed);
}

/// Finite check for bf16 bit patterns.
pub(crate) fn bf16_finite(bits: u16) -> bool {
    bits & 0x7F80 != 0x7F80
}

/// The little-endian u16 values of a region.
pub(crate) fn u16s(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
}

/// The little-endian f32 values of a region.
pub(crate) fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// Scales must be finite and non-negative.
pub(crate) fn check_scales(host: &HostSlot, suffix: &str) -> Result<(), String> {
    if let Some(r) = host.region(suffix)
        && let Some(bad) = f32s(&r.bytes).find(|x| !x.is_finite() || *x < 0.0)
    {
        return Err(format!("scale {bad} is not a finite non-negative number"));
    }
    Ok(())
}

macro_rules! formats {
    ($($variant:ident($ty:ident) in $module:ident,)*) => {
        // Each format's file.
        $(mod $module;)*

        #[derive(Debug, Clone, Copy, PartialEq)]
        enum Inner {
            $($variant($module::$ty),)*
        }

        /// A storage format: how one slot is stored (see the module documentation). Built from
        /// a [`Storage`] by [`Format::of`].
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct Format(Inner);

        /// Every format, in kernel-id order: the stems of their kernel files.
        pub const KERNELS: &[&str] = &[$(<$module::$ty as Codec>::NAME,)*];

        /// Every format's [`Format::limit`] as f32 bits, in kernel-id order (the kernels'
        /// `fmt_limit` is generated from it).
        pub const LIMITS: &[u32] = &[$(<$module::$ty as Codec>::LIMIT,)*];

        /// Every format's name and the storages the conformance suite steps it with
        /// ([`Codec::COVER`]), in kernel-id order.
        #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))] // read by `testing`
        pub(crate) const COVERS: &[(&str, Cover)] =
            &[$((<$module::$ty as Codec>::NAME, <$module::$ty as Codec>::COVER),)*];

        impl Format {
            /// The format of `storage` (`None` for [`Storage::None`]).
            pub fn of(storage: Storage) -> Option<Format> {
                $(
                    if let Some(c) = <$module::$ty as Codec>::from_storage(storage) {
                        return Some(Format(Inner::$variant(c)));
                    }
                )*
                None
            }

            /// The format's id in the kernels (its index in [`KERNELS`]), from 1 (0: no slot).
            pub fn kernel_id(&self) -> u32 {
                let mut k = 1u32;
                $(
                    if let Inner::$variant(_) = self.0 {
                        return k;
                    }
                    k += 1;
                )*
                k
            }

            /// A short name for reports and messages.
            pub fn describe(&self) -> String {
                match &self.0 { $(Inner::$variant(c) => c.describe(),)* }
            }

            /// The format's name (its kernel stem).
            pub fn name(&self) -> &'static str {
                match self.0 { $(Inner::$variant(_) => <$module::$ty as Codec>::NAME,)* }
            }

            /// Every region of a tensor of `shape`: element regions first, then tensor-wide ones.
            pub fn regions(&self, shape: &[usize]) -> Vec<RegionSpec> {
                match &self.0 { $(Inner::$variant(c) => c.regions(shape),)* }
            }

            /// Every region of a tensor of `shape` in the format's order, each with where a
            /// backend keeps it and its bytes in `host` (the canonical contents being imported;
            /// `None` when exporting): the one walk of export and import on every backend, so
            /// that canonical contents pair with regions the same way everywhere.
            pub fn walk<'h>(&self, shape: &[usize], host: Option<&'h HostSlot>) -> Vec<Walked<'h>> {
                let mut saved = host.map(|h| h.regions.iter());
                let (mut e, mut w) = (0, 0);
                self.regions(shape)
                    .into_iter()
                    .map(|spec| {
                        let place = if spec.per_element() {
                            e += 1;
                            Place::Element(e - 1)
                        } else {
                            w += 1;
                            Place::Wide(w - 1)
                        };
                        let bytes = match &mut saved {
                            Some(regions) if spec.saved => regions.next().map(|r| &r.bytes[..]),
                            _ => None,
                        };
                        Walked { spec, place, bytes }
                    })
                    .collect()
            }

            /// The code map it stores codes of, if any.
            pub fn map(&self) -> Option<MapKind> {
                match &self.0 { $(Inner::$variant(c) => c.map(),)* }
            }

            /// Whether it keeps tensor-wide statistics (folded in a two-phase step): such a slot
            /// is never cut into shards.
            pub fn tensor_wide(&self) -> bool {
                !self.folds().is_empty()
            }

            /// How the CPU's specialized step kernels reach its values.
            pub(crate) fn lanes(&self) -> Option<Lanes> {
                match &self.0 { $(Inner::$variant(c) => c.lanes(),)* }
            }

            /// The format's parameters as the kernels read them.
            pub fn kernel_aux(&self) -> u32 {
                match &self.0 { $(Inner::$variant(c) => c.kernel_aux(),)* }
            }

            /// Whether storing draws random bits.
            pub fn stochastic(&self) -> bool {
                match &self.0 { $(Inner::$variant(c) => c.stochastic(),)* }
            }

            /// The dtype a caller's tensor must have to be the primary region.
            pub fn lendable(&self) -> Option<Dtype> {
                match &self.0 { $(Inner::$variant(c) => c.lendable(),)* }
            }

            /// The largest magnitude it stores without overflow (every finite f32 for f32 and
            /// block-scaled codes; [docs/FORMATS.md] gives each format's).
            ///
            /// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
            pub fn limit(&self) -> f32 {
                f32::from_bits(self.limit_bits())
            }

            /// [`Format::limit`] as f32 bits.
            pub fn limit_bits(&self) -> u32 {
                match &self.0 { $(Inner::$variant(_) => <$module::$ty as Codec>::LIMIT,)* }
            }

            /// Whether it holds ±Inf and NaN (f32, bf16): a gradient accumulator that does not
            /// refuses a micro-batch whose sum would not fit it.
            pub fn holds_non_finite(&self) -> bool {
                match &self.0 { $(Inner::$variant(c) => c.holds_non_finite(),)* }
            }

            /// Whether its primary region holds the f32 values themselves (see
            /// `Codec::plain_f32`).
            pub(crate) fn plain_f32(&self) -> bool {
                match &self.0 { $(Inner::$variant(c) => c.plain_f32(),)* }
            }

            /// The fold passes of a two-phase step.
            pub fn folds(&self) -> &'static [FoldInput] {
                match &self.0 { $(Inner::$variant(c) => c.folds(),)* }
            }

            /// The raw words of freshly allocated element region `k` for `n` elements.
            pub fn fresh(&self, k: usize, words: &mut [u32], n: usize) {
                match &self.0 { $(Inner::$variant(c) => c.fresh(k, words, n),)* }
            }

            /// Checks canonical contents against the format (layout, lengths for a tensor of
            /// `shape` with `n` elements, finite scales; finite values when `values`).
            pub fn validate(&self, host: &HostSlot, shape: &[usize], n: usize, values: bool) -> Result<(), String> {
                let specs: Vec<RegionSpec> = self.regions(shape).into_iter().filter(|s| s.saved).collect();
                if host.regions.len() != specs.len()
                    || host.regions.iter().zip(&specs).any(|(h, s)| h.spec != *s || h.bytes.len() != s.bytes(n))
                {
                    return Err("stored layout or length does not match the configuration".into());
                }
                match &self.0 { $(Inner::$variant(c) => c.validate(host, values),)* }
            }

            /// Allowed in `slot`.
            pub(crate) fn allowed(&self, slot: SlotKind) -> bool {
                match &self.0 { $(Inner::$variant(c) => c.allowed(slot),)* }
            }
            pub(crate) fn quantized(&self) -> bool {
                match &self.0 { $(Inner::$variant(c) => c.quantized(),)* }
            }
            pub(crate) fn resolve(&self, shape: &[usize]) -> Option<Storage> {
                match &self.0 { $(Inner::$variant(c) => c.resolve(shape),)* }
            }
            pub(crate) fn alignment(&self) -> usize {
                match &self.0 { $(Inner::$variant(c) => c.alignment(),)* }
            }
            pub(crate) fn decode(&self, r: &Regions<'_>, at: usize, out: &mut [f32]) {
                match &self.0 { $(Inner::$variant(c) => c.decode(r, at, out),)* }
            }
            pub(crate) fn encode(&self, r: &mut RegionsMut<'_>, at: usize, values: &[f32], random: Random) {
                match &self.0 { $(Inner::$variant(c) => c.encode(r, at, values, random),)* }
            }
            pub(crate) fn clear(&self, r: &mut RegionsMut<'_>, at: usize, len: usize) {
                match &self.0 { $(Inner::$variant(c) => c.clear(r, at, len),)* }
            }
            pub(crate) fn add(&self, r: &mut RegionsMut<'_>, at: usize, d: &[f32]) -> bool {
                match &self.0 { $(Inner::$variant(c) => c.add(r, at, d),)* }
            }
            pub(crate) fn fold(&self, r: &Regions<'_>, pass: usize, at: usize, values: &[f32], local: &mut crate::fixed::Local) {
                match &self.0 { $(Inner::$variant(c) => c.fold(r, pass, at, values, local),)* }
            }
            pub(crate) fn fold_flush(&self, r: &Regions<'_>, pass: usize, local: &crate::fixed::Local) {
                match &self.0 { $(Inner::$variant(c) => c.fold_flush(r, pass, local),)* }
            }
            /// The tensor-wide regions (indices among the tensor-wide ones) the folds accumulate
            /// into: zero them before the first fold.
            pub fn fold_targets(&self) -> &'static [usize] {
                match &self.0 { $(Inner::$variant(c) => c.fold_targets(),)* }
            }
            /// After the folds: turns the folded tensor-wide regions of `slot` into the
            /// statistics the fused pass reads (host code shared by every backend; `wide` holds
            /// every tensor-wide region of the slot, as words; the rule says the moving average,
            /// [`RuleConsts::moment`]). True if a statistic would not fit and kept its old value:
            /// the backend reports the parameter as it reports elements left unchanged.
            pub fn combine(&self, wide: &[Box<[AtomicU32]>], shape: &[usize], rule: &RuleConsts, slot: SlotKind) -> bool {
                match &self.0 { $(Inner::$variant(c) => c.combine(wide, shape, rule, slot),)* }
            }
            /// Two tensor-wide regions that trade places after the fused pass.
            pub fn swap_after_step(&self) -> Option<(usize, usize)> {
                match &self.0 { $(Inner::$variant(c) => c.swap_after_step(),)* }
            }
            /// Recomputes derived tensor-wide scratch after a load.
            pub fn loaded(&self, wide: &[Box<[AtomicU32]>], shape: &[usize]) {
                match &self.0 { $(Inner::$variant(c) => c.loaded(wide, shape),)* }
            }
        }
    };
}

// The registry: one line per format, in kernel-id order (ids start at 1).
formats! {
    F32(F32) in f32,
    Bf16(Bf16) in bf16,
    Kahan(Kahan) in kahan,
    SplitF32(SplitF32) in split_f32,
    Blockwise(Blockwise) in blockwise,
    Rank1(Rank1) in rank1,
    Factored(Factored) in factored,
    Bf16Plus8(Bf16Plus8) in bf16_plus8,
}
