//! What a user configures per parameter tensor: the storage format of each slot (parameter,
//! gradient accumulator, optimizer states) and the optimizer's hyperparameters.

use lpmm_formats::CodeMap;
use lpmm_quant::BlockSize;
use serde::{Deserialize, Serialize};

use crate::backend::{SLOTS, SlotKind};
use crate::error::OptimError;
use crate::format::Format;
use crate::rule::Hyper;

/// A code map by name, so configurations and checkpoints can say which one a slot uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MapKind {
    /// bitsandbytes' signed 8-bit dynamic map (first moments, momentum).
    DynamicSigned8,
    /// bitsandbytes' unsigned 8-bit dynamic map (second moments).
    DynamicUnsigned8,
    /// lpmm's / torchao's signed 4-bit dynamic-exponent map (4-bit first moments).
    DynamicExponentSigned4,
    /// lpmm's 4-bit linear map without zero (4-bit second moments).
    LinearWithoutZero4,
    /// The symmetric 8-bit linear map `k/127` (the LPMM parameter, gradient and momentum format).
    LinearSigned8,
}

impl MapKind {
    /// Every built-in map, in id order: the one list that map tables, kernels' map layout and
    /// checkpoints derive counts and offsets from.
    pub const ALL: [MapKind; 5] = [
        MapKind::DynamicSigned8,
        MapKind::DynamicUnsigned8,
        MapKind::DynamicExponentSigned4,
        MapKind::LinearWithoutZero4,
        MapKind::LinearSigned8,
    ];

    /// The map's id: its index in [`MapKind::ALL`].
    pub fn id(self) -> u32 {
        Self::ALL.iter().position(|&m| m == self).unwrap_or(0) as u32
    }

    /// The map, built once per process and shared by every slot that uses it.
    pub fn shared(self) -> &'static CodeMap {
        use std::sync::OnceLock;
        static MAPS: [OnceLock<CodeMap>; MapKind::ALL.len()] =
            [const { OnceLock::new() }; MapKind::ALL.len()];
        MAPS[self.id() as usize].get_or_init(|| self.build())
    }

    /// Builds the map.
    pub fn build(self) -> CodeMap {
        let map = match self {
            MapKind::DynamicSigned8 => CodeMap::dynamic(true, 8),
            MapKind::DynamicUnsigned8 => CodeMap::dynamic(false, 8),
            MapKind::DynamicExponentSigned4 => CodeMap::dynamic(true, 4),
            MapKind::LinearWithoutZero4 => CodeMap::linear_without_zero(4),
            MapKind::LinearSigned8 => CodeMap::linear_signed(8),
        };
        map.expect("built-in maps are valid")
    }

    /// The map's name in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            MapKind::DynamicSigned8 => "dynamic_signed_8",
            MapKind::DynamicUnsigned8 => "dynamic_unsigned_8",
            MapKind::DynamicExponentSigned4 => "dynamic_exponent_signed_4",
            MapKind::LinearWithoutZero4 => "linear_without_zero_4",
            MapKind::LinearSigned8 => "linear_signed_8",
        }
    }

    /// The map with this checkpoint name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Whether the map holds negative values.
    pub fn signed(self) -> bool {
        !matches!(
            self,
            MapKind::DynamicUnsigned8 | MapKind::LinearWithoutZero4
        )
    }
}

/// How a value is rounded when it is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StoreRounding {
    /// Round to nearest (ties to even for floats, the map's tie rule for codes).
    Nearest,
    /// Stochastic rounding with counter-based random bits: unbiased, so updates smaller than
    /// the storage's resolution survive in expectation.
    Stochastic,
}

/// How one slot of model memory (parameter, gradient accumulator or optimizer state) is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Storage {
    /// Nothing stored (gradient slot only): gradients arrive with `step_param` or
    /// `accumulate_states` (gradient release) and no accumulator is allocated.
    None,
    /// 4 bytes per element.
    F32,
    /// 2 bytes per element.
    Bf16(StoreRounding),
    /// bf16 plus a bf16 Kahan compensation (4 bytes; parameters only).
    Bf16Kahan,
    /// bf16 plus a 16-bit remainder: exactly f32, 4 bytes, of which the bf16 half is readable
    /// as the parameter by a bf16 forward pass (parameters only).
    SplitF32,
    /// Block-wise absmax quantization onto a code map.
    Quantized {
        /// The code map.
        map: MapKind,
        /// Elements per absmax scale.
        #[serde(with = "block_size")]
        block: BlockSize,
        /// Rounding onto the map.
        rounding: StoreRounding,
    },
    /// Adafactor's factorized second moment (Shazeer & Stern 2018): only moving averages of the
    /// row and column means of the squared gradient are kept, for the tensor viewed as a matrix
    /// (leading dimensions x last dimension), and `v_ij = (R_i / mean(R)) C_j`. For the slots a
    /// rule averages squares in (Adam's, Adafactor's and CAME's state 2, CAME's state 3); 1-D
    /// tensors keep a full f32 state 2 and no state 3.
    Factorized,
    /// Rank-1 normalized quantization (second moments of 2-D+ tensors; 1-D tensors use blocks of
    /// `fallback`).
    Rank1 {
        /// The code map.
        map: MapKind,
        /// The block size for 1-D tensors.
        #[serde(with = "block_size")]
        fallback: BlockSize,
    },
}

