//! Fuzzing oracles (feature `testing`): what the cargo-fuzz targets in `fuzz/` and the
//! deterministic mutation test (`tests/fuzzing.rs`) run on arbitrary bytes, the seed corpus they
//! start from (a checkpoint of every preset), and the structured mutator of the mutation test.
//! `fuzz/README.md` says how to run them long.
//!
//! The checkpoint oracle's rules ([docs/OPTIMIZERS.md], "Checkpoints"): never panic; a file either
//! loads or is refused with [`crate::OptimError::Checkpoint`]; a file that loads gives an optimizer
//! whose save writes the same tensors and hyperparameters bit for bit, and that file loads too.
//!
//! [docs/OPTIMIZERS.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/OPTIMIZERS.md

use std::collections::HashMap;

use lpmm_quant::{BlockSize, Blockwise, QuantError, QuantRounding, RandomStream};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

use crate::checkpoint::Canonical;
use crate::testing::Rng;
use crate::{
    Adam, Cpu, Hyper, MapKind, Optimizer, OptimizerOptions, ParamConfig, Storage, StoreRounding,
    presets,
};

/// What the checkpoint oracle saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The bytes loaded, and their state survived a save and a load bit for bit.
    Loaded,
    /// The bytes were refused; the reason.
    Refused(String),
}

/// Recomputes a checkpoint's checksum as `save` would, so that a mutated file reaches the checks
/// behind it. `None` if the header or the metadata does not parse.
pub fn reseal(bytes: &[u8]) -> Option<Vec<u8>> {
    crate::checkpoint::reseal(bytes)
}

/// What [`checkpoint`] saw: the bytes as they are, and resealed ([`reseal`]: the checksum
/// recomputed, so that a mutation reaches the checks behind it) where that changes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcomes {
    /// The bytes as they are.
    pub raw: Outcome,
    /// The resealed bytes, if resealing parses and changes them.
    pub resealed: Option<Outcome>,
}

/// The checkpoint loader on arbitrary bytes (the `checkpoint` fuzz target): the bytes as they
/// are, then resealed. Panics if a rule is broken.
pub fn checkpoint(data: &[u8]) -> Outcomes {
    let raw = load_round_trip(data);
    let resealed = reseal(data)
        .filter(|sealed| sealed.as_slice() != data)
        .map(|sealed| load_round_trip(&sealed));
    Outcomes { raw, resealed }
}

/// Loads `bytes` as `Canonical::read(path)?.into_optimizer(Cpu)` does (parse and validate, then
/// build on the CPU), and checks the round trip of whatever loads.
pub fn load_round_trip(bytes: &[u8]) -> Outcome {
    let canonical = match Canonical::from_bytes(bytes) {
        Ok(c) => c,
        Err(e) => return Outcome::Refused(e),
    };
    let first = canonical
        .to_bytes()
        .unwrap_or_else(|e| panic!("a checkpoint that loads must save: {e}"));
    let opt = match canonical.into_optimizer(Cpu) {
        Ok(o) => o,
        Err(e) => panic!("validated, then refused while building (must not happen): {e:?}"),
    };
    let saved = crate::Parts::of(&opt)
        .canonical(None)
        .unwrap_or_else(|e| panic!("a loaded optimizer must export: {e}"))
        .to_bytes()
        .unwrap_or_else(|e| panic!("a loaded optimizer must save: {e}"));
    assert!(
        saved == first,
        "the loaded optimizer's save differs from the file's state"
    );
    let back = Canonical::from_bytes(&saved)
        .unwrap_or_else(|e| panic!("a file save wrote must load: {e}"));
    let again = back.to_bytes().expect("and save again");
    assert!(again == saved, "save, load, save is not the identity");
    Outcome::Loaded
}

