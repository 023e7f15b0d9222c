//! What a user names to choose a slot's format: [`Storage`], the code maps by name ([`MapKind`])
//! and the rounding ([`StoreRounding`]). [`Format::of`] turns a storage into its format.

use lpmm_formats::CodeMap;
use lpmm_quant::BlockSize;
use serde::{Deserialize, Serialize};

use super::Format;

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
#[serde(deny_unknown_fields)]
pub enum Storage {
    /// Nothing stored (gradient slot only): gradients arrive with `Step::param` or
    /// `Step::states_only` (gradient release) and no accumulator is allocated.
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
    /// 24-bit master weights: bf16 plus an 8-bit correction of its rounding error (3 bytes;
    /// parameters only): an f32 rounded to 24 bits (15 mantissa bits), to nearest or
    /// stochastically, whose bf16 half a bf16 forward pass reads as the parameter.
    Bf16Plus8(StoreRounding),
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
