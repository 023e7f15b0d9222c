//! The training runs behind the README's main command (`examples/compare.rs`): two real tasks,
//! every preset, the same initialisation and data order for all of them, and the measurements
//! the report prints. Data: `data/` (see its README for sources, licences and the fixed splits).

use rand_core::{Rng as _, SeedableRng};
use rand_xoshiro::SplitMix64;
use std::io::Read;
use std::time::Instant;

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, Optimizer as _, VarBuilder, VarMap};
use lpmm_optim::{Hyper, ParamConfig, presets};
use serde::Serialize;

use lpmm_candle::ops::LayerNorm;
use lpmm_candle::{LpmmConfig, LpmmOptimizer};

const DIGITS_GZ: &[u8] = include_bytes!("../data/digits.csv.gz");
const SHAKESPEARE_GZ: &[u8] = include_bytes!("../data/shakespeare.txt.gz");

fn gunzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .map_err(candle_core::Error::wrap)?;
    Ok(out)
}

/// The digits data set: 8x8 images scaled to [0, 1], labels 0..9.
#[derive(Debug, Clone)]
pub struct Digits {
    /// Training images, 64 values each.
    pub train_x: Vec<f32>,
    /// Training labels.
    pub train_y: Vec<u32>,
    /// Validation images.
    pub val_x: Vec<f32>,
    /// Validation labels.
    pub val_y: Vec<u32>,
}

/// Loads the digits with the fixed split: sample `i` validates iff `i % 5 == 0`.
pub fn digits() -> Result<Digits> {
    let csv = gunzip(DIGITS_GZ)?;
    let mut d = Digits {
        train_x: Vec::new(),
        train_y: Vec::new(),
        val_x: Vec::new(),
        val_y: Vec::new(),
    };
    let mut rows = csv::ReaderBuilder::new()
        .has_headers(false)
        .trim(csv::Trim::All)
        .from_reader(csv.as_slice());
    for (i, row) in rows.deserialize::<Vec<u32>>().enumerate() {
        let v = row.map_err(candle_core::Error::wrap)?;
        if v.len() != 65 {
            return Err(candle_core::Error::Msg(format!(
                "digits row {i} has {} fields",
                v.len()
            )));
        }
        let (x, y) = if i % 5 == 0 {
            (&mut d.val_x, &mut d.val_y)
        } else {
            (&mut d.train_x, &mut d.train_y)
        };
        x.extend(v[..64].iter().map(|&p| p as f32 / 16.0));
        y.push(v[64]);
    }
    Ok(d)
}

/// A text as byte-level tokens, split for training and validation.
#[derive(Debug, Clone)]
pub struct Text {
    /// Its name in reports (`shakespeare`, or the file's name).
    pub name: String,
    /// The distinct bytes, sorted: token `t` is `vocab[t]`.
    pub vocab: Vec<u8>,
    /// Training tokens (the first 90% of the bytes).
    pub train: Vec<u32>,
    /// Validation tokens (the last 10%).
    pub val: Vec<u32>,
}

impl Text {
    /// Tokenizes `bytes` (one token per distinct byte) with the fixed split: the first 90% of the
    /// bytes train, the last 10% validate. Errors if either part is too short for `context`-token
    /// windows.
    pub fn from_bytes(name: &str, bytes: &[u8], context: usize) -> Result<Text> {
        let cut = bytes.len() * 9 / 10;
        Text::held_out(name, bytes, cut..bytes.len(), context)
    }

    /// Tokenizes `bytes` (one token per distinct byte of the whole text, so both parts share the
    /// vocabulary): the bytes in `val` validate, the others (before it, then after it) train.
    /// Errors if either part is too short for `context`-token windows.
    pub fn held_out(
        name: &str,
        bytes: &[u8],
        val: std::ops::Range<usize>,
        context: usize,
    ) -> Result<Text> {
        if val.start > val.end || val.end > bytes.len() {
            return Err(candle_core::Error::Msg(format!(
                "the validation range {val:?} is not inside a text of {} bytes",
                bytes.len()
            )));
        }
        let mut vocab: Vec<u8> = bytes.to_vec();
        vocab.sort_unstable();
        vocab.dedup();
        let mut index = [0u32; 256];
        for (t, &b) in vocab.iter().enumerate() {
            index[usize::from(b)] = t as u32;
        }
        let tokens: Vec<u32> = bytes.iter().map(|&b| index[usize::from(b)]).collect();
        let mut train = tokens[..val.start].to_vec();
        train.extend_from_slice(&tokens[val.end..]);
        let text = Text {
            name: name.to_string(),
            vocab,
            train,
            val: tokens[val.clone()].to_vec(),
        };
        for (part, len) in [
            ("validation", text.val.len()),
            ("training", text.train.len()),
        ] {
            if len < context + 2 {
                return Err(candle_core::Error::Msg(format!(
                    "a text of {} bytes is too short: its {part} part ({len} bytes) must hold a \
                     window of {} bytes and one more",
                    bytes.len(),
                    context + 1
                )));
            }
        }
        Ok(text)
    }