/// `Blockwise::quantize` on arbitrary bytes: byte 0 picks the map (low 3 bits), stochastic
/// rounding (bit 6) and the sign fix (bit 7); byte 1 the block size (32 << (b % 8)); the rest are
/// f32 values. A finite negative value into a map without negative values must be refused naming
/// the first one, then a non-finite value naming the first one; otherwise every block's
/// scale is its exact absmax and every decoded value lies within it. Returns whether the values
/// were quantized.
pub fn blockwise(data: &[u8]) -> bool {
    let [head, size, rest @ ..] = data else {
        return false;
    };
    let map = MapKind::ALL[usize::from(head & 7) % MapKind::ALL.len()].shared();
    let block = BlockSize::new(32 << (size % 8)).expect("a power of two in 32..=4096");
    let q = Blockwise::new(map, block).with_sign_fix(head & 0x80 != 0);
    let rounding = if head & 0x40 != 0 {
        QuantRounding::Stochastic {
            stream: RandomStream::new(1, 2, 3),
            offset: u64::from(*size),
        }
    } else {
        QuantRounding::Nearest
    };
    let x: Vec<f32> = rest
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut codes = vec![0u8; q.codes_len(x.len())];
    let mut absmax = vec![0f32; q.scales_len(x.len())];
    let result = q.quantize(&x, &mut codes, &mut absmax, rounding);
    let unsigned = map.values()[0] >= 0.0;
    if let Some(first) = x.iter().position(|&v| unsigned && v < 0.0 && v.is_finite()) {
        match result {
            Err(QuantError::Negative { index, .. }) => assert_eq!(index, first),
            other => panic!("negative element {first} not refused by an unsigned map: {other:?}"),
        }
        return false;
    }
    if let Some(first) = x.iter().position(|v| !v.is_finite()) {
        match result {
            Err(QuantError::NonFinite { index, .. }) => assert_eq!(index, first),
            other => panic!("non-finite element {first} not refused: {other:?}"),
        }
        return false;
    }
    result.expect("finite values quantize");
    let mut out = vec![0f32; x.len()];
    q.dequantize(&codes, &absmax, &mut out)
        .expect("its own codes dequantize");
    for ((xb, ob), &scale) in x
        .chunks(block.get())
        .zip(out.chunks(block.get()))
        .zip(&absmax)
    {
        let max = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(
            max.to_bits(),
            scale.to_bits(),
            "a block's scale is its absmax"
        );
        assert!(
            ob.iter().all(|v| v.abs() <= scale),
            "a decoded value beyond its scale"
        );
    }
    true
}

/// A small model of every preset (and the storages no preset uses: Kahan, rank-1, factorized,
/// a parameter named `maps`), trained two steps with a micro-batch left pending, saved: the seed
/// corpus of the checkpoint fuzzers (`fuzz/corpus/checkpoint/`, regenerated by
/// `LPMM_BLESS=1 cargo test -p lpmm-optim --test fuzzing`).
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let rank1 = Storage::Rank1 {
        map: MapKind::LinearWithoutZero4,
        fallback: BlockSize::B128,
    };
    let small = |c: ParamConfig| c.with_min_quantized_size(256);
    let configs: Vec<(&'static str, ParamConfig)> = vec![
        ("sgdm_f32", presets::sgdm_f32(0.05, 0.9).build()),
        ("lpmm_sgdm", presets::lpmm_sgdm(0.05, 0.9).build()),
        ("adamw_f32", presets::adamw_f32(1e-3).build()),
        ("adamw_8bit", small(presets::adamw_8bit(1e-3).build())),
        (
            "adamw_8bit_bf16",
            small(presets::adamw_8bit_bf16(1e-3).build()),
        ),
        (
            "adamw_8bit_bf16_sr",
            small(presets::adamw_8bit_bf16_sr(1e-3).build()),
        ),
        (
            "adamw_4bit_split",
            small(presets::adamw_4bit_split(1e-3).build()),
        ),
        (
            "bf16_nearest_lion",
            presets::bf16_nearest(Hyper::lion(1e-4)).build(),
        ),
        (
            "adamw_4bit_bf16_sr_released",
            small(presets::adamw_4bit_bf16_sr_released(1e-3).build()),
        ),
        (
            "kahan_rank1",
            small(
                ParamConfig::f32(Hyper::adamw(1e-3))
                    .with_param(Storage::Bf16Kahan)
                    .with_state1(Storage::FOUR_BIT_SIGNED)
                    .with_state2(rank1),
            ),
        ),
        (
            "factorized_adam_l2",
            small(
                ParamConfig::f32(Hyper::Adam(Adam::new(1e-3).weight_decay(1e-2)))
                    .with_grad(Storage::Bf16(StoreRounding::Stochastic))
                    .with_state2(Storage::Factorized),
            ),
        ),
    ];
    configs
        .into_iter()
        .map(|(name, config)| (name, seed(config)))
        .collect()
}

