//! Bad inputs, tried as a hostile user would: every one must be refused with a typed error,
//! reported by the step (the non-finite policy), or handled correctly (and checked to be) —
//! never accepted silently. The test prints the table of cases and outcomes that
//! docs/BAD_INPUT.md reproduces:
//!
//! `cargo test -p lpmm-optim --release --test hostile -- --nocapture`

use lpmm_optim::Mode;
use lpmm_optim::{Checkpoint, Cpu, Parts, PartsMut, checkpoint::Canonical};
use std::path::{Path, PathBuf};

use lpmm_optim::{
    Adafactor, Adam, HostSlot, Hyper, Lion, LoadPolicy, LrRule, MapKind, MissingGradientPolicy,
    NonFinitePolicy, OptimError, Optimizer, OptimizerOptions, ParamConfig, ParamId, Sgd, SlotKind,
    Storage, StoreRounding, presets,
};

/// What a case saw.
#[derive(Debug)]
enum Seen {
    /// Refused with a typed error (its variant and message).
    Refused(String),
    /// Accepted; the step reported the parameter (the non-finite policy) and stored nothing
    /// that does not fit.
    Reported(String),
    /// Accepted and handled correctly, as the case checked.
    Correct(String),
    /// Accepted with a wrong or unreported result, or refused with the wrong kind of error.
    Silent(String),
}

fn variant(e: &OptimError) -> String {
    let debug = format!("{e:?}");
    let name: String = debug
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    // The temporary directory's name changes from run to run.
    let text = e
        .to_string()
        .replace(&format!("{}/", dir().display()), "")
        .replace(&dir().display().to_string(), "<dir>");
    let short: String = text.chars().take(110).collect();
    let more = if text.chars().count() > 110 {
        "…"
    } else {
        ""
    };
    format!("`{name}`: {short}{more}")
}

/// Refused with a typed error.
fn refused<T: std::fmt::Debug>(r: Result<T, OptimError>) -> Seen {
    match r {
        Err(e) => Seen::Refused(variant(&e)),
        Ok(v) => Seen::Silent(format!("accepted: {v:?}")),
    }
}

/// A file refused with `OptimError::Checkpoint`, as the docs promise for every bad file.
fn file_refused<T>(r: Result<T, OptimError>) -> Seen {
    match r {
        Err(e @ OptimError::Checkpoint { .. }) => Seen::Refused(variant(&e)),
        Err(e) => Seen::Silent(format!("refused, but not as a Checkpoint error: {e:?}")),
        Ok(_) => Seen::Silent("loaded".into()),
    }
}

fn opts() -> OptimizerOptions {
    OptimizerOptions::default().with_seed(5)
}

/// An optimizer with one group of `config` and one parameter "w" of `n` elements (values 0.1).
fn one(config: ParamConfig, n: usize) -> (Optimizer, ParamId) {
    let mut opt = Optimizer::new(opts()).unwrap();
    let g = opt.add_group(config).unwrap();
    let id = opt.add_param("w", &[n], &vec![0.1; n], g).unwrap();
    (opt, id)
}

fn group(config: ParamConfig) -> Seen {
    let mut opt = Optimizer::new(opts()).unwrap();
    refused(opt.add_group(config))
}

fn with_init(storage: Storage, value: f32) -> Seen {
    let mut opt = Optimizer::new(opts()).unwrap();
    let g = opt
        .add_group(ParamConfig::f32(Hyper::sgd(0.1, 0.0)).with_param(storage))
        .unwrap();
    refused(opt.add_param("w", &[3], &[0.5, value, -0.5], g))
}

fn finite(opt: &Optimizer, id: ParamId, n: usize) -> bool {
    let mut out = vec![0f32; n];
    let mut ok = true;
    opt.read(id, SlotKind::Param, &mut out).unwrap();
    ok &= out.iter().all(|v| v.is_finite());
    for s in [1, 2] {
        opt.read(id, SlotKind::ALL[s + 1], &mut out).unwrap();
        ok &= out.iter().all(|v| v.is_finite());
    }
    ok
}