    /// Decodes tokens back to text (bytes that are not UTF-8 are replaced).
    pub fn decode(&self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens.iter().map(|&t| self.vocab[t as usize]).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Loads the six plays (the embedded `data/shakespeare.txt.gz`) with the fixed split.
pub fn shakespeare() -> Result<Text> {
    Text::from_bytes("shakespeare", &gunzip(SHAKESPEARE_GZ)?, 64)
}

/// The six plays of the embedded text, in its order: the name each is known by here and its
/// title as the text spells it, the line before "by William Shakespeare". (The text joins each
/// play's last line to the next play's title, so a title is found with the line that follows.)
pub const PLAYS: [(&str, &str); 6] = [
    ("Hamlet", "HAMLET, PRINCE OF DENMARK"),
    ("Macbeth", "MACBETH"),
    ("Julius Caesar", "JULIUS CAESAR"),
    ("Romeo and Juliet", "ROMEO AND JULIET"),
    ("The Tempest", "THE TEMPEST"),
    ("Othello", "OTHELLO, THE MOOR OF VENICE"),
];

/// The byte range of each of [`PLAYS`] in `bytes` (the embedded text): from its title to the next
/// play's title (the last to the end).
pub fn play_ranges(bytes: &[u8]) -> Result<Vec<std::ops::Range<usize>>> {
    let find = |needle: &[u8]| bytes.windows(needle.len()).position(|w| w == needle);
    let mut starts = Vec::with_capacity(PLAYS.len());
    for (name, title) in PLAYS {
        let needle = format!("{title}\n\nby William Shakespeare");
        let at = find(needle.as_bytes()).ok_or_else(|| {
            candle_core::Error::Msg(format!("the text has no title of {name} ({title:?})"))
        })?;
        if starts.last().is_some_and(|&s| at <= s) {
            return Err(candle_core::Error::Msg(format!(
                "{name} is not after the play before it in the text"
            )));
        }
        starts.push(at);
    }
    // Hamlet opens the text: whatever precedes its title (nothing) belongs to it.
    starts[0] = 0;
    let ends = starts.iter().skip(1).copied().chain([bytes.len()]);
    Ok(starts.iter().zip(ends).map(|(&s, e)| s..e).collect())
}

/// The index into [`PLAYS`] of a play given by its number (1 to 6, the text's order) or its name
/// (case-insensitive; any unambiguous start, e.g. `macbeth`, `romeo`, `tempest`).
pub fn play_index(spec: &str) -> Option<usize> {
    if let Ok(n) = spec.trim().parse::<usize>() {
        return (1..=PLAYS.len()).contains(&n).then(|| n - 1);
    }
    let spec = spec.trim().to_lowercase();
    let hits: Vec<usize> = PLAYS
        .iter()
        .enumerate()
        .filter(|(_, (name, _))| {
            let name = name.to_lowercase();
            !spec.is_empty()
                && (name.starts_with(&spec) || name.trim_start_matches("the ").starts_with(&spec))
        })
        .map(|(i, _)| i)
        .collect();
    (hits.len() == 1).then(|| hits[0])
}

/// [`play_index`], or an error that lists the plays.
pub fn play_from(spec: &str) -> Result<usize> {
    play_index(spec).ok_or_else(|| {
        let names: Vec<String> = PLAYS
            .iter()
            .enumerate()
            .map(|(i, (name, _))| format!("{} {name}", i + 1))
            .collect();
        candle_core::Error::Msg(format!(
            "no play {spec:?} (a number or an unambiguous name); the plays: {}",
            names.join(", ")
        ))
    })
}

/// The six plays with one held out: the other five train (in the text's order), play `play` (an
/// index into [`PLAYS`]) validates. Its name is `shakespeare, <play> held out`.
pub fn shakespeare_held_out(play: usize) -> Result<Text> {
    let bytes = gunzip(SHAKESPEARE_GZ)?;
    let ranges = play_ranges(&bytes)?;
    let range = ranges.get(play).cloned().ok_or_else(|| {
        candle_core::Error::Msg(format!("there are {} plays; no play {play}", PLAYS.len()))
    })?;
    Text::held_out(
        &format!("shakespeare, {} held out", PLAYS[play].0),
        &bytes,
        range,
        64,
    )
}

/// One of the six plays alone (`play`, an index into [`PLAYS`]) with the fixed split of
/// [`shakespeare`]: the play's first 90% trains, its last 10% validates. Its name is
/// `<play> alone`. The bytes are those a file holding the play would have (the range
/// [`play_ranges`] gives), so `--text` on such a file trains the same model.
pub fn shakespeare_play(play: usize) -> Result<Text> {
    let bytes = gunzip(SHAKESPEARE_GZ)?;
    let ranges = play_ranges(&bytes)?;
    let range = ranges.get(play).cloned().ok_or_else(|| {
        candle_core::Error::Msg(format!("there are {} plays; no play {play}", PLAYS.len()))
    })?;
    Text::from_bytes(&format!("{} alone", PLAYS[play].0), &bytes[range], 64)
}

/// Loads a text file (gunzipped if its name ends in `.gz`) as bytes with the same split as
/// [`shakespeare`]: the first 90% train, the last 10% validate. `context` is the model's context,
/// for the length check.
pub fn text_file(path: &std::path::Path, context: usize) -> Result<Text> {
    let raw = std::fs::read(path)
        .map_err(|e| candle_core::Error::Msg(format!("cannot read {}: {e}", path.display())))?;
    let bytes = if path.extension().is_some_and(|e| e == "gz") {
        gunzip(&raw)?
    } else {
        raw
    };
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Text::from_bytes(&name, &bytes, context)
}

/// Cross-entropy (nats per character) on the validation split of count models fitted to the
/// training split: the floor a character model must clearly beat.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Baselines {
    /// Unigram: each byte's training frequency, add-one smoothed.
    pub unigram: f64,
    /// Bigram: the next byte's training frequency after the current one, add-one smoothed
    /// (a model of character pairs).
    pub bigram: f64,
}

/// The unigram and bigram baselines of `text` (add-one smoothing over the vocabulary); the bigram
/// scores every validation byte after the first.
pub fn baselines(text: &Text) -> Baselines {
    let v = text.vocab.len();
    let mut uni = vec![0f64; v];
    let mut bi = vec![0f64; v * v];
    for &t in &text.train {
        uni[t as usize] += 1.0;
    }
    for w in text.train.windows(2) {
        bi[w[0] as usize * v + w[1] as usize] += 1.0;
    }
    let total = text.train.len() as f64;
    let unigram = text
        .val
        .iter()
        .map(|&t| -((uni[t as usize] + 1.0) / (total + v as f64)).ln())
        .sum::<f64>()
        / text.val.len() as f64;
    let mut from = vec![0f64; v];
    for a in 0..v {
        from[a] = bi[a * v..(a + 1) * v].iter().sum();
    }
    let bigram = text
        .val
        .windows(2)
        .map(|w| {
            let (a, b) = (w[0] as usize, w[1] as usize);
            -((bi[a * v + b] + 1.0) / (from[a] + v as f64)).ln()
        })
        .sum::<f64>()
        / (text.val.len() - 1) as f64;
    Baselines { unigram, bigram }
}

/// A small deterministic generator (SplitMix64 from `rand_xoshiro`) for initialisation and data
/// order, so every preset sees the same numbers.
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64::seed_from_u64(seed ^ 0x9E37_79B9_7F4A_7C15))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize
    }

    /// Standard normal (Box-Muller, one value per call).
    pub fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform(); // in (0, 1]
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// A `VarBuilder` whose new variables (kept in `varmap`) take the distribution candle-nn's
/// initialiser would give them (constant, uniform, normal, Kaiming) but draw their values from
/// this module's generator, seeded by `seed` and the variable's name: the same bits on every run
/// and whatever the order the model asks for them. (candle's own CPU initialiser cannot be
/// seeded.)
pub fn seeded_var_builder(varmap: &VarMap, seed: u64, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(
        Box::new(SeededInit {
            varmap: varmap.clone(),
            seed,
        }),
        DType::F32,
        device.clone(),
    )
}