fn seed(config: ParamConfig) -> Vec<u8> {
    let mut opt = Optimizer::new(
        OptimizerOptions::default()
            .with_seed(7)
            .with_max_grad_norm(Some(1.0)),
    )
    .expect("options");
    let g = opt.add_group(config).expect("config");
    let mut rng = Rng::new(1);
    let shapes: [(&str, &[usize]); 3] = [("w", &[16, 48]), ("maps", &[48]), ("b/2", &[5])];
    let ids: Vec<_> = shapes
        .iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let id = opt
                .add_param(name, shape, &rng.spread(n, 0.5), g)
                .expect("param");
            (id, n)
        })
        .collect();
    let released = config.grad == Storage::None;
    for step in 0..3 {
        for &(id, n) in &ids {
            let grad = rng.spread(n, 1.0);
            if released {
                opt.step(crate::Step::param(id, &grad)).expect("step_param");
            } else {
                opt.accumulate(id, &grad).expect("accumulate");
            }
        }
        if step < 2 && !released {
            opt.step(crate::Accumulated).expect("step");
        }
        opt.set_lr(1e-3 / (2.0 + f64::from(step))).expect("lr");
    }
    crate::Parts::of(&opt)
        .canonical(None)
        .expect("canonical")
        .to_bytes()
        .expect("a fresh optimizer saves")
}

/// A checkpoint file taken apart: its metadata JSON and its tensors.
struct Parts {
    json: String,
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
}

fn parts(bytes: &[u8]) -> Option<Parts> {
    let (n, header) = SafeTensors::read_metadata(bytes).ok()?;
    let json = header.metadata().as_ref()?.get("lpmm")?.clone();
    let data = &bytes[8 + n..];
    let tensors = header
        .offset_keys()
        .into_iter()
        .filter_map(|k| {
            let info = header.info(&k)?;
            let (a, b) = info.data_offsets;
            Some((k, info.dtype, info.shape.clone(), data[a..b].to_vec()))
        })
        .collect();
    Some(Parts { json, tensors })
}

fn assemble(p: &Parts) -> Option<Vec<u8>> {
    // safetensors' serializer panics on duplicate names (a container cannot hold them anyway).
    let mut names = std::collections::HashSet::new();
    if !p.tensors.iter().all(|t| names.insert(t.0.as_str())) {
        return None;
    }
    let views = p
        .tensors
        .iter()
        .map(|(k, d, s, b)| TensorView::new(*d, s.clone(), b).map(|v| (k.as_str(), v)))
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let info = HashMap::from([("lpmm".to_string(), p.json.clone())]);
    safetensors::tensor::serialize(views, Some(info)).ok()
}

/// Values a mutation writes where numbers were.
const NUMBERS: &[&str] = &[
    "0",
    "-0.0",
    "1",
    "-1",
    "2",
    "7",
    "255",
    "4096",
    "65536",
    "1e-45",
    "1e-300",
    "0.5",
    "1.0000000000000002",
    "3.4028235e38",
    "3.5e38",
    "1e308",
    "9007199254740992",
    "9007199254740993",
    "18446744073709551615",
    "18446744073709551616",
    "4294967296",
    "null",
    "true",
    "\"x\"",
    "[]",
    "{}",
];