/// Steps `config` with gradients `g` (released, or accumulated micro-batches then `step`):
/// reported, and every stored value finite, or silent.
fn overflow(config: ParamConfig, init: &[f32], grads: &[&[f32]], released: bool) -> Seen {
    let n = init.len();
    let mut opt = Optimizer::new(opts()).unwrap();
    let g = opt.add_group(config).unwrap();
    let id = match opt.add_param("w", &[n], init, g) {
        Ok(id) => id,
        Err(e) => return Seen::Refused(variant(&e)),
    };
    let mut reported = false;
    let mut refusals = Vec::new();
    if released {
        for g in grads {
            reported |= !opt
                .step(lpmm_optim::Step::param(id, *g))
                .unwrap()
                .non_finite
                .is_empty();
        }
    } else {
        for g in grads {
            if let Err(e) = opt.accumulate(id, *g) {
                refusals.push(variant(&e));
            }
        }
        reported |= !opt
            .step(lpmm_optim::Accumulated)
            .unwrap()
            .non_finite
            .is_empty();
    }
    let stored_finite = finite(&opt, id, n);
    match (reported, refusals.first(), stored_finite) {
        (_, Some(r), true) => Seen::Refused(r.clone()),
        (true, None, true) => {
            Seen::Reported("step report lists the parameter; states finite".into())
        }
        _ => Seen::Silent(format!(
            "reported {reported}, refusals {refusals:?}, stored values finite {stored_finite}"
        )),
    }
}

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("lpmm-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A checkpoint of several storages: AdamW 8-bit with bf16-SR parameters, a rank-1 second
/// moment, a Kahan parameter, an 8-bit accumulator.
fn saved(path: &Path) -> Vec<u8> {
    let mut opt = Optimizer::new(opts()).unwrap();
    let g = opt
        .add_group(
            presets::adamw_8bit_bf16_sr(1e-3)
                .with_min_quantized_size(0)
                .build(),
        )
        .unwrap();
    let a = opt.add_param("a", &[300], &[0.25; 300], g).unwrap();
    let r = opt
        .add_param_with(
            "r",
            &[8, 40],
            &[0.5; 320],
            g,
            presets::adamw_8bit_bf16_sr(1e-3)
                .with_param(Storage::Bf16Kahan)
                .with_state2(Storage::Rank1 {
                    map: MapKind::LinearWithoutZero4,
                    fallback: lpmm_quant::BlockSize::B128,
                })
                .with_min_quantized_size(0)
                .build(),
        )
        .unwrap();
    let s = opt
        .add_param_with("s", &[200], &[0.1; 200], g, presets::lpmm_sgdm(0.01, 0.9))
        .unwrap();
    for k in 0..2 {
        for (id, n) in [(a, 300), (r, 320), (s, 200)] {
            let grad: Vec<f32> = (0..n)
                .map(|i| ((i + k) % 13) as f32 * 0.01 - 0.06)
                .collect();
            opt.accumulate(id, &grad).unwrap();
        }
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
    opt.save(path, Checkpoint::new()).unwrap();
    std::fs::read(path).unwrap()
}

type Tensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;

/// The file with its metadata and tensors edited, resealed (the checksum recomputed, so the
/// checks behind it decide) when `seal`.
fn forge(
    bytes: &[u8],
    seal: bool,
    edit_meta: impl Fn(&mut serde_json::Value),
    edit_tensors: impl Fn(&mut Tensors),
) -> Vec<u8> {
    let (n, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let mut meta: serde_json::Value =
        serde_json::from_str(&header.metadata().as_ref().unwrap()["lpmm"]).unwrap();
    edit_meta(&mut meta);
    let data = &bytes[8 + n..];
    let mut tensors: Tensors = header
        .offset_keys()
        .into_iter()
        .map(|k| {
            let info = header.info(&k).unwrap();
            let (a, b) = info.data_offsets;
            (k, info.dtype, info.shape.clone(), data[a..b].to_vec())
        })
        .collect();
    edit_tensors(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(k, d, s, b)| {
            (
                k.as_str(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let info = std::collections::HashMap::from([("lpmm".to_string(), meta.to_string())]);
    let out = safetensors::tensor::serialize(views, Some(info)).unwrap();
    if seal {
        // Metadata that does not parse cannot be resealed: the parser refuses it first.
        lpmm_optim::fuzzing::reseal(&out).unwrap_or(out)
    } else {
        out
    }
}

fn load_bytes(bytes: &[u8], name: &str) -> Seen {
    let path = dir().join(name);
    std::fs::write(&path, bytes).unwrap();
    file_refused(Canonical::read(&path).and_then(|c| c.into_optimizer(Cpu)))
}

fn tensor<'a>(
    t: &'a mut Tensors,
    name: &str,
) -> &'a mut (String, safetensors::Dtype, Vec<usize>, Vec<u8>) {
    t.iter_mut().find(|x| x.0 == name).unwrap()
}

fn meta_edit(bytes: &[u8], name: &str, edit: impl Fn(&mut serde_json::Value)) -> Seen {
    load_bytes(&forge(bytes, true, edit, |_| {}), name)
}

fn tensor_edit(bytes: &[u8], name: &str, edit: impl Fn(&mut Tensors)) -> Seen {
    load_bytes(&forge(bytes, true, |_| {}, edit), name)
}

/// Saves and loads back: the same tensors and hyperparameters, bit for bit.
fn round_trips(opt: &Optimizer, name: &str) -> Seen {
    let path = dir().join(name);
    if let Err(e) = opt.save(&path, Checkpoint::new()) {
        return Seen::Refused(variant(&e));
    }
    let back = match Canonical::read(&path).and_then(|c| c.into_optimizer(Cpu)) {
        Ok(b) => b,
        Err(e) => return Seen::Silent(format!("saved, then refused on load: {e}")),
    };
    let (a, b) = (
        Parts::of(opt).canonical(None).unwrap(),
        Parts::of(&back).canonical(None).unwrap(),
    );
    if a.to_bytes().unwrap() == b.to_bytes().unwrap() {
        Seen::Correct("saved and loaded back bit for bit".into())
    } else {
        Seen::Silent("loaded back different".into())
    }
}

/// The rules with factorized states, and the slot each case mutates.
fn factorized_cases() -> [(&'static str, ParamConfig, SlotKind); 4] {
    let adam = ParamConfig::f32(Hyper::adamw(1e-3))
        .with_state2(Storage::Factorized)
        .with_min_quantized_size(0);
    let adafactor = presets::adafactor_f32().with_min_quantized_size(0).build();
    let came = presets::came_f32(2e-4).with_min_quantized_size(0).build();
    [
        ("AdamW", adam, SlotKind::State2),
        ("Adafactor", adafactor, SlotKind::State2),
        ("CAME", came, SlotKind::State2),
        ("CAME", came, SlotKind::State3),
    ]
}

/// Issue 46's input: one parameter "w" of shape `[12, 10]` at 0.2, three released steps.
fn factorized_after_three_steps(config: ParamConfig) -> (Optimizer, ParamId) {
    let mut opt = Optimizer::new(opts()).unwrap();
    let g = opt.add_group(config).unwrap();
    let id = opt.add_param("w", &[12, 10], &[0.2; 120], g).unwrap();
    for k in 0..3 {
        let grad: Vec<f32> = (0..120)
            .map(|i| ((i + k) % 7) as f32 * 0.01 - 0.03)
            .collect();
        opt.step(lpmm_optim::Step::param(id, &grad)).unwrap();
    }
    (opt, id)
}

/// `host` with f32 `at` of the region with `suffix` set to `value`.
fn with_value(host: &HostSlot, suffix: &str, at: usize, value: f32) -> HostSlot {
    let mut out = host.clone();
    let r = out
        .regions
        .iter_mut()
        .find(|r| r.spec.suffix == suffix)
        .unwrap();
    r.bytes[4 * at..4 * at + 4].copy_from_slice(&value.to_le_bytes());
    out
}

/// `host` with every f32 of the region with `suffix` set to `value`.
fn with_all(host: &HostSlot, suffix: &str, value: f32) -> HostSlot {
    let mut out = host.clone();
    let r = out
        .regions
        .iter_mut()
        .find(|r| r.spec.suffix == suffix)
        .unwrap();
    for c in r.bytes.chunks_mut(4) {
        c.copy_from_slice(&value.to_le_bytes());
    }
    out
}

fn bf(r: StoreRounding) -> Storage {
    Storage::Bf16(r)
}

fn cases() -> Vec<(&'static str, String, Seen)> {
    let mut out: Vec<(&'static str, String, Seen)> = Vec::new();
    let mut add =
        |cat: &'static str, what: &str, seen: Seen| out.push((cat, what.to_string(), seen));

    // --- Configuration.
    let adam = |a: Adam| ParamConfig::f32(Hyper::Adam(a));
    let sgd = |s: Sgd| ParamConfig::f32(Hyper::Sgd(s));
    let lion = |l: Lion| ParamConfig::f32(Hyper::Lion(l));
    for (what, c) in [
        ("AdamW lr = NaN", adam(Adam::adamw(f64::NAN))),
        ("AdamW lr = -1e-3", adam(Adam::adamw(-1e-3))),
        ("AdamW lr = +Inf", adam(Adam::adamw(f64::INFINITY))),
        ("AdamW lr = 1e300 (beyond f32)", adam(Adam::adamw(1e300))),
        ("AdamW beta1 = 1", adam(Adam::adamw(1e-3).betas(1.0, 0.999))),
        (
            "AdamW beta2 = -0.1",
            adam(Adam::adamw(1e-3).betas(0.9, -0.1)),
        ),
        (
            "AdamW beta2 = NaN",
            adam(Adam::adamw(1e-3).betas(0.9, f64::NAN)),
        ),
        ("AdamW eps = 0", adam(Adam::adamw(1e-3).eps(0.0))),
        ("AdamW eps = -1e-8", adam(Adam::adamw(1e-3).eps(-1e-8))),
        ("AdamW eps = NaN", adam(Adam::adamw(1e-3).eps(f64::NAN))),
        (
            "AdamW weight decay = -0.01",
            adam(Adam::adamw(1e-3).weight_decay(-0.01)),
        ),
        (
            "AdamW weight decay = Inf",
            adam(Adam::adamw(1e-3).weight_decay(f64::INFINITY)),
        ),
        ("SGD momentum = -0.5", sgd(Sgd::new(0.1).momentum(-0.5))),
        ("SGD momentum = NaN", sgd(Sgd::new(0.1).momentum(f64::NAN))),
        (
            "SGD dampening = 2",
            sgd(Sgd::new(0.1).momentum(0.9).dampening(2.0)),
        ),
        (
            "SGD Nesterov without momentum",
            sgd(Sgd::new(0.1).nesterov(true)),
        ),
        (
            "SGD Nesterov with dampening",
            sgd(Sgd::new(0.1).momentum(0.9).dampening(0.1).nesterov(true)),
        ),
        ("Lion beta1 = 1.5", lion(Lion::new(1e-4).betas(1.5, 0.99))),
        ("Lion beta2 = -1", lion(Lion::new(1e-4).betas(0.9, -1.0))),
        (
            "unsigned 8-bit map for a first moment",
            presets::adamw_f32(1e-3)
                .with_state1(Storage::DYNAMIC8_UNSIGNED)
                .build(),
        ),
        (
            "unsigned 8-bit map for a parameter",
            presets::adamw_f32(1e-3)
                .with_param(Storage::DYNAMIC8_UNSIGNED)
                .build(),
        ),
        (
            "factorized first moment",
            presets::adamw_f32(1e-3)
                .with_state1(Storage::Factorized)
                .build(),
        ),
        (
            "rank-1 parameter",
            presets::adamw_f32(1e-3)
                .with_param(Storage::Rank1 {
                    map: MapKind::LinearWithoutZero4,
                    fallback: lpmm_quant::BlockSize::B128,
                })
                .build(),
        ),
        (
            "no parameter storage",
            presets::adamw_f32(1e-3).with_param(Storage::None).build(),
        ),
        (
            "Adafactor decay_rate = 0 (beta2_t would be 0 forever)",
            presets::adafactor_f32()
                .build()
                .with_hyper(Adafactor::new().decay_rate(0.0)),
        ),
        (
            "Adafactor eps1 = 0 (g / sqrt(0))",
            presets::adafactor_f32()
                .build()
                .with_hyper(Adafactor::new().eps(0.0, 1e-3)),
        ),
        (
            "Adafactor clip_threshold = -1",
            presets::adafactor_f32()
                .build()
                .with_hyper(Adafactor::new().clip_threshold(-1.0)),
        ),
        (
            "Adafactor beta1 = 1",
            presets::adafactor_8bit().beta1(1.0).build(),
        ),
        (
            "CAME beta3 = 1",
            presets::came_f32(1e-4).betas(0.9, 0.999, 1.0).build(),
        ),
        (
            "CAME instability not factorized (f32 state 3)",
            presets::came_f32(1e-4).with_state3(Storage::F32).build(),
        ),
        (
            "factorized state 3 for AdEMAMix (its slow moment is signed)",
            presets::ademamix_f32(1e-3)
                .with_state3(Storage::Factorized)
                .build(),
        ),
        (
            "unsigned 8-bit map for AdEMAMix's slow moment",
            presets::ademamix_f32(1e-3)
                .with_state3(Storage::DYNAMIC8_UNSIGNED)
                .build(),
        ),
        (
            "AdEMAMix alpha = NaN",
            presets::ademamix_f32(1e-3).alpha(f64::NAN).build(),
        ),
        (
            "AdEMAMix beta3 warmup with beta1 = 0 (ln 0)",
            presets::ademamix_f32(1e-3)
                .betas(0.0, 0.999, 0.9999)
                .warmup(None, Some(10))
                .build(),
        ),
        (
            "schedule-free beta1 = 0 (the evaluation point divides by beta1)",
            presets::schedule_free_adamw_f32(1e-3)
                .betas(0.0, 0.999)
                .build(),
        ),
        (
            "schedule-free factorized second moment",
            presets::schedule_free_adamw_f32(1e-3)
                .with_state2(Storage::Factorized)
                .build(),
        ),
        (
            "LAMB clamp_value = 0",
            presets::lamb_f32(1e-3).clamp_value(0.0).build(),
        ),
        ("LAMB eps = 0", presets::lamb_f32(1e-3).eps(0.0).build()),
        (
            "LAMB factorized second moment",
            presets::lamb_f32(1e-3)
                .with_state2(Storage::Factorized)
                .build(),
        ),
    ] {
        add("configuration", what, group(c));
    }
    for (what, norm) in [
        ("max_grad_norm = 0", 0.0),
        ("max_grad_norm = -1", -1.0),
        ("max_grad_norm = NaN", f64::NAN),
        ("max_grad_norm = Inf", f64::INFINITY),
    ] {
        add(
            "configuration",
            what,
            refused(Optimizer::new(opts().with_max_grad_norm(Some(norm)))),
        );
    }

    // --- Registration.
    for (what, storage, value) in [
        ("f32 parameter, initial NaN", Storage::F32, f32::NAN),
        (
            "f32 parameter, initial -Inf",
            Storage::F32,
            f32::NEG_INFINITY,
        ),
        (
            "bf16 parameter, initial 3.4e38 (finite, above bf16's max)",
            bf(StoreRounding::Nearest),
            3.4e38,
        ),
        (
            "bf16-SR parameter, initial -3.397e38",
            bf(StoreRounding::Stochastic),
            -3.397e38,
        ),
        (
            "Kahan parameter, initial 3.4e38",
            Storage::Bf16Kahan,
            3.4e38,
        ),
        (
            "Kahan parameter, initial 1.8e38 (above its 2^127 limit)",
            Storage::Bf16Kahan,
            1.8e38,
        ),
        (
            "split-f32 parameter, initial 3.4e38 (its bf16 half is Inf)",
            Storage::SplitF32,
            3.4e38,
        ),
        (
            "8-bit parameter, initial NaN",
            Storage::LINEAR8_GROUP64_SR,
            f32::NAN,
        ),
    ] {
        add("registration", what, with_init(storage, value));
    }
    add(
        "registration",
        "8-bit parameter, initial 3.4e38 (finite: block scale holds it)",
        match with_init(Storage::LINEAR8_GROUP64_SR, 3.4e38) {
            Seen::Silent(_) => Seen::Correct("stored exactly as the block's scale".into()),
            other => Seen::Silent(format!("a storable value refused: {other:?}")),
        },
    );
    {
        let mut opt = Optimizer::new(opts()).unwrap();
        let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
        opt.add_param("w", &[2], &[0.0; 2], g).unwrap();
        add(
            "registration",
            "duplicate name",
            refused(opt.add_param("w", &[2], &[0.0; 2], g)),
        );
        add(
            "registration",
            "shape with a zero dimension",
            refused(opt.add_param("z", &[3, 0], &[], g)),
        );
        add(
            "registration",
            "shape whose element count overflows usize",
            refused(opt.add_param("o", &[usize::MAX, 3], &[0.0], g)),
        );
        add(
            "registration",
            "initial values of the wrong length",
            refused(opt.add_param("l", &[4], &[0.0; 3], g)),
        );
        add(
            "registration",
            "group that does not exist",
            refused(opt.add_param("g", &[1], &[0.0], 7)),
        );
    }
    for name in [
        "maps",
        "maps/dynamic_signed_8",
        "w/param",
        "a/b/state1.absmax",
    ] {
        let mut opt = Optimizer::new(opts()).unwrap();
        let g = opt.add_group(presets::adamw_8bit_bf16(1e-3)).unwrap();
        opt.add_param(name, &[8], &[0.5; 8], g).unwrap();
        opt.add_param("w", &[8], &[0.25; 8], g).unwrap();
        add(
            "registration",
            &format!("parameter named `{name}` (checkpoint namespace)"),
            round_trips(
                &opt,
                &format!("name-{}.safetensors", name.replace('/', "_")),
            ),
        );
    }

    // --- Gradients and steps.
    {
        /// A gradient source whose second answer (the step asks twice) is shorter than its first.
        struct Shrinking(usize);
        impl lpmm_optim::Gradients<Cpu> for Shrinking {
            fn gradient(
                &mut self,
                _: ParamId,
                f: &mut lpmm_optim::WithGradient<'_, Cpu>,
            ) -> Result<(), OptimError> {
                self.0 += 1;
                let g = vec![0.1f32; if self.0 == 1 { 128 } else { 3 }];
                f(Some(lpmm_optim::backend::HostValues::F32(&g)))
            }
        }
        let mut o = Optimizer::new(opts()).unwrap();
        let g = o.add_group(presets::adamw_f32(1e-3)).unwrap();
        o.add_param("w", &[8, 16], &[0.5; 128], g).unwrap();
        add(
            "steps",
            "Step::given from a Gradients source whose second answer is shorter than its first",
            refused(o.step(lpmm_optim::Step::given(&mut Shrinking(0)))),
        );
    }
    let n = 300;
    let spike = |i: usize, v: f32| {
        let mut g = vec![0.01f32; n];
        g[i] = v;
        g
    };
    let sgdm_bf16 = ParamConfig::f32(Hyper::sgd(1e-30, 0.9))
        .with_grad(Storage::None)
        .with_state1(bf(StoreRounding::Nearest));
    add(
        "steps",
        "SGD momentum in bf16, released gradient 3.4e38",
        overflow(sgdm_bf16, &[0.1; 300], &[&spike(3, 3.4e38)], true),
    );
    let adamw_bf16 = presets::adamw_f32(1e-3)
        .with_grad(Storage::None)
        .with_state1(bf(StoreRounding::Nearest))
        .with_state2(bf(StoreRounding::Stochastic))
        .build();
    add(
        "steps",
        "AdamW second moment in bf16, gradient 5.832e20 (v = 3.401e38: finite f32, above bf16's max)",
        overflow(adamw_bf16, &[0.1; 300], &[&spike(7, 5.832e20)], true),
    );
    add(
        "steps",
        "AdamW first moment in bf16, gradient -3.39e38 over 8-bit states",
        overflow(
            presets::adamw_f32(1e-3)
                .with_grad(Storage::None)
                .with_state1(bf(StoreRounding::Nearest))
                .with_state2(Storage::DYNAMIC8_UNSIGNED)
                .with_min_quantized_size(0)
                .build(),
            &[0.1; 300],
            &[&spike(9, -3.39e38)],
            true,
        ),
    );
    let mut near_max = vec![0.1f32; n];
    near_max[0] = 3.3e38;
    add(
        "steps",
        "bf16 parameter pushed past bf16's max by SGD",
        overflow(
            ParamConfig::f32(Hyper::sgd(1.0, 0.0))
                .with_param(bf(StoreRounding::Nearest))
                .with_grad(Storage::None),
            &near_max,
            &[&spike(0, -1e37)],
            true,
        ),
    );
    let mut kahan_top = vec![0.1f32; n];
    kahan_top[0] = 1.6e38;
    add(
        "steps",
        "Kahan parameter pushed past 2^127",
        overflow(
            ParamConfig::f32(Hyper::sgd(1.0, 0.0))
                .with_param(Storage::Bf16Kahan)
                .with_grad(Storage::None),
            &kahan_top,
            &[&spike(0, -1.5e37)],
            true,
        ),
    );
    add(
        "steps",
        "split-f32 parameter pushed past bf16's max",
        overflow(
            ParamConfig::f32(Hyper::sgd(1.0, 0.0))
                .with_param(Storage::SplitF32)
                .with_grad(Storage::None),
            &near_max,
            &[&spike(0, -1e37)],
            true,
        ),
    );
    add(
        "steps",
        "factorized second moment, gradients 3e21 (row statistic overflows)",
        {
            let mut opt = Optimizer::new(opts()).unwrap();
            let g = opt
                .add_group(
                    presets::adamw_f32(1e-3)
                        .with_grad(Storage::None)
                        .with_state2(Storage::Factorized)
                        .with_min_quantized_size(0)
                        .build(),
                )
                .unwrap();
            let id = opt.add_param("w", &[10, 30], &[0.1; 300], g).unwrap();
            let mut grad = vec![0.01f32; 300];
            grad[..30].fill(3e21);
            let r = opt.step(lpmm_optim::Step::param(id, &grad)).unwrap();
            if !r.non_finite.is_empty() && finite(&opt, id, 300) {
                Seen::Reported("step report lists the parameter; statistics kept".into())
            } else {
                Seen::Silent(format!("{r:?}"))
            }
        },
    );
    for (what, v) in [
        ("gradient NaN (f32 accumulator)", f32::NAN),
        ("gradient +Inf (f32 accumulator)", f32::INFINITY),
    ] {
        add(
            "steps",
            what,
            overflow(
                presets::adamw_f32(1e-3).build(),
                &[0.1; 300],
                &[&spike(5, v)],
                false,
            ),
        );
    }
    add(
        "steps",
        "f32 accumulator: 3e38 + 3e38",
        overflow(
            presets::adamw_f32(1e-3).build(),
            &[0.1; 300],
            &[&spike(5, 3e38), &spike(5, 3e38)],
            false,
        ),
    );
    add(
        "steps",
        "bf16 accumulator: 3e38 + 1e38",
        overflow(
            presets::adamw_8bit_bf16(1e-3).build(),
            &[0.1; 300],
            &[&spike(5, 3e38), &spike(5, 1e38)],
            false,
        ),
    );
    add(
        "steps",
        "8-bit accumulator (LPMM-SGDM): 3e38 + 3e38",
        overflow(
            presets::lpmm_sgdm(1e-3, 0.9).build(),
            &[0.1; 300],
            &[&spike(64, 3e38), &spike(64, 3e38)],
            false,
        ),
    );
    add(
        "steps",
        "8-bit accumulator: micro-batches 0.5 then 3e38 (the 0.5 must not be dropped)",
        {
            let (mut opt, id) = one(presets::lpmm_sgdm(1.0, 0.0).build(), 64);
            let mut a = vec![0f32; 64];
            a[0] = 0.5;
            a[1] = 3e38;
            let mut b = vec![0f32; 64];
            b[0] = 0.25;
            b[1] = 3e38;
            opt.accumulate(id, &a).unwrap();
            match opt.accumulate(id, &b) {
                Err(e) => Seen::Refused(variant(&e)),
                Ok(()) => Seen::Silent("the sum 6e38 was accepted".into()),
            }
        },
    );
    add(
        "steps",
        "8-bit accumulator, gradient NaN",
        overflow(
            presets::lpmm_sgdm(1e-3, 0.9).build(),
            &[0.1; 300],
            &[&spike(3, f32::NAN)],
            false,
        ),
    );
    add(
        "steps",
        "SkipStep policy, one gradient overflows a bf16 momentum",
        {
            let mut opt =
                Optimizer::new(opts().with_non_finite(NonFinitePolicy::SkipStep)).unwrap();
            let g = opt
                .add_group(
                    ParamConfig::f32(Hyper::sgd(1e-30, 0.9))
                        .with_state1(bf(StoreRounding::Nearest)),
                )
                .unwrap();
            let id = opt.add_param("w", &[300], &[0.1; 300], g).unwrap();
            opt.accumulate(id, &spike(3, 3.4e38)).unwrap();
            let r = opt.step(lpmm_optim::Accumulated).unwrap();
            if !r.non_finite.is_empty() && finite(&opt, id, 300) {
                Seen::Reported("reported; the element left unchanged".into())
            } else {
                Seen::Silent(format!("{r:?}"))
            }
        },
    );
    for policy in [MissingGradientPolicy::Warn, MissingGradientPolicy::Error] {
        let mut opt = Optimizer::new(opts()).unwrap();
        let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
        let a = opt.add_param("a", &[4], &[0.5; 4], g).unwrap();
        opt.add_param("b", &[4], &[0.5; 4], g).unwrap();
        opt.settings_mut().missing_gradient = policy;
        opt.accumulate(a, &[0.1; 4]).unwrap();
        let what = format!("a parameter without a gradient in a step ({policy:?} policy)");
        let seen = match opt.step(lpmm_optim::Accumulated) {
            Ok(r)
                if r.missing_gradients.names == ["b"] && policy != MissingGradientPolicy::Error =>
            {
                Seen::Reported(
                    "step report names the parameter (missing_gradients); a warning".into(),
                )
            }
            Err(e @ OptimError::MissingGradient { .. }) if opt.status().steps == 0 => {
                Seen::Refused(variant(&e))
            }
            other => Seen::Silent(format!("{other:?}")),
        };
        add("steps", &what, seen);
    }
    {
        let (mut opt, id) = one(presets::adamw_f32(1e-3).build(), 4);
        add(
            "steps",
            "gradient of the wrong length",
            refused(opt.accumulate(id, &[0.0; 5])),
        );
        add(
            "steps",
            "released gradient of the wrong length",
            refused(opt.step(lpmm_optim::Step::param(id, &[0.0; 3]))),
        );
        let (mut other, _) = one(presets::adamw_f32(1e-3).build(), 4);
        other.add_param("x", &[1], &[0.0], 0).unwrap();
        let foreign = other.param("x").map(|p| p.id).unwrap();
        add(
            "steps",
            "a ParamId of another optimizer",
            refused(opt.accumulate(foreign, &[0.0])),
        );
        let (mut released, rid) = one(presets::adamw_4bit_bf16_sr_released(1e-3).build(), 4);
        add(
            "steps",
            "accumulate into a parameter without accumulator",
            refused(released.accumulate(rid, &[0.0; 4])),
        );
    }

    // --- Counters and state access.
    {
        let (mut opt, id) = one(presets::adamw_f32(1e-3).build(), 4);
        add(
            "counters",
            "restore(steps = u64::MAX)",
            refused(PartsMut::of(&mut opt).restore(id, u64::MAX, 0, false, LrRule::Group)),
        );
        add(
            "counters",
            "restore(steps = 2^53 + 1)",
            refused(PartsMut::of(&mut opt).restore(id, (1 << 53) + 1, 0, false, LrRule::Group)),
        );
        add(
            "counters",
            "restore(accumulations = u64::MAX)",
            refused(PartsMut::of(&mut opt).restore(id, 0, u64::MAX, false, LrRule::Group)),
        );
        add(
            "counters",
            "restore(lr rule Scaled(NaN))",
            refused(PartsMut::of(&mut opt).restore(id, 0, 0, false, LrRule::Scaled(f64::NAN))),
        );
        add(
            "counters",
            "restore(lr rule Scaled(-2))",
            refused(PartsMut::of(&mut opt).restore(id, 0, 0, false, LrRule::Scaled(-2.0))),
        );
        add(
            "counters",
            "set_steps(u64::MAX)",
            refused(PartsMut::of(&mut opt).set_steps(u64::MAX)),
        );
        PartsMut::of(&mut opt).set_steps(1 << 53).unwrap();
        opt.accumulate(id, &[0.1; 4]).unwrap();
        add(
            "counters",
            "a step past 2^53 (global counter)",
            refused(opt.step(lpmm_optim::Accumulated)),
        );
        let (mut opt, id) = one(presets::adamw_f32(1e-3).build(), 4);
        PartsMut::of(&mut opt)
            .restore(id, 1 << 53, 0, false, LrRule::Group)
            .unwrap();
        add(
            "counters",
            "a step past 2^53 (parameter counter)",
            refused(opt.step(lpmm_optim::Step::param(id, &[0.1; 4]))),
        );
        let (mut opt, id) = one(presets::adamw_f32(1e-3).build(), 4);
        PartsMut::of(&mut opt)
            .restore(id, 0, 1 << 53, false, LrRule::Group)
            .unwrap();
        add(
            "counters",
            "an accumulate past 2^53",
            refused(opt.accumulate(id, &[0.1; 4])),
        );
        let (mut released, rid) = one(presets::adamw_4bit_bf16_sr_released(1e-3).build(), 4);
        add(
            "counters",
            "restore(pending) without an accumulator",
            refused(PartsMut::of(&mut released).restore(rid, 0, 0, true, LrRule::Group)),
        );
        let (mut opt, id) = one(presets::adamw_f32(1e-3).build(), 4);
        let mut out = [0f32; 4];
        add(
            "state access",
            "read(State1) into a short buffer",
            refused(opt.read(id, SlotKind::State1, &mut out[..3])),
        );
        add(
            "state access",
            "read(State2) into a long buffer",
            refused(opt.read(id, SlotKind::State2, &mut vec![0f32; 5])),
        );
        for (what, state) in [
            ("restore_rule_state(NaN)", [f64::NAN, 0.0]),
            ("restore_rule_state(-1)", [0.0, -1.0]),
            ("restore_rule_state(Inf)", [f64::INFINITY, 1.0]),
        ] {
            add(
                "counters",
                what,
                refused(
                    PartsMut::of(&mut opt).restore_rule_state(id, lpmm_optim::RuleState(state)),
                ),
            );
        }
        // Schedule-free AdamW at its evaluation point: no step of any kind until train().
        let (mut sf, sid) = one(presets::schedule_free_adamw_f32(1e-3).build(), 4);
        sf.accumulate(sid, &[0.1; 4]).unwrap();
        sf.step(lpmm_optim::Accumulated).unwrap();
        sf.set_mode(Mode::Eval, lpmm_optim::Lent::None).unwrap();
        add(
            "evaluation mode",
            "step(Accumulated) at the evaluation point",
            refused(sf.step(lpmm_optim::Accumulated)),
        );
        add(
            "evaluation mode",
            "Step::param at the evaluation point",
            refused(sf.step(lpmm_optim::Step::param(sid, &[0.1; 4]))),
        );
        add(
            "evaluation mode",
            "Step::states_only at the evaluation point",
            refused(sf.step(lpmm_optim::Step::states_only(sid, &[0.1; 4]))),
        );
        // Lent parameters' buffers (tests/gradients.rs checks that nothing moves).
        {
            use lpmm_optim::backend::{HostValues, HostValuesMut};
            use lpmm_optim::{Lent, Step};
            let config = presets::adamw_8bit(1e-3).build();
            let mut lo = Optimizer::new(OptimizerOptions::default()).unwrap();
            let g = lo.add_group(config).unwrap();
            let held = lo.add_param("held", &[8], &[0.5; 8], g).unwrap();
            let buf = vec![0.5f32; 8];
            let lent = lo
                .add_lent_param("lent", &[8], HostValues::F32(&buf), g, config)
                .unwrap();
            lo.accumulate(lent, &[0.1; 8]).unwrap();
            add(
                "lent buffers",
                "a step of a lent parameter without its buffer",
                refused(lo.step(lpmm_optim::Accumulated)),
            );
            let mut other = [0f32; 8];
            add(
                "lent buffers",
                "a buffer for a parameter lpmm holds",
                refused(
                    lo.step(
                        Step::accumulated()
                            .lent(Lent::Buffers(&mut [(held, HostValuesMut::F32(&mut other))])),
                    ),
                ),
            );
            let (mut a, mut b) = ([0.5f32; 8], [0.5f32; 8]);
            add(
                "lent buffers",
                "the same parameter's buffer twice",
                refused(lo.step(Step::accumulated().lent(Lent::Buffers(&mut [
                    (lent, HostValuesMut::F32(&mut a)),
                    (lent, HostValuesMut::F32(&mut b)),
                ])))),
            );
            let mut short = [0f32; 7];
            add(
                "lent buffers",
                "a lent buffer one element short",
                refused(
                    lo.step(
                        Step::accumulated()
                            .lent(Lent::Buffers(&mut [(lent, HostValuesMut::F32(&mut short))])),
                    ),
                ),
            );
            let mut b16 = [lpmm_formats::bf16::from_f32(0.5); 8];
            add(
                "lent buffers",
                "a bf16 buffer for an f32 parameter",
                refused(
                    lo.step(
                        Step::accumulated()
                            .lent(Lent::Buffers(&mut [(lent, HostValuesMut::Bf16(&mut b16))])),
                    ),
                ),
            );
            add(
                "lent buffers",
                "Step::param of a lent parameter without its buffer",
                refused(lo.step(Step::param(lent, &[0.1; 8]))),
            );
        }
        let twice = {
            let mut v = [0f32; 4];
            sf.read(sid, SlotKind::Param, &mut v).unwrap();
            sf.set_mode(Mode::Eval, lpmm_optim::Lent::None).unwrap();
            let mut w = [0f32; 4];
            sf.read(sid, SlotKind::Param, &mut w).unwrap();
            v == w
        };
        add(
            "evaluation mode",
            "set_mode(Eval, Lent::None) twice",
            if twice {
                Seen::Correct("a no-op: the parameters stay at x".into())
            } else {
                Seen::Silent("moved x again".into())
            },
        );
        add(
            "state access",
            "read(Param) into a short buffer",
            refused(opt.read(id, SlotKind::Param, &mut out[..3])),
        );
        add("state access", "set_lr(NaN)", refused(opt.set_lr(f64::NAN)));
        add("state access", "set_lr(-1)", refused(opt.set_lr(-1.0)));
        add(
            "state access",
            "set_lr(1e39) (beyond f32)",
            refused(opt.set_lr(1e39)),
        );
        add(
            "state access",
            "set_group_lr on a missing group",
            refused(opt.set_group_lr(3, 0.1)),
        );
        add(
            "state access",
            "set_lr(1e-50) (a positive rate that rounds to 0 in f32, as a registered group's may not)",
            refused(opt.set_lr(1e-50)),
        );
        {
            // Group 1's parameter has its own rate (1.0 against the group's 1e-3: `Scaled(1000)`),
            // so 1e36 fits group 0 and not it: nothing may change.
            let mut two = Optimizer::new(opts()).unwrap();
            let g0 = two.add_group(presets::adamw_f32(1e-3)).unwrap();
            let g1 = two.add_group(presets::adamw_f32(1e-3)).unwrap();
            let a = two.add_param("a", &[4], &[0.1; 4], g0).unwrap();
            two.add_param_with("b", &[4], &[0.1; 4], g1, presets::adamw_f32(1.0))
                .unwrap();
            let r = two.set_lr(1e36);
            let lr = two.param(a).unwrap().config.hyper.lr();
            add(
                "state access",
                "set_lr whose rate fits one group and not another's scaled parameter",
                match r {
                    Err(_) if lr == 1e-3 => {
                        Seen::Refused(format!("{}; group 0 kept 1e-3", r.unwrap_err()))
                    }
                    Err(_) => Seen::Silent(format!("refused, but group 0's rate became {lr}")),
                    Ok(()) => Seen::Silent("accepted".into()),
                },
            );
        }
        let host = Parts::of(&opt)
            .export_slot(id, SlotKind::Param, None)
            .unwrap();
        let mut bad = host.clone();
        bad.regions[0].bytes[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        add(
            "state access",
            "import_slot of a NaN parameter",
            refused(PartsMut::of(&mut opt).import_slot(id, SlotKind::Param, &bad, None)),
        );
        let mut short = host;
        short.regions[0].bytes.truncate(8);
        add(
            "state access",
            "import_slot of the wrong length",
            refused(PartsMut::of(&mut opt).import_slot(id, SlotKind::Param, &short, None)),
        );
        let (mut b16, bid) = one(
            presets::adamw_f32(1e-3)
                .with_state1(bf(StoreRounding::Nearest))
                .build(),
            4,
        );
        let mut inf = Parts::of(&b16)
            .export_slot(bid, SlotKind::State1, None)
            .unwrap();
        inf.regions[0].bytes[..2].copy_from_slice(&0x7F80u16.to_le_bytes());
        add(
            "state access",
            "import_slot of a bf16 +Inf momentum",
            refused(PartsMut::of(&mut b16).import_slot(bid, SlotKind::State1, &inf, None)),
        );
    }
    // Factorized statistics that are finite but rebuild +Inf (issue 46), or negative: refused,
    // naming the parameter and slot, and nothing changes.
    for (rule, config, slot) in factorized_cases() {
        for (what, region, at, value) in [
            ("a column at f32::MAX (rebuilds +Inf)", ".col", 6, f32::MAX),
            ("a negative row", ".row", 0, -1.0),
        ] {
            let (mut opt, id) = factorized_after_three_steps(config);
            let before = Parts::of(&opt).export_slot(id, slot, None).unwrap();
            let bad = with_value(&before, region, at, value);
            let seen = match PartsMut::of(&mut opt).import_slot(id, slot, &bad, None) {
                Err(e) if Parts::of(&opt).export_slot(id, slot, None).unwrap() != before => {
                    Seen::Silent(format!("refused ({e}), but the slot changed"))
                }
                Err(e) if !e.to_string().contains("w") || !e.to_string().contains(slot.name()) => {
                    Seen::Silent(format!(
                        "refused without naming the parameter and slot: {e}"
                    ))
                }
                r => refused(r),
            };
            add(
                "state access",
                &format!("import_slot of {rule}'s factorized {}: {what}", slot.name()),
                seen,
            );
        }
    }
    {
        // The same statistics in a checkpoint, resealed: refused by `load`.
        let (_, config, slot) = factorized_cases()[3];
        let (opt, id) = factorized_after_three_steps(config);
        let path = dir().join("factorized-inf.safetensors");
        opt.save(&path, Checkpoint::new()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let _ = id;
        add(
            "checkpoints",
            "CAME's factorized state 3 with a column at f32::MAX (rebuilds +Inf), resealed",
            tensor_edit(&bytes, "factorized-inf-forged", |t| {
                let (_, _, _, b) = tensor(t, &format!("w/{}.col", slot.name()));
                b[24..28].copy_from_slice(&f32::MAX.to_le_bytes());
            }),
        );
    }
    // A step whose statistics would rebuild +Inf: reported, the statistics kept (issue 46).
    for (rule, config, slot) in factorized_cases() {
        let (mut opt, id) = factorized_after_three_steps(config);
        // Equal rows (each rebuilt value is its column) and columns at the largest f32: finite.
        let near = with_all(
            &with_all(
                &Parts::of(&opt).export_slot(id, slot, None).unwrap(),
                ".row",
                1.0,
            ),
            ".col",
            f32::MAX,
        );
        PartsMut::of(&mut opt)
            .import_slot(id, slot, &near, None)
            .unwrap();
        // Gradients in one row only: that row's average grows past the others, and so would
        // (row / mean) x column, past f32::MAX.
        let mut grad = vec![1e-3f32; 120];
        grad[..10].fill(100.0);
        let report = opt.step(lpmm_optim::Step::param(id, &grad)).unwrap();
        let kept = Parts::of(&opt).export_slot(id, slot, None).unwrap() == near;
        let seen = if !report.non_finite.is_empty() && kept && finite(&opt, id, 120) {
            Seen::Reported("step report lists the parameter; statistics kept".into())
        } else {
            Seen::Silent(format!("{report:?}, statistics kept: {kept}"))
        };
        add(
            "steps",
            &format!(
                "{rule}'s factorized {}: a step would rebuild +Inf",
                slot.name()
            ),
            seen,
        );
    }
    {
        let mut opt = Optimizer::new(opts()).unwrap();
        let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
        opt.add_param("w", &[4], &[0.1; 4], g).unwrap();
        let lr = 0.0011168202304366027;
        opt.set_lr(lr).unwrap();
        add(
            "state access",
            "set_lr(0.0011168202304366027), saved and loaded",
            round_trips(&opt, "lr.safetensors"),
        );
    }

    // --- Checkpoint files.
    let base = saved(&dir().join("base.safetensors"));
    add(
        "checkpoint",
        "a missing file",
        file_refused(
            Canonical::read(dir().join("nothing-here")).and_then(|c| c.into_optimizer(Cpu)),
        ),
    );
    add("checkpoint", "an empty file", load_bytes(&[], "empty"));
    add("checkpoint", "8 bytes", load_bytes(&base[..8], "eight"));
    add(
        "checkpoint",
        "truncated by one byte",
        load_bytes(&base[..base.len() - 1], "truncated"),
    );
    add(
        "checkpoint",
        "half of the file",
        load_bytes(&base[..base.len() / 2], "half"),
    );
    add(
        "checkpoint",
        "random bytes",
        load_bytes(
            &(0..5000u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
                .collect::<Vec<_>>(),
            "random",
        ),
    );
    add("checkpoint", "header length 2^63", {
        let mut b = base.clone();
        b[..8].copy_from_slice(&(1u64 << 63).to_le_bytes());
        load_bytes(&b, "hugeheader")
    });
    add("checkpoint", "one bit flipped in a tensor (checksum)", {
        let mut b = base.clone();
        let at = b.len() - 100;
        b[at] ^= 4;
        load_bytes(&b, "bitflip")
    });
    add(
        "checkpoint",
        "a learning rate edited, checksum kept",
        load_bytes(
            &forge(
                &base,
                false,
                |m| m["groups"][0]["hyper"]["Adam"]["lr"] = 0.5.into(),
                |_| {},
            ),
            "lr-edit",
        ),
    );
    // A corrupted key must not switch the checksum off: the renamed key is refused, and so is a
    // file without the checksum (the tensor byte flipped here would otherwise load).
    let renamed = |from: &'static str, to: &'static str| {
        move |m: &mut serde_json::Value| {
            let o = m.as_object_mut().unwrap();
            let v = o.remove(from).unwrap();
            o.insert(to.into(), v);
        }
    };
    let flip_last = |t: &mut Tensors| {
        let bytes = &mut t.last_mut().unwrap().3;
        *bytes.last_mut().unwrap() ^= 0x40;
    };
    add(
        "checkpoint",
        "the checksum's key renamed (`crc32` to `brc32`) and a tensor byte flipped",
        load_bytes(
            &forge(&base, false, renamed("crc32", "brc32"), flip_last),
            "crc-renamed",
        ),
    );
    add(
        "checkpoint",
        "the checksum removed and a tensor byte flipped",
        load_bytes(
            &forge(
                &base,
                false,
                |m| {
                    m.as_object_mut().unwrap().remove("crc32");
                },
                flip_last,
            ),
            "crc-removed",
        ),
    );
    add(
        "checkpoint",
        "an unknown metadata key added, checksum kept",
        load_bytes(
            &forge(&base, false, |m| m["future_field"] = true.into(), |_| {}),
            "unknown-key",
        ),
    );
    add(
        "checkpoint",
        "an unknown key in a parameter's metadata, checksum kept",
        load_bytes(
            &forge(
                &base,
                false,
                |m| m["params"][0]["future_field"] = 1.into(),
                |_| {},
            ),
            "unknown-param-key",
        ),
    );
    add("checkpoint", "a safetensors file without lpmm metadata", {
        let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &[0u8; 4])
            .unwrap();
        load_bytes(
            &safetensors::tensor::serialize([("x", v)], None).unwrap(),
            "foreign",
        )
    });
    add(
        "checkpoint",
        "another format name",
        meta_edit(&base, "format", |m| m["format"] = "other".into()),
    );
    add(
        "checkpoint",
        "version 2",
        meta_edit(&base, "version", |m| m["version"] = 2.into()),
    );
    add(
        "checkpoint",
        "metadata that is not JSON",
        load_bytes(
            &forge(
                &base,
                false,
                |m| *m = serde_json::Value::String("{".into()),
                |_| {},
            ),
            "notjson",
        ),
    );
    // Keys the decoder does not know (a newer writer's field, a corrupted name): refused at
    // every depth, not dropped, whether resealed or not (a dropped key would not reach the
    // checksum, which covers the parsed metadata).
    for (what, name, edit) in [
        (
            "an unknown key in the options",
            "k-options",
            (|m: &mut serde_json::Value| m["options"]["future"] = true.into())
                as fn(&mut serde_json::Value),
        ),
        (
            "an unknown key in a group's configuration",
            "k-group",
            |m| m["groups"][0]["future"] = 1.into(),
        ),
        (
            "an unknown key in AdamW's hyperparameters (amsgrad)",
            "k-hyper",
            |m| m["params"][0]["requested"]["hyper"]["Adam"]["amsgrad"] = true.into(),
        ),
        ("an unknown key in a quantized storage", "k-storage", |m| {
            m["params"][0]["requested"]["state1"]["Quantized"]["future"] = 1.into()
        }),
        ("state3 renamed state9", "k-rename", |m| {
            let r = m["params"][0]["requested"].as_object_mut().unwrap();
            let v = r.remove("state3").unwrap();
            r.insert("state9".into(), v);
        }),
    ] {
        add("checkpoint", what, meta_edit(&base, name, edit));
        add(
            "checkpoint",
            &format!("{what}, not resealed"),
            load_bytes(&forge(&base, false, edit, |_| {}), name),
        );
    }
    add(
        "checkpoint",
        "global step counter 2^53 + 1",
        meta_edit(&base, "steps", |m| {
            m["global_steps"] = ((1u64 << 53) + 1).into()
        }),
    );
    add(
        "checkpoint",
        "parameter step counter u64::MAX",
        meta_edit(&base, "psteps", |m| {
            m["params"][0]["steps"] = u64::MAX.into()
        }),
    );
    add(
        "checkpoint",
        "learning rate NaN (null)",
        meta_edit(&base, "lrnan", |m| {
            m["groups"][0]["hyper"]["Adam"]["lr"] = serde_json::Value::Null
        }),
    );
    add(
        "checkpoint",
        "eps = 0",
        meta_edit(&base, "eps", |m| {
            m["params"][0]["requested"]["hyper"]["Adam"]["eps"] = 0.0.into()
        }),
    );
    add(
        "checkpoint",
        "max_grad_norm = -1",
        meta_edit(&base, "norm", |m| {
            m["options"]["max_grad_norm"] = (-1.0).into()
        }),
    );
    add(
        "checkpoint",
        "group index 7 of 1",
        meta_edit(&base, "group", |m| m["params"][0]["group"] = 7.into()),
    );
    add(
        "checkpoint",
        "two parameters with one name",
        meta_edit(&base, "dup", |m| m["params"][1]["name"] = "a".into()),
    );
    add(
        "checkpoint",
        "a shape of 2^40 elements",
        meta_edit(&base, "shape40", |m| {
            m["params"][0]["shape"] = serde_json::json!([1u64 << 40])
        }),
    );
    add(
        "checkpoint",
        "a shape doubled (tensors too short)",
        meta_edit(&base, "shape2", |m| {
            m["params"][0]["shape"] = serde_json::json!([600])
        }),
    );
    add(
        "checkpoint",
        "a zero dimension",
        meta_edit(&base, "shape0", |m| {
            m["params"][0]["shape"] = serde_json::json!([300, 0])
        }),
    );
    add(
        "checkpoint",
        "storages changed under the tensors",
        meta_edit(&base, "storage", |m| {
            m["params"][0]["requested"]["state1"] = "F32".into()
        }),
    );
    add(
        "checkpoint",
        "pending gradient without an accumulator",
        meta_edit(&base, "pending", |m| {
            m["params"][0]["requested"]["grad"] = "None".into();
            m["params"][0]["pending"] = true.into();
        }),
    );
    add(
        "checkpoint",
        "learning-rate rule Scaled(-1)",
        meta_edit(&base, "scaled", |m| {
            m["params"][0]["lr_rule"] = serde_json::json!({"Scaled": -1.0})
        }),
    );
    add(
        "checkpoint",
        "a tensor missing",
        tensor_edit(&base, "missing", |t| t.retain(|x| x.0 != "a/state2")),
    );
    add(
        "checkpoint",
        "an extra tensor",
        tensor_edit(&base, "extra", |t| {
            let mut x = t[0].clone();
            x.0 = "zzz".into();
            t.push(x);
        }),
    );
    add(
        "checkpoint",
        "rank-1 scales reshaped, same element count",
        tensor_edit(&base, "reshape", |t| {
            let x = tensor(t, "r/state2.scales");
            let n: usize = x.2.iter().product();
            x.2 = vec![2, n / 2];
        }),
    );
    add(
        "checkpoint",
        "rank-1 scales reshaped (checksum kept)",
        load_bytes(
            &forge(
                &base,
                false,
                |_| {},
                |t| {
                    let x = tensor(t, "r/state2.scales");
                    let n: usize = x.2.iter().product();
                    x.2 = vec![n / 2, 2];
                },
            ),
            "reshape-unsealed",
        ),
    );
    add(
        "checkpoint",
        "a tensor of another dtype",
        tensor_edit(&base, "dtype", |t| {
            let x = tensor(t, "a/param");
            x.1 = safetensors::Dtype::F16;
        }),
    );
    add(
        "checkpoint",
        "a tensor one element short",
        tensor_edit(&base, "short", |t| {
            let x = tensor(t, "a/state1");
            x.3.pop();
            x.2 = vec![x.3.len()];
        }),
    );
    add(
        "checkpoint",
        "a code map changed",
        tensor_edit(&base, "map", |t| {
            let x = t.iter_mut().find(|x| x.0.starts_with("maps/")).unwrap();
            x.3[4..8].copy_from_slice(&0.123f32.to_le_bytes());
        }),
    );
    let set_bf16 = |name: &'static str, bits: u16| {
        move |t: &mut Tensors| {
            let x = tensor(t, name);
            x.3[..2].copy_from_slice(&bits.to_le_bytes());
        }
    };
    add(
        "checkpoint",
        "a bf16 parameter holding +Inf",
        tensor_edit(&base, "inf", set_bf16("a/param", 0x7F80)),
    );
    add(
        "checkpoint",
        "a bf16 parameter holding NaN",
        tensor_edit(&base, "nan", set_bf16("a/param", 0x7FC1)),
    );
    add(
        "checkpoint",
        "a Kahan value above 2^127 + 2^120",
        tensor_edit(&base, "kahan", set_bf16("r/param", 0x7F7F)),
    );
    add(
        "checkpoint",
        "a Kahan compensation above 2^119",
        tensor_edit(&base, "comp", set_bf16("r/param.comp", 0x7C00)),
    );
    add(
        "checkpoint",
        "a block scale NaN",
        tensor_edit(&base, "absmax", |t| {
            let x = tensor(t, "a/state1.absmax");
            x.3[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        }),
    );
    add(
        "checkpoint",
        "a block scale negative",
        tensor_edit(&base, "absneg", |t| {
            let x = tensor(t, "a/state2.absmax");
            x.3[..4].copy_from_slice(&(-1.0f32).to_le_bytes());
        }),
    );
    add(
        "checkpoint",
        "a rank-1 scale +Inf",
        tensor_edit(&base, "r1inf", |t| {
            let x = tensor(t, "r/state2.scales");
            x.3[..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        }),
    );

    // Loading into a live optimizer.
    let live = || {
        let mut opt = Optimizer::new(opts()).unwrap();
        let g = opt.add_group(presets::adamw_f32(1e-3)).unwrap();
        opt.add_param("w", &[16], &[0.1; 16], g).unwrap();
        opt
    };
    let other_path = dir().join("other.safetensors");
    {
        let mut o = Optimizer::new(opts().with_seed(99)).unwrap();
        let g = o.add_group(presets::lpmm_sgdm(0.5, 0.9)).unwrap();
        o.add_param("w", &[16], &[0.3; 16], g).unwrap();
        o.save(&other_path, Checkpoint::new()).unwrap();
    }
    {
        let mut opt = live();
        let before = Parts::of(&opt).canonical(None).unwrap().to_bytes().unwrap();
        let r = opt.load(&other_path, Checkpoint::new());
        let unchanged = Parts::of(&opt).canonical(None).unwrap().to_bytes().unwrap() == before;
        add(
            "checkpoint",
            "load: same names and shapes, other storages, optimizer, lr and seed",
            match (file_refused(r), unchanged) {
                (Seen::Refused(s), true) => Seen::Refused(s),
                (other, _) => Seen::Silent(format!("{other:?}, unchanged {unchanged}")),
            },
        );
        let r = opt.load(
            &other_path,
            Checkpoint::new().policy(LoadPolicy::ReplaceConfiguration),
        );
        let back = Canonical::read(&other_path)
            .and_then(|c| c.into_optimizer(Cpu))
            .unwrap();
        add(
            "checkpoint",
            "load with LoadPolicy::ReplaceConfiguration: the same file",
            match r {
                Ok(())
                    if Parts::of(&opt).canonical(None).unwrap().to_bytes()
                        == Parts::of(&back).canonical(None).unwrap().to_bytes() =>
                {
                    Seen::Correct("the checkpoint's configuration and state, as asked".into())
                }
                other => Seen::Silent(format!("{other:?}")),
            },
        );
    }
    {
        let mut opt = live();
        let mut other = Optimizer::new(opts()).unwrap();
        let g = other.add_group(presets::adamw_f32(1e-3)).unwrap();
        other.add_param("v", &[16], &[0.1; 16], g).unwrap();
        let path = dir().join("names.safetensors");
        other.save(&path, Checkpoint::new()).unwrap();
        add(
            "checkpoint",
            "load: other parameter names",
            file_refused(opt.load(&path, Checkpoint::new())),
        );
    }

    // --- Saving.
    {
        let opt = live();
        let name = format!("{}.safetensors", "n".repeat(238));
        add(
            "saving",
            "a valid 250-character file name",
            round_trips(&opt, &name),
        );
        let d = dir().join("stale");
        std::fs::create_dir_all(&d).unwrap();
        let stale = d.join(".ckpt.safetensors.tmp-4194303-0");
        std::fs::write(&stale, vec![0u8; 4096]).unwrap();
        opt.save(d.join("ckpt.safetensors"), Checkpoint::new())
            .unwrap();
        add(
            "saving",
            "a temporary file left by a killed save",
            if stale.exists() {
                Seen::Silent("left in place".into())
            } else {
                Seen::Correct("removed by the next save".into())
            },
        );
        add(
            "saving",
            "saving to a directory",
            file_refused(opt.save(dir(), Checkpoint::new())),
        );
        // Loading into an optimizer whose parameters are lent (a framework's tensors): every
        // check before the first write, and another update rule refused (the lent layout and
        // step plan stay this optimizer's).
        {
            let lent_opt = |config: ParamConfig, seed: u64| {
                let mut o = Optimizer::new(opts().with_seed(seed)).unwrap();
                let g = o.add_group(config).unwrap();
                let buffers = vec![vec![0.25f32; 64], vec![0.5f32; 64]];
                for (k, b) in buffers.iter().enumerate() {
                    o.add_lent_param(
                        &format!("p{k}"),
                        &[8, 8],
                        lpmm_optim::backend::HostValues::F32(b),
                        g,
                        config,
                    )
                    .unwrap();
                }
                (o, buffers)
            };
            let steps = |o: &mut Optimizer, buffers: &mut Vec<Vec<f32>>, n: usize| {
                for k in 0..n {
                    let mut grads = vec![vec![0.01 * (k as f32 + 1.0); 64]; 2];
                    o.step(
                        lpmm_optim::Step::given(&mut grads).lent(lpmm_optim::Lent::Lender(buffers)),
                    )
                    .unwrap();
                }
            };
            let state = |o: &Optimizer, bufs: &Vec<Vec<f32>>| {
                (
                    bufs.clone(),
                    o.param("p0").unwrap().steps,
                    o.param("p0").unwrap().config,
                    o.status().options.seed,
                )
            };
            let path = dir().join("lent.safetensors");
            let adamw = presets::adamw_f32(1e-3).build();
            for (what, from, into) in [
                (
                    "Lion's checkpoint into AdamW",
                    presets::lion_8bit(1e-4).build(),
                    adamw,
                ),
                (
                    "LAMB's checkpoint into AdamW",
                    presets::lamb_f32(1e-3).build(),
                    adamw,
                ),
                (
                    "Muon's checkpoint into SGD with momentum",
                    presets::muon_f32(0.02).build(),
                    presets::sgdm_f32(1e-2, 0.9).build(),
                ),
            ] {
                let (mut src, mut src_bufs) = lent_opt(from, 7);
                steps(&mut src, &mut src_bufs, 2);
                src.save(&path, Checkpoint::new().lender(&mut src_bufs))
                    .unwrap();
                let (mut dst, mut bufs) = lent_opt(into, 0);
                let before = state(&dst, &bufs);
                let r = dst.load(
                    &path,
                    Checkpoint::new()
                        .lender(&mut bufs)
                        .policy(LoadPolicy::ReplaceConfiguration),
                );
                let after = state(&dst, &bufs);
                add(
                    "checkpoint",
                    &format!("{what}, the parameters lent (ReplaceConfiguration)"),
                    match r {
                        Err(e) if before == after => {
                            Seen::Refused(format!("{}; nothing changed", variant(&e)))
                        }
                        Err(_) => Seen::Silent("refused after changing the optimizer".into()),
                        Ok(()) => Seen::Silent(
                            "loaded, to be stepped with the other rule's kernels".into(),
                        ),
                    },
                );
            }
            // A lender whose second buffer is too short: refused before the first is written.
            let (mut src, mut src_bufs) = lent_opt(adamw, 3);
            steps(&mut src, &mut src_bufs, 3);
            src.save(&path, Checkpoint::new().lender(&mut src_bufs))
                .unwrap();
            let (mut dst, bufs) = lent_opt(adamw, 3);
            let mut short = vec![bufs[0].clone(), vec![0.5f32; 10]];
            let before = state(&dst, &short);
            let r = dst.load(&path, Checkpoint::new().lender(&mut short));
            let after = state(&dst, &short);
            add(
                "checkpoint",
                "loading with a lender whose second buffer is too short",
                match r {
                    Err(e) if before == after => {
                        Seen::Refused(format!("{}; nothing changed", variant(&e)))
                    }
                    Err(_) => Seen::Silent(
                        "refused after writing the first buffer and the counters".into(),
                    ),
                    Ok(()) => Seen::Silent("loaded".into()),
                },
            );
        }
        add(
            "saving",
            "saving into a missing directory",
            file_refused(opt.save(dir().join("no/such/dir/x"), Checkpoint::new())),
        );
        #[cfg(unix)]
        {
            // Run as root, the atomic save's rename would put the checkpoint in the device's
            // place.
            let link = dir().join("to-dev-null");
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink("/dev/null", &link).unwrap();
            add(
                "saving",
                "saving onto a path that is a device (a link to /dev/null)",
                file_refused(opt.save(&link, Checkpoint::new())),
            );
        }
        let (mut b, id) = one(
            presets::adamw_f32(1e-3)
                .with_grad(bf(StoreRounding::Nearest))
                .build(),
            4,
        );
        b.accumulate(id, &[f32::INFINITY, 0.0, 0.0, 0.0]).unwrap();
        add(
            "saving",
            "saving with +Inf held in a bf16 accumulator (for the step's policy)",
            round_trips(&b, "inf-acc.safetensors"),
        );
    }
    out
}

#[test]
fn bad_inputs_are_refused_reported_or_handled_never_silent() {
    let cases = cases();
    println!("| # | area | input | outcome |");
    println!("| --- | --- | --- | --- |");
    let (mut refused, mut reported, mut correct, mut silent) = (0, 0, 0, Vec::new());
    for (k, (cat, what, seen)) in cases.iter().enumerate() {
        let outcome = match seen {
            Seen::Refused(s) => {
                refused += 1;
                format!("refused, {s}")
            }
            Seen::Reported(s) => {
                reported += 1;
                format!("reported: {s}")
            }
            Seen::Correct(s) => {
                correct += 1;
                format!("handled: {s}")
            }
            Seen::Silent(s) => {
                silent.push(format!("{what}: {s}"));
                format!("**SILENT**: {s}")
            }
        };
        println!(
            "| {} | {cat} | {what} | {} |",
            k + 1,
            outcome.replace('|', "\\|").replace('\n', " ")
        );
    }
    println!(
        "\n{} cases: {refused} refused with a typed error, {reported} reported by the step, {correct} handled correctly, {} silent",
        cases.len(),
        silent.len()
    );
    let _ = std::fs::remove_dir_all(dir());
    assert!(cases.len() >= 75, "only {} cases", cases.len());
    assert!(silent.is_empty(), "silent: {silent:#?}");
}

/// Every rule's hyperparameters refuse a key they do not know (a rule file's struct carries
/// `#[serde(deny_unknown_fields)]`): a checkpoint with one is refused, not loaded without it.
#[test]
fn every_rule_refuses_unknown_hyperparameter_keys() {
    for (name, hyper) in Hyper::conformance_cases() {
        let mut json = serde_json::to_value(ParamConfig::f32(hyper)).unwrap();
        let fields = json["hyper"].as_object_mut().unwrap();
        let (rule, inner) = fields.iter_mut().next().unwrap();
        let rule = rule.clone();
        inner
            .as_object_mut()
            .unwrap_or_else(|| panic!("{name}: {rule}'s hyperparameters are not an object"))
            .insert("not_a_field".into(), true.into());
        let back = serde_json::from_value::<ParamConfig>(json);
        assert!(back.is_err(), "{name} ({rule}) took an unknown key");
    }
}