impl Storage {
    /// bitsandbytes' 8-bit first moment as its CPU path stores it: dynamic signed map, blocks of
    /// 256, nearest, without the sign fix (bitsandbytes' CUDA kernels move a momentum that rounds
    /// to the code of 0 to the smallest code of its sign; lpmm keeps the nearest code, on every
    /// backend: [docs/FORMATS.md] §6).
    ///
    /// [docs/FORMATS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/FORMATS.md
    pub const DYNAMIC8_SIGNED: Storage = Storage::Quantized {
        map: MapKind::DynamicSigned8,
        block: BlockSize::B256,
        rounding: StoreRounding::Nearest,
    };
    /// bitsandbytes' 8-bit second moment: dynamic unsigned map, blocks of 256, nearest.
    pub const DYNAMIC8_UNSIGNED: Storage = Storage::Quantized {
        map: MapKind::DynamicUnsigned8,
        block: BlockSize::B256,
        rounding: StoreRounding::Nearest,
    };
    /// lpmm's 4-bit first moment: signed dynamic-exponent map, blocks of 128.
    pub const FOUR_BIT_SIGNED: Storage = Storage::Quantized {
        map: MapKind::DynamicExponentSigned4,
        block: BlockSize::B128,
        rounding: StoreRounding::Nearest,
    };
    /// lpmm's 4-bit second moment: linear without zero, blocks of 128.
    pub const FOUR_BIT_UNSIGNED: Storage = Storage::Quantized {
        map: MapKind::LinearWithoutZero4,
        block: BlockSize::B128,
        rounding: StoreRounding::Nearest,
    };
    /// The LPMM format: 8-bit linear, groups of 64, stochastic rounding.
    pub const LINEAR8_GROUP64_SR: Storage = Storage::Quantized {
        map: MapKind::LinearSigned8,
        block: BlockSize::B64,
        rounding: StoreRounding::Stochastic,
    };

    /// Whether this storage is quantized (subject to the minimum-size policy).
    pub fn is_quantized(self) -> bool {
        Format::of(self).is_some_and(|f| f.quantized())
    }

    /// The format that stores it (`None` for [`Storage::None`]).
    pub fn format(self) -> Option<Format> {
        Format::of(self)
    }

    /// A short name for reports and checkpoints.
    pub fn describe(self) -> String {
        self.format()
            .map_or_else(|| "none".into(), |f| f.describe())
    }
}

/// Everything that decides how one parameter tensor is stored and stepped. Made from a preset
/// ([`crate::presets`]) or [`ParamConfig::f32`], then changed with the `with_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ParamConfig {
    /// The optimizer and its hyperparameters.
    pub hyper: Hyper,
    /// How the parameter is stored.
    pub param: Storage,
    /// How the gradient accumulator is stored.
    pub grad: Storage,
    /// How the first state (momentum / first moment) is stored.
    pub state1: Storage,
    /// How the second state (Adam's second moment) is stored.
    pub state2: Storage,
    /// How the third state (AdEMAMix's slow first moment, CAME's instability) is stored.
    #[serde(default = "f32_storage")]
    pub state3: Storage,
    /// Tensors with fewer elements keep quantized slots in f32 (bitsandbytes' `min_8bit_size`),
    /// decided on the whole tensor, never on a shard.
    pub min_quantized_size: usize,
}

impl ParamConfig {
    /// All f32: the reference every low-precision configuration is compared with.
    pub fn f32(hyper: impl Into<Hyper>) -> Self {
        ParamConfig {
            hyper: hyper.into(),
            param: Storage::F32,
            grad: Storage::F32,
            state1: Storage::F32,
            state2: Storage::F32,
            state3: Storage::F32,
            min_quantized_size: 4096,
        }
    }

    /// With update rule and hyperparameters `hyper`.
    pub fn with_hyper(self, hyper: impl Into<Hyper>) -> Self {
        ParamConfig {
            hyper: hyper.into(),
            ..self
        }
    }

    /// With the parameter stored as `s`.
    pub fn with_param(self, s: Storage) -> Self {
        ParamConfig { param: s, ..self }
    }

    /// With the gradient accumulator stored as `s`.
    pub fn with_grad(self, s: Storage) -> Self {
        ParamConfig { grad: s, ..self }
    }

    /// With state 1 (momentum / first moment) stored as `s`.
    pub fn with_state1(self, s: Storage) -> Self {
        ParamConfig { state1: s, ..self }
    }

    /// With state 2 (Adam's second moment) stored as `s`.
    pub fn with_state2(self, s: Storage) -> Self {
        ParamConfig { state2: s, ..self }
    }

    /// With state 3 (AdEMAMix's slow first moment, CAME's instability) stored as `s`.
    pub fn with_state3(self, s: Storage) -> Self {
        ParamConfig { state3: s, ..self }
    }