/// Raw f32 patterns a mutation writes into tensors.
const FLOATS: &[u32] = &[
    0x7FC0_0000, // NaN
    0x7F80_0000, // +Inf
    0xFF80_0000, // -Inf
    0x7F7F_FFFF, // f32::MAX
    0x7F7F_8000, // rounds to Inf in bf16
    0x7F00_0000, // 2^127
    0xBF80_0000, // -1
    0x0000_0001, // the smallest subnormal
    0x8000_0000, // -0
];

/// The mutation test's mutator: deterministic, structured (the metadata's JSON text and the
/// tensors, reassembled into a valid container) as well as raw (bytes of the whole file).
#[derive(Debug, Clone)]
pub struct Mutator {
    rng: Rng,
}

impl Mutator {
    /// A mutator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Mutator {
            rng: Rng::new(seed),
        }
    }

    fn below(&mut self, n: usize) -> usize {
        (self.rng.next_u64() % n.max(1) as u64) as usize
    }

    /// One input for [`checkpoint`]: a seed mutated one to four times.
    pub fn next(&mut self, seeds: &[Vec<u8>]) -> Vec<u8> {
        let mut bytes = seeds[self.below(seeds.len())].clone();
        let rounds = 1 + self.below(4);
        for _ in 0..rounds {
            bytes = if self.below(4) == 0 {
                self.raw(bytes, seeds)
            } else {
                self.structured(&bytes).unwrap_or(bytes)
            };
        }
        bytes
    }

    fn raw(&mut self, mut b: Vec<u8>, seeds: &[Vec<u8>]) -> Vec<u8> {
        if b.is_empty() {
            return b;
        }
        let at = self.below(b.len());
        match self.below(7) {
            0 => b[at] ^= 1 << self.below(8),
            1 => b[at] = self.rng.next_u64() as u8,
            2 => {
                let end = (at + 1 + self.below(16)).min(b.len());
                b.drain(at..end);
            }
            3 => {
                let extra: Vec<u8> = (0..1 + self.below(16))
                    .map(|_| self.rng.next_u64() as u8)
                    .collect();
                b.splice(at..at, extra);
            }
            4 => b.truncate(at),
            5 => {
                // Splice the tail of another seed.
                let other = &seeds[self.below(seeds.len())];
                let from = self.below(other.len());
                b.truncate(at);
                b.extend_from_slice(&other[from..]);
            }
            _ => {
                // The 8-byte header length.
                let n = u64::from_le_bytes(b[..8.min(b.len())].try_into().unwrap_or([0; 8]));
                let n = match self.below(3) {
                    0 => n.wrapping_add(1 + self.below(64) as u64),
                    1 => n.wrapping_sub(1 + self.below(64) as u64),
                    _ => self.rng.next_u64(),
                };
                if b.len() >= 8 {
                    b[..8].copy_from_slice(&n.to_le_bytes());
                }
            }
        }
        b
    }

    fn structured(&mut self, bytes: &[u8]) -> Option<Vec<u8>> {
        let mut p = parts(bytes)?;
        match self.below(10) {
            0..=3 => self.json(&mut p.json),
            4 | 5 => {
                // Tensor bytes: a bit flip or a float pattern.
                let k = self.below(p.tensors.len());
                let data = &mut p.tensors.get_mut(k)?.3;
                if data.is_empty() {
                    return None;
                }
                let at = self.below(data.len());
                if self.below(2) == 0 || data.len() < 4 {
                    data[at] ^= 1 << self.below(8);
                } else {
                    let at = at / 4 * 4;
                    let f = FLOATS[self.below(FLOATS.len())];
                    if at + 4 <= data.len() {
                        data[at..at + 4].copy_from_slice(&f.to_le_bytes());
                    }
                }
            }
            6 => {
                // A dtype or a shape.
                let k = self.below(p.tensors.len());
                let (_, dtype, shape, data) = p.tensors.get_mut(k)?;
                let dtypes = [
                    Dtype::U8,
                    Dtype::U16,
                    Dtype::BF16,
                    Dtype::F32,
                    Dtype::U32,
                    Dtype::I32,
                ];
                let d = dtypes[self.below(dtypes.len())];
                let size = d.bitsize() / 8;
                if self.below(2) == 0 && data.len() % size == 0 {
                    *dtype = d;
                    *shape = vec![data.len() / size];
                } else {
                    let n: usize = shape.iter().product();
                    if n.is_multiple_of(2) && n > 0 {
                        *shape = vec![2, n / 2];
                    } else {
                        shape.push(1);
                    }
                }
            }
            7 => {
                // Drop or duplicate a tensor.
                let k = self.below(p.tensors.len());
                if self.below(2) == 0 {
                    p.tensors.remove(k);
                } else {
                    let mut t = p.tensors.get(k)?.clone();
                    t.0.push_str(".extra");
                    p.tensors.push(t);
                }
            }
            8 => {
                // Truncate or extend a tensor (its shape follows).
                let k = self.below(p.tensors.len());
                let (_, dtype, shape, data) = p.tensors.get_mut(k)?;
                let size = dtype.bitsize() / 8;
                if self.below(2) == 0 && data.len() >= size {
                    data.truncate(data.len() - size);
                } else {
                    data.extend(std::iter::repeat_n(0, size));
                }
                *shape = vec![data.len() / size.max(1)];
            }
            _ => {
                // Rename a tensor.
                let k = self.below(p.tensors.len());
                let name = &mut p.tensors.get_mut(k)?.0;
                name.insert_str(0, ["maps/", "x", "/"][self.below(3)]);
            }
        }
        assemble(&p)
    }

    /// Edits the metadata JSON as text: a number replaced, a character changed or removed, a
    /// parameter entry or a field repeated.
    fn json(&mut self, json: &mut String) {
        let b = json.as_bytes();
        if b.is_empty() {
            return;
        }
        match self.below(5) {
            0..=2 => {
                // Replace a number (a run of digits, signs, dots, exponents).
                let starts: Vec<usize> = (0..b.len())
                    .filter(|&i| {
                        (b[i].is_ascii_digit() || b[i] == b'-')
                            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'.'))
                    })
                    .collect();
                if starts.is_empty() {
                    return;
                }
                let s = starts[self.below(starts.len())];
                let mut e = s + 1;
                while e < b.len() && matches!(b[e], b'0'..=b'9' | b'.' | b'e' | b'E' | b'-' | b'+')
                {
                    e += 1;
                }
                let with = NUMBERS[self.below(NUMBERS.len())];
                json.replace_range(s..e, with);
            }
            3 => {
                let at = self.below(b.len());
                if json.is_char_boundary(at) && json.is_char_boundary(at + 1) {
                    let c = [b'"', b',', b'{', b'}', b'[', b']', b':', b'0', b'a', b' ']
                        [self.below(10)];
                    json.replace_range(at..at + 1, std::str::from_utf8(&[c]).unwrap_or(" "));
                }
            }
            _ => {
                // Repeat the first parameter (a duplicate name, more elements than the file).
                if let Some(start) = json.find("\"params\":[{") {
                    let from = start + "\"params\":[".len();
                    let mut depth = 0usize;
                    let mut end = None;
                    for (i, c) in json[from..].char_indices() {
                        match c {
                            '{' => depth += 1,
                            '}' => {
                                depth -= 1;
                                if depth == 0 {
                                    end = Some(from + i + 1);
                                    break;
                                }
                            }
                            _ => {}
                        }
                    }
                    if let Some(end) = end {
                        let entry = json[from..end].to_string();
                        json.insert_str(from, &format!("{entry},"));
                    }
                }
            }
        }
    }
}
