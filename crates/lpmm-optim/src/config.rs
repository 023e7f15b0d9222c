//! What a user configures per parameter tensor: the storage format of each slot (parameter,
//! gradient accumulator, optimizer states) and the optimizer's hyperparameters.

use lpmm_formats::CodeMap;
use lpmm_quant::BlockSize;
use serde::{Deserialize, Serialize};

use crate::error::OptimError;

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
    /// The map, built once per process and shared by every slot that uses it.
    pub fn shared(self) -> &'static CodeMap {
        use std::sync::OnceLock;
        static MAPS: [OnceLock<CodeMap>; 5] = [const { OnceLock::new() }; 5];
        MAPS[self as usize].get_or_init(|| self.build())
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
        [
            MapKind::DynamicSigned8,
            MapKind::DynamicUnsigned8,
            MapKind::DynamicExponentSigned4,
            MapKind::LinearWithoutZero4,
            MapKind::LinearSigned8,
        ]
        .into_iter()
        .find(|m| m.name() == name)
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
    /// (leading dimensions x last dimension), and `v_ij = R_i C_j / mean(R)`. Adam only, state 2
    /// only; 1-D tensors keep a full f32 state.
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
    /// bitsandbytes' 8-bit first moment: dynamic signed map, blocks of 256, nearest.
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
        matches!(
            self,
            Storage::Quantized { .. } | Storage::Rank1 { .. } | Storage::Factorized
        )
    }

    /// A short name for reports and checkpoints.
    pub fn describe(self) -> String {
        match self {
            Storage::None => "none".into(),
            Storage::F32 => "f32".into(),
            Storage::Bf16(StoreRounding::Nearest) => "bf16".into(),
            Storage::Bf16(StoreRounding::Stochastic) => "bf16-sr".into(),
            Storage::Bf16Kahan => "bf16+kahan".into(),
            Storage::SplitF32 => "split-f32".into(),
            Storage::Quantized {
                map,
                block,
                rounding,
            } => format!(
                "{}/b{}{}",
                map.name(),
                block.get(),
                if rounding == StoreRounding::Stochastic {
                    "-sr"
                } else {
                    ""
                }
            ),
            Storage::Rank1 { map, .. } => format!("{}/rank1", map.name()),
            Storage::Factorized => "factorized".into(),
        }
    }
}

/// The optimizer and its hyperparameters. Defaults are PyTorch's. Hyperparameters are f64, as
/// PyTorch's are Python floats: derived factors such as `1 - beta1` are computed in f64 and
/// rounded to f32 once, as PyTorch does.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Hyper {
    /// SGD with momentum, `torch.optim.SGD` semantics.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0 disables the momentum state).
        momentum: f64,
        /// Dampening of the gradient in the momentum update.
        dampening: f64,
        /// Nesterov momentum (needs momentum > 0 and dampening = 0, as in PyTorch).
        nesterov: bool,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
    /// Adam / AdamW.
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay rates of the first and second moments.
        betas: (f64, f64),
        /// Added to the bias-corrected root of the second moment.
        eps: f64,
        /// Weight decay.
        weight_decay: f64,
        /// `true`: AdamW, decay applied to the parameter (`p *= 1 - lr*wd`); `false`: Adam, L2
        /// penalty added to the gradient (`g += wd*p`).
        decoupled: bool,
    },
    /// Lion (Chen et al. 2023; lion-pytorch semantics).
    Lion {
        /// Learning rate.
        lr: f64,
        /// Interpolation (beta1) and momentum decay (beta2).
        betas: (f64, f64),
        /// Decoupled weight decay.
        weight_decay: f64,
    },
}

impl Hyper {
    /// `torch.optim.SGD(lr, momentum)` defaults otherwise.
    pub fn sgd(lr: f64, momentum: f64) -> Self {
        Hyper::Sgd {
            lr,
            momentum,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }

    /// `torch.optim.AdamW(lr)` defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn adamw(lr: f64) -> Self {
        Hyper::Adam {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        }
    }