/// The backend of [`seeded_var_builder`].
struct SeededInit {
    varmap: VarMap,
    seed: u64,
}

/// FNV-1a of a name, to key a variable's random stream.
fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl candle_nn::var_builder::SimpleBackend for SeededInit {
    fn get(
        &self,
        shape: candle_core::Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        use candle_nn::init::NormalOrUniform;
        let mut data = self
            .varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        if let Some(var) = data.get(name) {
            if var.shape() != &shape {
                candle_core::bail!("{name}: shape {:?}, asked for {shape:?}", var.shape());
            }
            return Ok(var.as_tensor().clone());
        }
        let mut rng = Rng::new(self.seed ^ name_key(name));
        let n = shape.elem_count();
        let uniform = |rng: &mut Rng, lo: f64, up: f64| lo + (up - lo) * rng.uniform();
        let values: Vec<f64> = match init {
            candle_nn::Init::Const(c) => vec![c; n],
            candle_nn::Init::Uniform { lo, up } => {
                (0..n).map(|_| uniform(&mut rng, lo, up)).collect()
            }
            candle_nn::Init::Randn { mean, stdev } => {
                (0..n).map(|_| mean + stdev * rng.normal()).collect()
            }
            candle_nn::Init::Kaiming {
                dist,
                fan,
                non_linearity,
            } => {
                let std = non_linearity.gain() / (fan.for_shape(&shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Normal => (0..n).map(|_| std * rng.normal()).collect(),
                    NormalOrUniform::Uniform => {
                        let bound = 3f64.sqrt() * std;
                        (0..n).map(|_| uniform(&mut rng, -bound, bound)).collect()
                    }
                }
            }
        };
        let var =
            candle_core::Var::from_tensor(&Tensor::from_vec(values, shape, dev)?.to_dtype(dtype)?)?;
        let tensor = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(tensor)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle_core::bail!("{name}: a seeded VarBuilder creates variables; ask with a shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap
            .data()
            .lock()
            .is_ok_and(|data| data.contains_key(name))
    }
}

/// The digits classifier: 64 -> 128 (ReLU) -> 10.
#[derive(Debug)]
pub struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    /// Builds the model in `vb`.
    pub fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Mlp {
            l1: candle_nn::linear(64, 128, vb.pp("l1"))?,
            l2: candle_nn::linear(128, 10, vb.pp("l2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.relu()?)
    }
}

/// Sizes of the character-level transformer.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LmShape {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
    /// Context length.
    pub context: usize,
}

#[derive(Debug)]
struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    up: Linear,
    down: Linear,
}

/// A small causal character-level transformer (nanoGPT-like: pre-norm blocks, learned positions,
/// an MLP of 4x the width, no biases; ReLU instead of GELU, which costs a third of the step time
/// in candle's CPU backward pass). Its layer norms and attention softmax are [`lpmm_candle::ops`]'s
/// differentiable ones: with candle-nn's fused `LayerNorm` and `softmax_last_dim` no gradient
/// would cross them (see the crate's documentation).
#[derive(Debug)]
pub struct CharLm {
    shape: LmShape,
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    ln: LayerNorm,
    head: Linear,
    device: Device,
}

impl CharLm {
    /// Builds the model in `vb` (candle's initialisation; see [`CharLm::init`]).
    pub fn new(shape: LmShape, vb: VarBuilder, device: &Device) -> Result<Self> {
        let w = shape.width;
        if shape.heads == 0 || !w.is_multiple_of(shape.heads) {
            return Err(candle_core::Error::Msg(format!(
                "width {w} is not a multiple of {} heads",
                shape.heads
            )));
        }
        let blocks = (0..shape.layers)
            .map(|i| {
                let vb = vb.pp(format!("block{i}"));
                Ok(Block {
                    ln1: LayerNorm::load_no_bias(w, 1e-5, vb.pp("ln1"))?,
                    qkv: candle_nn::linear_no_bias(w, 3 * w, vb.pp("qkv"))?,
                    proj: candle_nn::linear_no_bias(w, w, vb.pp("proj"))?,
                    ln2: LayerNorm::load_no_bias(w, 1e-5, vb.pp("ln2"))?,
                    up: candle_nn::linear_no_bias(w, 4 * w, vb.pp("up"))?,
                    down: candle_nn::linear_no_bias(4 * w, w, vb.pp("down"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CharLm {
            shape,
            tokens: candle_nn::embedding(shape.vocab, w, vb.pp("tokens"))?,
            positions: candle_nn::embedding(shape.context, w, vb.pp("positions"))?,
            blocks,
            ln: LayerNorm::load_no_bias(w, 1e-5, vb.pp("ln"))?,
            head: candle_nn::linear_no_bias(w, shape.vocab, vb.pp("head"))?,
            device: device.clone(),
        })
    }

    /// The model's sizes.
    pub fn shape(&self) -> LmShape {
        self.shape
    }

    /// GPT-2's initialisation, deterministic from `seed`: embeddings and weight matrices
    /// N(0, `std`²), the residual projections (`proj`, `down`) N(0, `std`² / (2 layers)),
    /// layer-norm gains 1. (candle's own starts the embeddings at N(0, 1) and the linear weights
    /// at N(0, 2 / fan-in); docs/RESULTS.md has what that costs this model.)
    pub fn init(&self, varmap: &VarMap, seed: u64, std: f64) -> Result<()> {
        let data = varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        let mut rng = Rng::new(seed);
        let residual = std / (2.0 * self.shape.layers.max(1) as f64).sqrt();
        for name in names {
            let var = &data[name];
            let n = var.elem_count();
            let values: Vec<f32> = if name.ends_with(".bias") {
                vec![0.0; n]
            } else if name.starts_with("ln.") || name.contains(".ln") {
                vec![1.0; n]
            } else {
                let sd = if name.contains(".proj.") || name.contains(".down.") {
                    residual
                } else {
                    std
                };
                (0..n).map(|_| (rng.normal() * sd) as f32).collect()
            };
            var.set(&Tensor::from_vec(values, var.shape(), var.device())?)?;
        }
        Ok(())
    }

    /// Logits `(batch, context, vocab)` for token ids `(batch, context)`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (w, h) = (self.shape.width, self.shape.heads);
        let pos = Tensor::arange(0u32, t as u32, ids.device())?;
        let mut x = self
            .tokens
            .forward(ids)?
            .broadcast_add(&self.positions.forward(&pos)?)?;
        for blk in &self.blocks {
            let qkv = blk
                .qkv
                .forward(&blk.ln1.forward(&x)?)?
                .reshape((b, t, 3, h, w / h))?;
            let head = |k: usize| {
                qkv.narrow(2, k, 1)?
                    .squeeze(2)?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, k, v) = (head(0)?, head(1)?, head(2)?);
            let att = lpmm_candle::ops::causal_softmax(
                &q.matmul(&k.transpose(2, 3)?.contiguous()?)?,
                1.0 / ((w / h) as f64).sqrt(),
            )?;
            let y = att
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b, t, w))?;
            x = (x + blk.proj.forward(&y)?)?;
            let m = blk
                .down
                .forward(&blk.up.forward(&blk.ln2.forward(&x)?)?.relu()?)?;
            x = (x + m)?;
        }
        self.head.forward(&self.ln.forward(&x)?)
    }

    /// Continues `prompt` by `count` tokens, each drawn from the model's distribution at
    /// `temperature` given the last `context` tokens, with random numbers from `rng`.
    pub fn sample(
        &self,
        prompt: &[u32],
        count: usize,
        temperature: f64,
        rng: &mut Rng,
    ) -> Result<Vec<u32>> {
        let mut tokens = prompt.to_vec();
        let dev = &self.device;
        for _ in 0..count {
            let from = tokens.len().saturating_sub(self.shape.context);
            let window = &tokens[from..];
            let ids = Tensor::from_vec(window.to_vec(), (1, window.len()), dev)?;
            let logits = self
                .forward(&ids)?
                .squeeze(0)?
                .get(window.len() - 1)?
                .to_dtype(DType::F64)?;
            let p =
                candle_nn::ops::softmax(&(logits / temperature)?, D::Minus1)?.to_vec1::<f64>()?;
            let u = rng.uniform();
            let mut acc = 0.0;
            let mut next = p.len() - 1;
            for (k, &pk) in p.iter().enumerate() {
                acc += pk;
                if u < acc {
                    next = k;
                    break;
                }
            }
            tokens.push(next as u32);
        }
        Ok(tokens[prompt.len()..].to_vec())
    }
}

/// A preset as the comparison runs it.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    /// Its name in the report.
    pub name: &'static str,
    /// The lpmm configuration for a learning rate.
    pub config: fn(f64) -> ParamConfig,
    /// Whether it is an SGD preset (takes the SGD learning rate of the task).
    pub sgd: bool,
    /// The preset its memory and quality are compared with.
    pub reference: &'static str,
    /// Micro-batches per step (LPMM's microbatching: gradients accumulated in the low-precision
    /// accumulator, one step per batch).
    pub micro_batches: usize,
    /// Schedule-free: the learning rate stays at its peak (the rule warms up and averages
    /// itself) and the model is evaluated at the optimizer's evaluation point
    /// (`LpmmOptimizer::eval`).
    pub schedule_free: bool,
    /// What the comparison checks of it ([`crate::judge`]).
    pub goal: Goal,
}

impl Preset {
    /// A preset judged for quality against `reference`: not SGD, one micro-batch per step, not
    /// schedule-free.
    const fn quality(
        name: &'static str,
        config: fn(f64) -> ParamConfig,
        reference: &'static str,
    ) -> Self {
        Preset {
            name,
            config,
            sgd: false,
            reference,
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::Quality,
        }
    }
}

/// What the comparison checks of a preset ([`crate::judge::judge`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Goal {
    /// An f32 reference: three seeds, checked for stability; it judges the presets that name it.
    Reference,
    /// Within the reference's tolerance (validation loss and accuracy; accuracy for a
    /// classifier).
    Quality,
    /// Within the reference's tolerance, and model memory at least `reduction` (a fraction)
    /// below the reference's.
    QualityAndMemory {
        /// The least memory saving, a fraction of the reference's bytes per parameter.
        reduction: f64,
    },
    /// None in the main table: the naive round-to-nearest baseline, which the low-learning-rate
    /// condition checks to be visibly worse than its reference.
    NaiveBaseline,
}

/// The presets of the comparison, references first.
pub fn presets() -> Vec<Preset> {
    vec![
        Preset {
            name: "f32 AdamW",
            config: |lr| presets::adamw_f32(lr).build(),
            sgd: false,
            reference: "f32 AdamW",
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::Reference,
        },
        Preset {
            name: "f32 SGDM",
            config: |lr| presets::sgdm_f32(lr, 0.9).build(),
            sgd: true,
            reference: "f32 SGDM",
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::Reference,
        },
        Preset::quality(
            "8-bit AdamW, bf16",
            |lr| presets::adamw_8bit_bf16(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdamW, bf16 SR",
            |lr| presets::adamw_8bit_bf16_sr(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "4-bit AdamW, split f32",
            |lr| presets::adamw_4bit_split(lr).build(),
            "f32 AdamW",
        ),
        Preset {
            name: "LPMM-SGDM",
            config: |lr| presets::lpmm_sgdm(lr, 0.9).build(),
            sgd: true,
            reference: "f32 SGDM",
            micro_batches: 4,
            schedule_free: false,
            goal: Goal::QualityAndMemory { reduction: 0.70 },
        },
        Preset {
            name: "bf16 AdamW, round to nearest",
            config: |lr| presets::bf16_nearest(Hyper::adamw(lr)).build(),
            sgd: false,
            reference: "f32 AdamW",
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::NaiveBaseline,
        },
        Preset::quality(
            "f32 Adafactor",
            |lr| {
                presets::adafactor_f32()
                    .beta1(0.9)
                    .lr(lr)
                    .scale_parameter(false)
                    .build()
            },
            "f32 AdamW",
        ),
        Preset {
            name: "Adafactor, LPMM",
            config: |lr| {
                presets::adafactor_lpmm()
                    .lr(lr)
                    .scale_parameter(false)
                    .build()
            },
            sgd: false,
            reference: "f32 Adafactor",
            micro_batches: 4,
            schedule_free: false,
            goal: Goal::Quality,
        },
        Preset::quality(
            "f32 CAME",
            |lr| presets::came_f32(lr / 3.0).build(),
            "f32 AdamW",
        ),
        Preset {
            name: "CAME, LPMM",
            config: |lr| presets::came_lpmm(lr / 3.0).build(),
            sgd: false,
            reference: "f32 CAME",
            micro_batches: 4,
            schedule_free: false,
            goal: Goal::Quality,
        },
        Preset {
            name: "f32 schedule-free AdamW",
            config: |lr| {
                presets::schedule_free_adamw_f32(lr)
                    .warmup_steps(50)
                    .build()
            },
            sgd: false,
            reference: "f32 AdamW",
            micro_batches: 1,
            schedule_free: true,
            goal: Goal::Quality,
        },
        Preset {
            name: "8-bit schedule-free AdamW",
            config: |lr| {
                presets::schedule_free_adamw_8bit(lr)
                    .warmup_steps(50)
                    .build()
            },
            sgd: false,
            reference: "f32 schedule-free AdamW",
            micro_batches: 1,
            schedule_free: true,
            goal: Goal::Quality,
        },
    ]
}

/// Presets outside the comparison's default run, for [`run_char_lm`] (`examples/char_lm.rs
/// --preset NAME`): bitsandbytes' `AdamW8bit`, `Lion8bit` and `AdEMAMix8bit` equivalents on f32
/// parameters, the 4-bit AdamW twin, the f32 Lion and AdEMAMix references, RMSprop, Adagrad and
/// LAMB in f32 and with 8-bit states, and Adafactor with
/// transformers' defaults (a step size relative to the step count and the parameters' RMS,
/// which ignores the schedule). Lion steps at a tenth of the AdamW learning rate (its authors
/// advise 3 to 10 times smaller).
pub fn more_presets() -> Vec<Preset> {
    vec![
        Preset {
            name: "f32 Adafactor, relative step",
            config: |_| presets::adafactor_f32().build(),
            sgd: false,
            reference: "f32 AdamW",
            micro_batches: 1,
            schedule_free: false,
            goal: Goal::Reference,
        },
        Preset::quality(
            "f32 AdEMAMix",
            |lr| presets::ademamix_f32(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdEMAMix, f32",
            |lr| presets::ademamix_8bit(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdamW, f32",
            |lr| presets::adamw_8bit(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "4-bit AdamW, f32",
            |lr| presets::adamw_4bit(lr).build(),
            "f32 AdamW",
        ),
        // The parameter storages beside 8-bit states, for the low-learning-rate condition
        // (`char_lm -- --preset NAME --lr 6e-4`): bf16 to nearest and stochastically are the
        // main table's; Kahan-compensated bf16 and 24-bit master weights (bf16+8) here.
        Preset::quality(
            "8-bit AdamW, bf16 Kahan",
            |lr| {
                presets::adamw_8bit_bf16(lr)
                    .with_param(lpmm_optim::Storage::Bf16Kahan)
                    .build()
            },
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdamW, bf16+8",
            |lr| presets::adamw_8bit_bf16_plus8(lr).build(),
            "f32 AdamW",
        ),
        Preset::quality(
            "8-bit AdamW, bf16+8 SR",
            |lr| {
                presets::adamw_8bit_bf16_plus8(lr)
                    .with_param(lpmm_optim::Storage::Bf16Plus8(
                        lpmm_optim::StoreRounding::Stochastic,
                    ))
                    .build()
            },
            "f32 AdamW",
        ),
        Preset::quality(
            "f32 Lion",
            |lr| presets::lion_f32(lr / 10.0).build(),
            "f32 Lion",
        ),
        Preset::quality(
            "8-bit Lion, f32",
            |lr| presets::lion_8bit(lr / 10.0).build(),
            "f32 Lion",
        ),
        // RMSprop at half the AdamW rate (3e-3) and Adagrad at five times it (3e-2), the best
        // of a sweep (`char_lm -- --preset "f32 RMSprop" --lr X`, seed 0): RMSprop 1e-3 1.9788,
        // 2e-3 1.9621, 3e-3 1.8717, 4e-3 1.9266, 6e-3 2.2224, 1e-2 2.4527; Adagrad 1e-2 2.1401,
        // 2e-2 2.1015, 3e-2 1.9485, 5e-2 1.9929, 1e-1 2.4559.
        Preset::quality(
            "f32 RMSprop",
            |lr| presets::rmsprop_f32(lr / 2.0).build(),
            "f32 RMSprop",
        ),
        Preset::quality(
            "8-bit RMSprop, f32",
            |lr| presets::rmsprop_8bit(lr / 2.0).build(),
            "f32 RMSprop",
        ),
        Preset::quality(
            "f32 Adagrad",
            |lr| presets::adagrad_f32(lr * 5.0).build(),
            "f32 Adagrad",
        ),
        Preset::quality(
            "8-bit Adagrad, f32",
            |lr| presets::adagrad_8bit(lr * 5.0).build(),
            "f32 Adagrad",
        ),
        // LAMB at 10/3 of the AdamW rate (0.02): its trust ratio makes each tensor's step `lr`
        // times its norm. Swept with `char_lm -- --preset "f32 LAMB" --lr X`, seed 0: 0.01 1.9078,
        // 0.015 1.7890, 0.02 1.7646, 0.03 1.8215, 0.05 1.8688, 0.1 1.9517.
        Preset::quality(
            "f32 LAMB",
            |lr| presets::lamb_f32(lr * 10.0 / 3.0).build(),
            "f32 LAMB",
        ),
        Preset::quality(
            "8-bit LAMB, f32",
            |lr| presets::lamb_8bit(lr * 10.0 / 3.0).build(),
            "f32 LAMB",
        ),
    ]
}

/// One run's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// "digits", or the language model's text (`shakespeare`, or the file's name).
    pub task: String,
    /// The preset's name.
    pub preset: String,
    /// The preset it is compared with.
    pub reference: String,
    /// The initialisation seed.
    pub seed: u64,
    /// Parameters trained.
    pub params: usize,
    /// Model memory (parameters in their storage — a `Var` lent to lpmm as the parameter
    /// included —, gradient accumulators, states), bytes per parameter.
    pub bytes_per_param: f64,
    /// Mean training loss over the last 10% of steps.
    pub final_train_loss: f64,
    /// Validation loss (cross-entropy, nats).
    pub val_loss: f64,
    /// Validation accuracy (digits: classification; language model: next character), in [0, 1].
    pub val_accuracy: f64,
    /// Wall time per optimizer step, milliseconds.
    pub ms_per_step: f64,
    /// Training loss every `curve_every` steps.
    pub curve: Vec<f64>,
    /// Steps between curve points.
    pub curve_every: usize,
    /// Language model: the prompt, `|`, and a continuation sampled after training (empty for
    /// digits).
    pub sample: String,
}

/// How long a task trains.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Budget {
    /// Optimizer steps.
    pub steps: usize,
    /// Examples (digits) or sequences (language model) per step.
    pub batch: usize,
}

/// The learning rate at `step` of `steps`: cosine decay from `peak` to 1% of it. Every preset
/// follows the same schedule; the small late rates are where round-to-nearest storage stalls.
pub fn schedule(peak: f64, step: usize, steps: usize) -> f64 {
    let progress = step as f64 / steps.max(1) as f64;
    peak * (0.01 + 0.99 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

/// One optimizer step on `batch`: split into the preset's micro-batches (never more than there
/// are items), each micro-batch's mean loss scaled by 1/count and its gradients accumulated in
/// lpmm's accumulator, then one step. Returns the batch's mean loss.
fn train_step(
    opt: &mut LpmmOptimizer,
    preset: &Preset,
    batch: &[usize],
    loss_of: impl Fn(&[usize]) -> Result<Tensor>,
) -> Result<f64> {
    let size = batch
        .len()
        .div_ceil(preset.micro_batches.clamp(1, batch.len().max(1)))
        .max(1);
    let count = batch.len().div_ceil(size) as f64;
    let mut mean = 0.0;
    for micro in batch.chunks(size) {
        let loss = loss_of(micro)?;
        mean += f64::from(loss.to_scalar::<f32>()?) / count;
        opt.accumulate((loss / count)?.backward()?)?;
    }
    opt.apply()?;
    Ok(mean)
}

fn record(curve: &mut Vec<f64>, losses: &[f64], every: usize) {
    if losses.len().is_multiple_of(every) {
        let tail = &losses[losses.len() - every..];
        curve.push(tail.iter().sum::<f64>() / every as f64);
    }
}

fn final_loss(losses: &[f64]) -> f64 {
    let n = (losses.len() / 10).max(1);
    losses[losses.len() - n..].iter().sum::<f64>() / n as f64
}

/// Trains the digits MLP with `preset`; `progress(step)` is called after every step.
pub fn run_digits(
    d: &Digits,
    preset: &Preset,
    seed: u64,
    budget: Budget,
    mut progress: impl FnMut(usize),
) -> Result<RunResult> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(seeded_var_builder(&varmap, seed, &dev))?;
    let lr = if preset.sgd { 0.05 } else { 2e-3 };
    let config = (preset.config)(lr);
    // The schedule's peak is the rate the preset configures (Lion's and CAME's are a fraction
    // of the task's).
    let lr = config.hyper.lr();
    let mut opt = LpmmOptimizer::from_varmap(&varmap, LpmmConfig::from(config))?;
    let n = d.train_y.len();
    let mut order: Vec<usize> = (0..n).collect();
    let mut data_rng = Rng::new(1234); // the same data order for every preset and seed
    let (mut losses, mut curve, every) = (Vec::new(), Vec::new(), (budget.steps / 50).max(1));
    let start = Instant::now();
    let mut at = n;
    for step in 0..budget.steps {
        if !preset.schedule_free {
            opt.set_learning_rate(schedule(lr, step, budget.steps));
        }
        let mut batch = Vec::with_capacity(budget.batch);
        while batch.len() < budget.batch {
            if at == n {
                for i in (1..n).rev() {
                    order.swap(i, data_rng.below(i + 1));
                }
                at = 0;
            }
            batch.push(order[at]);
            at += 1;
        }
        let step_loss = train_step(&mut opt, preset, &batch, |micro| {
            let xs: Vec<f32> = micro
                .iter()
                .flat_map(|&i| d.train_x[64 * i..64 * i + 64].iter().copied())
                .collect();
            let ys: Vec<u32> = micro.iter().map(|&i| d.train_y[i]).collect();
            let x = Tensor::from_vec(xs, (micro.len(), 64), &dev)?;
            let y = Tensor::from_vec(ys, micro.len(), &dev)?;
            candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)
        })?;
        losses.push(step_loss);
        record(&mut curve, &losses, every);
        progress(step + 1);
    }
    let ms_per_step = start.elapsed().as_secs_f64() * 1e3 / budget.steps as f64;
    if preset.schedule_free {
        opt.eval()?;
    }
    let x = Tensor::from_vec(d.val_x.clone(), (d.val_y.len(), 64), &dev)?;
    let y = Tensor::from_vec(d.val_y.clone(), d.val_y.len(), &dev)?;
    let logits = model.forward(&x)?;
    let val_loss = f64::from(candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()?);
    let correct = logits
        .argmax(D::Minus1)?
        .eq(&y)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    finish(
        "digits",
        preset,
        seed,
        &opt,
        losses,
        curve,
        every,
        val_loss,
        f64::from(correct) / d.val_y.len() as f64,
        ms_per_step,
    )
}

/// How the character-level language model is built and trained.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LmRecipe {
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
    /// Context length (tokens per training window).
    pub context: usize,
    /// Steps and sequences per step.
    pub budget: Budget,
    /// Peak learning rate of the AdamW presets.
    pub adamw_lr: f64,
    /// Peak learning rate of the SGD presets.
    pub sgd_lr: f64,
    /// Steps of linear warmup to the peak.
    pub warmup: usize,
    /// The last step's learning rate as a fraction of the peak (cosine decay after the warmup).
    pub final_lr_fraction: f64,
    /// Initialisation scale (see [`CharLm::init`]); 0 keeps candle's initialisation (its
    /// embeddings N(0, 1), its linear weights Kaiming-normal N(0, 2 / fan-in)), drawn from the
    /// seed by [`seeded_var_builder`].
    pub init_std: f64,
    /// Validation windows of `context` tokens: `None` tiles the whole validation split (every
    /// token predicted once, the last window ending at the split's end); `Some(n)`: `n` windows
    /// spread evenly over it (for short runs).
    pub val_windows: Option<usize>,
}

impl LmRecipe {
    /// The comparison's default (the README's main command).
    pub fn default_run() -> LmRecipe {
        LmRecipe {
            width: 64,
            heads: 4,
            layers: 2,
            context: 64,
            budget: Budget {
                steps: 1000,
                batch: 32,
            },
            adamw_lr: 6e-3,
            sgd_lr: 0.3,
            warmup: 50,
            final_lr_fraction: 0.01,
            init_std: 0.02,
            val_windows: None,
        }
    }

    /// The model's shape for a vocabulary of `vocab` tokens.
    pub fn shape(&self, vocab: usize) -> LmShape {
        LmShape {
            vocab,
            width: self.width,
            heads: self.heads,
            layers: self.layers,
            context: self.context,
        }
    }

    /// The learning rate at `step` for the peak `peak`: linear warmup over `warmup` steps, then
    /// cosine decay to `final_lr_fraction * peak` at the last step.
    pub fn lr(&self, peak: f64, step: usize) -> f64 {
        let steps = self.budget.steps;
        if step < self.warmup {
            return peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = steps.saturating_sub(self.warmup + 1).max(1);
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        let f = self.final_lr_fraction;
        peak * (f + (1.0 - f) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
    }
}

/// The validation loss and next-character accuracy of `model` on `tokens`, over windows of the
/// model's context (every prediction of every window counts): with `windows` `None`, windows
/// that tile `tokens` (the last one ending at its end); with `Some(n)`, `n` windows spread
/// evenly.
pub fn evaluate(model: &CharLm, tokens: &[u32], windows: Option<usize>) -> Result<(f64, f64)> {
    let t = model.shape.context;
    let dev = model.device.clone();
    if tokens.len() < t + 1 {
        return Err(candle_core::Error::Msg(format!(
            "{} tokens cannot hold a window of {t} and its next token",
            tokens.len()
        )));
    }
    let span = tokens.len() - t - 1; // the last start
    let count = windows.unwrap_or(span.div_ceil(t) + 1).clamp(1, span + 1);
    let starts: Vec<usize> = (0..count)
        .map(|k| {
            if count == 1 {
                0
            } else {
                k * span / (count - 1)
            }
        })
        .collect();
    let (mut loss_sum, mut correct) = (0.0f64, 0.0f64);
    for chunk in starts.chunks(64) {
        let (x, y) = windows_of(tokens, chunk, t, &dev)?;
        let logits = model
            .forward(&x)?
            .reshape((chunk.len() * t, model.shape.vocab))?;
        loss_sum += f64::from(candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()?)
            * chunk.len() as f64;
        correct += f64::from(
            logits
                .argmax(D::Minus1)?
                .eq(&y)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?,
        );
    }
    Ok((loss_sum / count as f64, correct / (count * t) as f64))
}

/// Inputs `(starts, t)` and next-token targets `(starts * t)` for windows at `starts`.
fn windows_of(
    tokens: &[u32],
    starts: &[usize],
    t: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let x: Vec<u32> = starts
        .iter()
        .flat_map(|&s| tokens[s..s + t].iter().copied())
        .collect();
    let y: Vec<u32> = starts
        .iter()
        .flat_map(|&s| tokens[s + 1..s + t + 1].iter().copied())
        .collect();
    Ok((
        Tensor::from_vec(x, (starts.len(), t), dev)?,
        Tensor::from_vec(y, starts.len() * t, dev)?,
    ))
}

/// Tokens sampled after training (at temperature 0.8, after `context / 2` tokens of the
/// validation split from its first line start).
const SAMPLE_TOKENS: usize = 320;

/// Trains the character-level transformer on `text` with `preset` and `recipe`;
/// `progress(step)` after every step. The data order is the same for every preset and seed.
pub fn run_char_lm(
    text: &Text,
    preset: &Preset,
    seed: u64,
    recipe: &LmRecipe,
    mut progress: impl FnMut(usize),
) -> Result<RunResult> {
    let dev = Device::Cpu;
    let shape = recipe.shape(text.vocab.len());
    let t = shape.context;
    if text.train.len() < t + 2 || text.val.len() < t + 2 {
        return Err(candle_core::Error::Msg(format!(
            "the text is too short for windows of {t} tokens"
        )));
    }
    let varmap = VarMap::new();
    let model = CharLm::new(shape, seeded_var_builder(&varmap, seed, &dev), &dev)?;
    if recipe.init_std > 0.0 {
        model.init(&varmap, seed, recipe.init_std)?;
    }
    let lr = if preset.sgd {
        recipe.sgd_lr
    } else {
        recipe.adamw_lr
    };
    let config = (preset.config)(lr);
    // The schedule's peak is the rate the preset configures (Lion's and CAME's are a fraction
    // of the task's).
    let lr = config.hyper.lr();
    let mut opt = LpmmOptimizer::from_varmap(&varmap, LpmmConfig::from(config))?;
    let budget = recipe.budget;
    let mut data_rng = Rng::new(4321); // the same data order for every preset and seed
    let (mut losses, mut curve, every) = (Vec::new(), Vec::new(), (budget.steps / 50).max(1));
    let start = Instant::now();
    for step in 0..budget.steps {
        if !preset.schedule_free {
            opt.set_learning_rate(recipe.lr(lr, step));
        }
        let starts: Vec<usize> = (0..budget.batch)
            .map(|_| data_rng.below(text.train.len() - t - 1))
            .collect();
        let step_loss = train_step(&mut opt, preset, &starts, |micro| {
            let (x, y) = windows_of(&text.train, micro, t, &dev)?;
            let logits = model.forward(&x)?.reshape((micro.len() * t, shape.vocab))?;
            candle_nn::loss::cross_entropy(&logits, &y)
        })?;
        losses.push(step_loss);
        record(&mut curve, &losses, every);
        progress(step + 1);
    }
    let ms_per_step = start.elapsed().as_secs_f64() * 1e3 / budget.steps as f64;
    if preset.schedule_free {
        opt.eval()?;
    }
    let (val_loss, accuracy) = evaluate(&model, &text.val, recipe.val_windows)?;
    // The prompt: half a context from the validation split, from its first line start.
    let from = (1..text.val.len() - t / 2)
        .find(|&i| text.vocab[text.val[i - 1] as usize] == b'\n')
        .unwrap_or(0);
    let prompt = &text.val[from..from + t / 2];
    let mut sample_rng = Rng::new(777);
    let sample = model.sample(prompt, SAMPLE_TOKENS, 0.8, &mut sample_rng)?;
    let mut r = finish(
        &text.name,
        preset,
        seed,
        &opt,
        losses,
        curve,
        every,
        val_loss,
        accuracy,
        ms_per_step,
    )?;
    r.sample = format!("{}|{}", text.decode(prompt), text.decode(&sample));
    Ok(r)
}

#[allow(clippy::too_many_arguments)]
fn finish(
    task: &str,
    preset: &Preset,
    seed: u64,
    opt: &LpmmOptimizer,
    losses: Vec<f64>,
    curve: Vec<f64>,
    every: usize,
    val_loss: f64,
    val_accuracy: f64,
    ms_per_step: f64,
) -> Result<RunResult> {
    let report = opt.memory_report();
    Ok(RunResult {
        task: task.to_string(),
        preset: preset.name.to_string(),
        reference: preset.reference.to_string(),
        seed,
        params: report.numel(),
        // The whole model memory: what lpmm holds and the `Var`s lent to it as its parameters.
        bytes_per_param: (report.total() + opt.lent_bytes()) as f64 / report.numel().max(1) as f64,
        final_train_loss: final_loss(&losses),
        val_loss,
        val_accuracy,
        ms_per_step,
        curve,
        curve_every: every,
        sample: String::new(),
    })
}