    /// The storage of `slot`.
    pub fn storage(&self, slot: SlotKind) -> Storage {
        self.slots()[slot as usize]
    }

    /// With minimum quantized size `n` (see the field).
    pub fn with_min_quantized_size(self, n: usize) -> Self {
        ParamConfig {
            min_quantized_size: n,
            ..self
        }
    }

    /// The granularity a shard of a parameter with this (resolved) configuration may start at:
    /// 256 elements, or the largest quantization block of its slots, so that blocks, packed
    /// words, random blocks and the gradient norm's partial sums stay whole on one shard.
    pub fn shard_alignment(&self) -> usize {
        self.slots()
            .iter()
            .filter_map(|s| s.format())
            .map(|f| f.alignment())
            .fold(256, usize::max)
    }

    /// Whether a tensor with this (resolved) configuration may be cut into shards: no slot keeps
    /// tensor-wide statistics and the rule needs no tensor-wide sums (Adafactor's and CAME's
    /// RMS of the update).
    pub fn splittable(&self) -> bool {
        self.slots()
            .iter()
            .zip(SlotKind::ALL)
            .filter(|&(_, slot)| self.hyper.uses(slot))
            .filter_map(|(s, _)| s.format())
            .all(|f| !f.tensor_wide())
            && self.hyper.consts(1, &Default::default()).stats() == 0
    }

    /// The slots' storages: parameter, gradient accumulator, states 1, 2 and 3.
    pub fn slots(&self) -> [Storage; SLOTS] {
        [self.param, self.grad, self.state1, self.state2, self.state3]
    }

    /// The format of each slot of a tensor with this (resolved) configuration: `None` where the
    /// slot is not allocated (no accumulator, states the rule does not use).
    pub fn formats(&self) -> [Option<Format>; SLOTS] {
        let slots = self.slots();
        std::array::from_fn(|k| {
            slots[k]
                .format()
                .filter(|_| self.hyper.uses(SlotKind::ALL[k]))
        })
    }

    /// The storage each slot will really use for a tensor of `numel` elements and `shape`:
    /// quantized slots of tensors below `min_quantized_size` are f32, and a format that cannot
    /// hold the shape falls back (rank-1 states of vectors to blocks, a factorized state 2 to f32;
    /// a factorized state 3, CAME's instability, is not kept for vectors: [`Storage::None`]).
    pub fn resolve(&self, numel: usize, shape: &[usize]) -> ParamConfig {
        let small = numel < self.min_quantized_size;
        let pick = |s: Storage| match s.format() {
            Some(f) if small && f.quantized() => Storage::F32,
            Some(f) => f.resolve(shape).unwrap_or(s),
            None => s,
        };
        let state3 = match self.state3 {
            Storage::Factorized if shape.len() < 2 => Storage::None,
            s => pick(s),
        };
        ParamConfig {
            param: pick(self.param),
            grad: pick(self.grad),
            state1: pick(self.state1),
            state2: pick(self.state2),
            state3,
            ..*self
        }
    }

    /// Checks the hyperparameters and that each slot's storage is allowed there.
    pub fn validate(&self) -> Result<(), OptimError> {
        self.hyper.validate()?;
        for (slot, name) in [(SlotKind::State2, "state2"), (SlotKind::State3, "state3")] {
            if self.storage(slot) == Storage::Factorized && !self.hyper.factorable(slot) {
                return Err(OptimError::StorageNotAllowed {
                    slot: name,
                    storage: format!(
                        "factorized (only an average of squares: Adam's, Adafactor's and CAME's state 2, CAME's state 3; not {})",
                        self.hyper.name()
                    ),
                });
            }
        }
        // CAME's instability is an average of squares the rule only reads as a factorized
        // reconstruction: on a tensor of two or more dimensions it must be factorized.
        if matches!(self.hyper, Hyper::Came(_)) && self.state3 != Storage::Factorized {
            return Err(OptimError::StorageNotAllowed {
                slot: "state3",
                storage: format!(
                    "{} (CAME's instability is factorized)",
                    self.state3.describe()
                ),
            });
        }
        for (kind, name, s) in [
            (SlotKind::Param, "parameter", self.param),
            (SlotKind::Grad, "gradient", self.grad),
            (SlotKind::State1, "state1", self.state1),
            (SlotKind::State2, "state2", self.state2),
            (SlotKind::State3, "state3", self.state3),
        ] {
            let ok = match s.format() {
                None => kind == SlotKind::Grad,
                Some(f) => f.allowed(kind),
            };
            if !ok {
                return Err(OptimError::StorageNotAllowed {
                    slot: name,
                    storage: s.describe(),
                });
            }
        }
        Ok(())
    }
}

/// The default of a field added after checkpoints were first written.
fn f32_storage() -> Storage {
    Storage::F32
}

/// `BlockSize` as its element count in checkpoints, validated when read back.
mod block_size {
    use lpmm_quant::BlockSize;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &BlockSize, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(b.get() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BlockSize, D::Error> {
        let n = u64::deserialize(d)?;
        BlockSize::new(n as usize).map_err(serde::de::Error::custom)
    }
}