    /// `torch.optim.Adam(lr)` defaults: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam(lr: f64) -> Self {
        Hyper::Adam {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        }
    }

    /// lion-pytorch defaults: betas (0.9, 0.99), no weight decay.
    pub fn lion(lr: f64) -> Self {
        Hyper::Lion {
            lr,
            betas: (0.9, 0.99),
            weight_decay: 0.0,
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            Hyper::Sgd { lr, .. } | Hyper::Adam { lr, .. } | Hyper::Lion { lr, .. } => lr,
        }
    }

    /// Sets the learning rate.
    pub fn set_lr(&mut self, new: f64) {
        match self {
            Hyper::Sgd { lr, .. } | Hyper::Adam { lr, .. } | Hyper::Lion { lr, .. } => *lr = new,
        }
    }

    /// Number of state slots: 0 (plain SGD), 1 (momentum, Lion) or 2 (Adam).
    pub fn states(&self) -> usize {
        match *self {
            Hyper::Sgd { momentum, .. } => usize::from(momentum != 0.0),
            Hyper::Adam { .. } => 2,
            Hyper::Lion { .. } => 1,
        }
    }

    /// Checks every hyperparameter; an invalid one is a typed error naming it.
    pub fn validate(&self) -> Result<(), OptimError> {
        // Every hyperparameter is used as f32 (or through an f32 factor): it must stay finite
        // there too (lr = 1e39 is finite in f64 and Inf in f32).
        let finite_non_negative = |name: &'static str, v: f64| {
            // A positive value must not round to 0 in f32 either (eps = 1e-50 would).
            if v.is_finite() && v >= 0.0 && (v as f32).is_finite() && (v == 0.0 || v as f32 > 0.0) {
                Ok(())
            } else {
                Err(OptimError::Hyperparameter { name, value: v })
            }
        };
        let beta = |name: &'static str, v: f64| {
            if (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(OptimError::Hyperparameter { name, value: v })
            }
        };
        match *self {
            Hyper::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => {
                finite_non_negative("lr", lr)?;
                finite_non_negative("momentum", momentum)?;
                beta("dampening", dampening)
                    .or_else(|e| if dampening == 1.0 { Ok(()) } else { Err(e) })?;
                finite_non_negative("weight_decay", weight_decay)?;
                if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                    return Err(OptimError::Nesterov);
                }
            }
            Hyper::Adam {
                lr,
                betas,
                eps,
                weight_decay,
                ..
            } => {
                finite_non_negative("lr", lr)?;
                beta("beta1", betas.0)?;
                beta("beta2", betas.1)?;
                finite_non_negative("eps", eps)?;
                finite_non_negative("weight_decay", weight_decay)?;
            }
            Hyper::Lion {
                lr,
                betas,
                weight_decay,
            } => {
                finite_non_negative("lr", lr)?;
                beta("beta1", betas.0).or_else(|e| if betas.0 == 1.0 { Ok(()) } else { Err(e) })?;
                beta("beta2", betas.1)?;
                finite_non_negative("weight_decay", weight_decay)?;
            }
        }
        Ok(())
    }
}

/// Everything that decides how one parameter tensor is stored and stepped.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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
    /// Tensors with fewer elements keep quantized slots in f32 (bitsandbytes' `min_8bit_size`),
    /// decided on the whole tensor, never on a shard.
    pub min_quantized_size: usize,
}

impl ParamConfig {
    /// All f32: the reference every low-precision configuration is compared with.
    pub fn f32(hyper: Hyper) -> Self {
        ParamConfig {
            hyper,
            param: Storage::F32,
            grad: Storage::F32,
            state1: Storage::F32,
            state2: Storage::F32,
            min_quantized_size: 4096,
        }
    }

    /// The granularity a shard of a parameter with this (resolved) configuration may start at:
    /// 256 elements, or the largest quantization block of its slots, so that blocks, packed
    /// words, random blocks and the gradient norm's partial sums stay whole on one shard.
    pub fn shard_alignment(&self) -> usize {
        [self.param, self.grad, self.state1, self.state2]
            .iter()
            .filter_map(|s| match s {
                Storage::Quantized { block, .. } => Some(block.get()),
                _ => None,
            })
            .fold(256, usize::max)
    }

    /// The storage each slot will really use for a tensor of `numel` elements and `shape`:
    /// quantized slots of tensors below `min_quantized_size` are f32, rank-1
    /// second moments of 1-D tensors fall back to blocks / f32.
    pub fn resolve(&self, numel: usize, shape: &[usize]) -> ParamConfig {
        let small = numel < self.min_quantized_size;
        let pick = |s: Storage| {
            if small && s.is_quantized() {
                return Storage::F32;
            }
            match s {
                Storage::Rank1 { map, fallback }
                    if shape.len() < 2 || shape.len() > lpmm_quant::RANK1_MAX_DIMS =>
                {
                    Storage::Quantized {
                        map,
                        block: fallback,
                        rounding: StoreRounding::Nearest,
                    }
                }
                Storage::Factorized if shape.len() < 2 => Storage::F32,
                other => other,
            }
        };
        ParamConfig {
            param: pick(self.param),
            grad: pick(self.grad),
            state1: pick(self.state1),
            state2: pick(self.state2),
            ..*self
        }
    }

    /// Checks the hyperparameters and that each slot's storage is allowed there.
    pub fn validate(&self) -> Result<(), OptimError> {
        self.hyper.validate()?;
        if self.state2 == Storage::Factorized && !matches!(self.hyper, Hyper::Adam { .. }) {
            return Err(OptimError::StorageNotAllowed {
                slot: "state2",
                storage: "factorized (Adam only)".into(),
            });
        }
        let param_only = |slot: &'static str, s: Storage| match s {
            Storage::Bf16Kahan | Storage::SplitF32 => Err(OptimError::StorageNotAllowed {
                slot,
                storage: s.describe(),
            }),
            _ => Ok(()),
        };
        param_only("gradient", self.grad)?;
        for (slot, s) in [
            ("parameter", self.param),
            ("state1", self.state1),
            ("state2", self.state2),
        ] {
            if s == Storage::None {
                return Err(OptimError::StorageNotAllowed {
                    slot,
                    storage: s.describe(),
                });
            }
        }
        param_only("state1", self.state1)?;
        param_only("state2", self.state2)?;
        for (slot, s) in [
            ("parameter", self.param),
            ("gradient", self.grad),
            ("state1", self.state1),
        ] {
            if matches!(s, Storage::Rank1 { .. } | Storage::Factorized) {
                return Err(OptimError::StorageNotAllowed {
                    slot,
                    storage: s.describe(),
                });
            }
        }
        for (slot, s) in [
            ("parameter", self.param),
            ("gradient", self.grad),
            ("state1", self.state1),
        ] {
            if let Storage::Quantized { map, .. } = s
                && !map.signed()
            {
                return Err(OptimError::StorageNotAllowed {
                    slot,
                    storage: s.describe(),
                });
            }
        }
        Ok(())
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
