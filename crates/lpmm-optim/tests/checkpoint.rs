//! Checkpoints: exact resume (stochastic rounding included), atomic writes, typed errors for
//! truncated, corrupt and mismatched files that leave the live optimizer untouched.

use lpmm_optim::{Checkpoint, Cpu, Mode, Parts};
use lpmm_optim::{
    Hyper, OptimError, Optimizer, OptimizerOptions, ParamConfig, ParamId, Storage, StoreRounding,
};
use lpmm_optim::{SlotKind, checkpoint::Canonical};

/// Every storage kind at once: SR bf16, Kahan, split f32, 8-bit linear SR parameters; SR
/// gradient accumulators; 8-bit and 4-bit states; one tensor above the piece size.
fn build() -> (Optimizer, Vec<(ParamId, usize)>) {
    let mut opt = Optimizer::new(
        OptimizerOptions::default()
            .with_seed(77)
            .with_max_grad_norm(Some(10.0)),
    )
    .unwrap();
    let adam8 = opt
        .add_group(
            ParamConfig::f32(Hyper::adamw(1e-3))
                .with_param(Storage::Bf16(StoreRounding::Stochastic))
                .with_grad(Storage::Bf16(StoreRounding::Stochastic))
                .with_state1(Storage::DYNAMIC8_SIGNED)
                .with_state2(Storage::DYNAMIC8_UNSIGNED),
        )
        .unwrap();
    let lpmm = opt
        .add_group(
            ParamConfig::f32(Hyper::sgd(0.05, 0.9))
                .with_param(Storage::LINEAR8_GROUP64_SR)
                .with_grad(Storage::LINEAR8_GROUP64_SR)
                .with_state1(Storage::LINEAR8_GROUP64_SR),
        )
        .unwrap();
    let shapes: [(&str, usize, usize, Option<ParamConfig>); 5] = [
        ("a", 5000, adam8, None),
        ("big", (1 << 20) + 4321, adam8, None),
        ("lpmm", 9000, lpmm, None),
        (
            "kahan",
            4096,
            adam8,
            Some(
                ParamConfig::f32(Hyper::lion(1e-4))
                    .with_param(Storage::Bf16Kahan)
                    .with_state1(Storage::FOUR_BIT_SIGNED)
                    .with_state2(Storage::FOUR_BIT_UNSIGNED),
            ),
        ),
        (
            "split",
            100,
            adam8,
            Some(ParamConfig::f32(Hyper::adamw(1e-2)).with_param(Storage::SplitF32)),
        ),
    ];
    let mut ids = Vec::new();
    for (name, n, group, own) in shapes {
        let init: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let id = match own {
            Some(c) => opt.add_param_with(name, &[n], &init, group, c).unwrap(),
            None => opt.add_param(name, &[n], &init, group).unwrap(),
        };
        ids.push((id, n));
    }
    (opt, ids)
}

fn train(opt: &mut Optimizer, ids: &[(ParamId, usize)], steps: std::ops::Range<u64>) {
    for t in steps {
        for &(id, n) in ids {
            let g: Vec<f32> = (0..n)
                .map(|i| (((i as u64 * 31 + t * 17) % 200) as f32 - 100.0) * 1e-4)
                .collect();
            // Two micro-batches, the second one left pending at a save point on odd steps.
            opt.accumulate(id, &g).unwrap();
            opt.accumulate(id, &g).unwrap();
        }
        opt.set_lr(1e-3 / (1.0 + t as f64)).unwrap();
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
}

fn snapshot(opt: &Optimizer, ids: &[(ParamId, usize)]) -> Vec<u32> {
    let mut out = Vec::new();
    for &(id, n) in ids {
        let mut v = vec![0f32; n];
        opt.read(id, SlotKind::Param, &mut v).unwrap();
        out.extend(v.iter().map(|x| x.to_bits()));
        for s in [1, 2] {
            opt.read(id, SlotKind::ALL[s + 1], &mut v).unwrap();
            out.extend(v.iter().map(|x| x.to_bits()));
        }
    }
    out
}

#[test]
fn resume_is_exact_with_stochastic_rounding() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let dir = tmp.path();
    let (mut first, ids2) = build();
    train(&mut first, &ids2, 1..4);
    // A pending micro-batch at the save point must survive too.
    first.accumulate(ids2[0].0, &vec![1e-3; ids2[0].1]).unwrap();
    let path = dir.join("ckpt.safetensors");
    first.save(&path, Checkpoint::new()).unwrap();
    let mut resumed = Canonical::read(&path)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
    assert_eq!(
        snapshot(&resumed, &ids2),
        snapshot(&first, &ids2),
        "loading reproduces the state"
    );
    train(&mut resumed, &ids2, 4..9);

    let (mut reference, ids3) = build();
    train(&mut reference, &ids3, 1..4);
    reference
        .accumulate(ids3[0].0, &vec![1e-3; ids3[0].1])
        .unwrap();
    train(&mut reference, &ids3, 4..9);
    assert_eq!(
        snapshot(&resumed, &ids2),
        snapshot(&reference, &ids3),
        "N steps straight = k, save, load, N-k"
    );
    assert_eq!(resumed.status().steps, 8);
}

#[test]
fn corrupt_truncated_and_mismatched_files_get_typed_errors_and_change_nothing() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let dir = tmp.path();
    let (mut opt, ids) = build();
    train(&mut opt, &ids, 1..3);
    let path = dir.join("good.safetensors");
    opt.save(&path, Checkpoint::new()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let before = snapshot(&opt, &ids);

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", bytes[..bytes.len() / 2].to_vec()),
        ("empty", Vec::new()),
        ("garbage", vec![0xAB; 4096]),
        ("header only", bytes[..64].to_vec()),
    ];
    for (what, content) in cases {
        let bad = dir.join(format!("{}.safetensors", what.replace(' ', "_")));
        std::fs::write(&bad, content).unwrap();
        let e = opt.load(&bad, Checkpoint::new()).unwrap_err();
        assert!(matches!(e, OptimError::Checkpoint { .. }), "{what}: {e}");
        if what.contains("elements") || what.contains("parameters") {
            assert!(
                e.to_string().contains("more elements than the file"),
                "{what}: refused for another reason: {e}"
            );
        }
        assert_eq!(
            snapshot(&opt, &ids),
            before,
            "{what}: the live optimizer changed"
        );
    }

    // A future version: refused by name.
    // The metadata JSON sits (escaped) in the header: patch the digit in place, same length.
    let needle = b"\\\"version\\\":1";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("version in the header");
    let mut patched = bytes.clone();
    patched[at + needle.len() - 1] = b'9';
    let future = dir.join("future.safetensors");
    std::fs::write(&future, &patched).unwrap();
    let e = Canonical::read(&future)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap_err()
        .to_string();
    assert!(e.contains("version 9"), "{e}");

    // Another model's checkpoint.
    let mut other = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = other
        .add_group(ParamConfig::f32(Hyper::sgd(0.1, 0.0)))
        .unwrap();
    other.add_param("a", &[7], &[0.0; 7], g).unwrap();
    let other_path = dir.join("other.safetensors");
    other.save(&other_path, Checkpoint::new()).unwrap();
    assert!(matches!(
        opt.load(&other_path, Checkpoint::new()),
        Err(OptimError::Checkpoint { .. })
    ));
    assert_eq!(snapshot(&opt, &ids), before);

    // A missing file.
    assert!(matches!(
        Canonical::read(dir.join("nope")).and_then(|c| c.into_optimizer(Cpu)),
        Err(OptimError::Checkpoint { .. })
    ));
}

#[test]
fn saving_is_atomic() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let dir = tmp.path();
    let (mut opt, ids) = build();
    let path = dir.join("ckpt.safetensors");
    opt.save(&path, Checkpoint::new()).unwrap();
    let old = std::fs::read(&path).unwrap();
    train(&mut opt, &ids, 1..2);
    // Saving into a directory that does not exist fails and leaves nothing behind.
    assert!(
        opt.save(dir.join("missing/ckpt.safetensors"), Checkpoint::new())
            .is_err()
    );
    // A successful save replaces the file whole, and leaves no temporary file.
    opt.save(&path, Checkpoint::new()).unwrap();
    let new = std::fs::read(&path).unwrap();
    assert_ne!(old, new);
    assert!(
        Canonical::read(&path)
            .and_then(|c| c.into_optimizer(Cpu))
            .is_ok()
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

type MetaEdit = Box<dyn Fn(&mut serde_json::Value)>;
type TensorEdit = Box<dyn Fn(&str, &mut safetensors::Dtype, &mut Vec<u8>)>;

/// Rewrites a checkpoint: `edit_meta` changes the metadata JSON, `edit_tensor` a tensor's dtype
/// and bytes.
fn forge(
    src: &std::path::Path,
    dst: &std::path::Path,
    edit_meta: impl Fn(&mut serde_json::Value),
    edit_tensor: impl Fn(&str, &mut safetensors::Dtype, &mut Vec<u8>),
) {
    use safetensors::SafeTensors;
    let bytes = std::fs::read(src).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta: serde_json::Value =
        serde_json::from_str(&header.metadata().as_ref().unwrap()["lpmm"]).unwrap();
    edit_meta(&mut meta);
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let (mut dtype, mut data) = (view.dtype(), view.data().to_vec());
            edit_tensor(&name, &mut dtype, &mut data);
            let shape = vec![data.len() / dtype.bitsize().div_ceil(8).max(1)];
            (name, dtype, shape, data)
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let info = std::collections::HashMap::from([("lpmm".to_string(), meta.to_string())]);
    let bytes = safetensors::tensor::serialize(views, Some(info)).unwrap();
    // Resealed (the checksum recomputed), so that the loader's other checks must refuse them;
    // metadata that does not parse cannot be resealed, and is refused by the parser.
    let bytes = lpmm_optim::fuzzing::reseal(&bytes).unwrap_or(bytes);
    std::fs::write(dst, bytes).unwrap();
}

#[test]
fn forged_checkpoints_are_refused_before_anything_is_allocated_or_changed() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let dir = tmp.path();
    let (mut opt, ids) = build();
    train(&mut opt, &ids, 1..3);
    let good = dir.join("good.safetensors");
    opt.save(&good, Checkpoint::new()).unwrap();
    let before = snapshot(&opt, &ids);
    let no_meta = |_: &mut serde_json::Value| {};
    let no_tensor = |_: &str, _: &mut safetensors::Dtype, _: &mut Vec<u8>| {};
    // The forgery pipeline itself round-trips a good file.
    let same = dir.join("same.safetensors");
    forge(&good, &same, no_meta, no_tensor);
    assert!(
        Canonical::read(&same)
            .and_then(|c| c.into_optimizer(Cpu))
            .is_ok()
    );

    let cases: Vec<(&str, MetaEdit, TensorEdit)> = vec![
        (
            "more elements than the file",
            Box::new(|m| m["params"][0]["shape"] = serde_json::json!([1u64 << 40])),
            Box::new(no_tensor),
        ),
        (
            "many parameters of plausible size",
            Box::new(|m| {
                let p = m["params"][0].clone();
                let params = m["params"].as_array_mut().unwrap();
                for k in 0..40 {
                    let mut q = p.clone();
                    q["name"] = serde_json::json!(format!("forged{k}"));
                    // 40M elements in all, well past what a ~7 MB file can hold (2 per byte).
                    q["shape"] = serde_json::json!([1_000_000]);
                    params.push(q);
                }
            }),
            Box::new(no_tensor),
        ),
        (
            "step counter",
            Box::new(|m| m["params"][1]["steps"] = serde_json::json!(u64::MAX)),
            Box::new(no_tensor),
        ),
        (
            "global counter",
            Box::new(|m| m["global_steps"] = serde_json::json!(u64::MAX)),
            Box::new(no_tensor),
        ),
        (
            "NaN in an f32 state",
            Box::new(no_meta),
            Box::new(|name, _, data| {
                if name == "split/state1" {
                    data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
                }
            }),
        ),
        (
            "wrong dtype",
            Box::new(no_meta),
            Box::new(|name, dtype, _| {
                if name == "split/state2" {
                    *dtype = safetensors::Dtype::I32;
                }
            }),
        ),
        (
            "negative block scale",
            Box::new(no_meta),
            Box::new(|name, _, data| {
                if name == "a/state1.absmax" {
                    data[..4].copy_from_slice(&(-1.0f32).to_le_bytes());
                }
            }),
        ),
        (
            "short tensor",
            Box::new(no_meta),
            Box::new(|name, _, data| {
                if name == "lpmm/param" {
                    data.truncate(data.len() - 64);
                }
            }),
        ),
    ];
    for (what, edit_meta, edit_tensor) in cases {
        let bad = dir.join("forged.safetensors");
        forge(&good, &bad, &*edit_meta, &*edit_tensor);
        let e = opt.load(&bad, Checkpoint::new()).unwrap_err();
        assert!(matches!(e, OptimError::Checkpoint { .. }), "{what}: {e}");
        if what.contains("elements") || what.contains("parameters") {
            assert!(
                e.to_string().contains("more elements than the file"),
                "{what}: refused for another reason: {e}"
            );
        }
        assert_eq!(
            snapshot(&opt, &ids),
            before,
            "{what}: the live optimizer changed"
        );
    }
}

/// f64 hyperparameters survive a checkpoint bit for bit: 300 random learning rates set with
/// `set_lr` (before serde_json's `float_roundtrip`, 26 of 300 came back an ulp off), and the
/// loaded optimizer saves the same bytes.
#[test]
fn learning_rates_survive_save_and_load_bit_for_bit() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let dir = tmp.path();
    let path = dir.join("lr.safetensors");
    let mut rng = lpmm_optim::testing::Rng::new(0x22);
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(lpmm_optim::presets::adamw_f32(1e-3)).unwrap();
    let id = opt.add_param("w", &[4], &[0.1; 4], g).unwrap();
    let mut off = Vec::new();
    for _ in 0..300 {
        // Full 53-bit mantissas over eight decades.
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let lr = 10f64.powf(-8.0 + 7.0 * u);
        opt.set_lr(lr).unwrap();
        opt.save(&path, Checkpoint::new()).unwrap();
        let back = Canonical::read(&path)
            .and_then(|c| c.into_optimizer(Cpu))
            .unwrap();
        let got = back.param(id).map(|p| p.config).unwrap().hyper.lr();
        if got.to_bits() != lr.to_bits() {
            off.push((lr, got));
        }
        let again = dir.join("again.safetensors");
        back.save(&again, Checkpoint::new()).unwrap();
        assert_eq!(
            std::fs::read(&again).unwrap(),
            std::fs::read(&path).unwrap(),
            "a loaded optimizer saves the same bytes"
        );
    }
    assert!(
        off.is_empty(),
        "{} of 300 drifted: {:?}",
        off.len(),
        &off[..off.len().min(5)]
    );
}

/// Whatever `save` accepts, `load` loads: after finite values that overflowed on their way into
/// bf16 states and an 8-bit accumulator (refused), and with +Inf held in a bf16 accumulator for
/// the step's policy, the file saves and loads.
#[test]
fn a_state_after_overflow_saves_and_loads() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let dir = tmp.path();
    let path = dir.join("overflow.safetensors");
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt
        .add_group(
            ParamConfig::f32(Hyper::adamw(1e-3))
                .with_grad(Storage::Bf16(StoreRounding::Nearest))
                .with_state1(Storage::Bf16(StoreRounding::Nearest))
                .with_state2(Storage::Bf16(StoreRounding::Stochastic)),
        )
        .unwrap();
    let a = opt.add_param("a", &[4], &[0.1; 4], g).unwrap();
    let s = opt
        .add_param_with(
            "s",
            &[4],
            &[0.1; 4],
            g,
            lpmm_optim::presets::lpmm_sgdm(1e-3, 0.9),
        )
        .unwrap();
    opt.accumulate(a, &[5.832e20, 3.4e38, 0.0, 1.0]).unwrap();
    opt.accumulate(s, &[3e38, 0.5, 0.0, 0.0]).unwrap();
    assert!(matches!(
        opt.accumulate(s, &[3e38, 0.25, 0.0, 0.0]),
        Err(OptimError::AccumulatorOverflow { .. })
    ));
    let report = opt.step(lpmm_optim::Accumulated).unwrap();
    assert_eq!(report.non_finite, vec![a], "the overflow is reported");
    opt.accumulate(a, &[f32::INFINITY, 0.0, 0.0, 0.0]).unwrap();
    opt.save(&path, Checkpoint::new()).unwrap();
    let back = Canonical::read(&path)
        .and_then(|c| c.into_optimizer(Cpu))
        .unwrap();
    assert_eq!(
        Parts::of(&back)
            .canonical(None)
            .unwrap()
            .to_bytes()
            .unwrap(),
        Parts::of(&opt).canonical(None).unwrap().to_bytes().unwrap()
    );
}

/// `load_state` keeps the live configuration unless told otherwise: a checkpoint with the same
/// names and shapes but other storages, optimizer, learning rate and seed is refused (nothing
/// changes), and taken whole with `LoadPolicy::ReplaceConfiguration`.
#[test]
fn load_state_replaces_the_configuration_only_when_asked() {
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let dir = tmp.path();
    let path = dir.join("other.safetensors");
    let mut other = Optimizer::new(OptimizerOptions::default().with_seed(9)).unwrap();
    let g = other
        .add_group(lpmm_optim::presets::lpmm_sgdm(0.1, 0.9))
        .unwrap();
    other.add_param("w", &[64], &[0.2; 64], g).unwrap();
    other.save(&path, Checkpoint::new()).unwrap();

    let mut live = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = live
        .add_group(lpmm_optim::presets::adamw_f32(1e-3))
        .unwrap();
    live.add_param("w", &[64], &[0.1; 64], g).unwrap();
    let before = Parts::of(&live)
        .canonical(None)
        .unwrap()
        .to_bytes()
        .unwrap();
    let e = live.load(&path, Checkpoint::new()).unwrap_err();
    assert!(
        matches!(&e, OptimError::Checkpoint { reason, .. } if reason.contains("ReplaceConfiguration")),
        "{e}"
    );
    assert_eq!(
        Parts::of(&live)
            .canonical(None)
            .unwrap()
            .to_bytes()
            .unwrap(),
        before
    );
    live.load(
        &path,
        Checkpoint::new().policy(lpmm_optim::LoadPolicy::ReplaceConfiguration),
    )
    .unwrap();
    assert_eq!(
        Parts::of(&live)
            .canonical(None)
            .unwrap()
            .to_bytes()
            .unwrap(),
        Parts::of(&other)
            .canonical(None)
            .unwrap()
            .to_bytes()
            .unwrap()
    );
    // The same configuration loads under the default policy.
    live.load(&path, Checkpoint::new()).unwrap();
}

/// `LoadPolicy::TakeLearningRates`: a checkpoint whose only difference is the learning rates (a
/// schedule had changed them) loads and takes them; any other difference is refused as under
/// `SameConfiguration`, and changes nothing.
#[test]
fn load_takes_the_learning_rates_only_when_asked() {
    use lpmm_optim::LoadPolicy;
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let path = tmp.path().join("scheduled.safetensors");
    let make = |lr: f64, wd: f64| {
        let mut o = Optimizer::new(OptimizerOptions::default().with_seed(4)).unwrap();
        let g = o
            .add_group(lpmm_optim::presets::adamw_8bit(lr).weight_decay(wd))
            .unwrap();
        o.add_group(lpmm_optim::presets::adamw_8bit(lr / 2.0).weight_decay(wd))
            .unwrap();
        o.add_param("w", &[4096], &[0.2; 4096], g).unwrap();
        o.add_param("b", &[64], &[0.1; 64], g + 1).unwrap();
        o
    };
    let mut saved = make(1e-3, 0.1);
    saved.set_group_lr(0, 3e-4).unwrap();
    saved.set_group_lr(1, 1e-4).unwrap();
    saved.save(&path, Checkpoint::new()).unwrap();
    let bytes = |o: &Optimizer| Parts::of(o).canonical(None).unwrap().to_bytes().unwrap();

    let mut fresh = make(1e-3, 0.1);
    let e = fresh.load(&path, Checkpoint::new()).unwrap_err();
    assert!(matches!(&e, OptimError::Checkpoint { .. }), "{e}");
    fresh
        .load(
            &path,
            Checkpoint::new().policy(LoadPolicy::TakeLearningRates),
        )
        .unwrap();
    assert_eq!(bytes(&fresh), bytes(&saved));
    assert_eq!(fresh.groups()[0].hyper.lr(), 3e-4);
    assert_eq!(fresh.groups()[1].hyper.lr(), 1e-4);

    // Another weight decay is another configuration: refused, nothing changed.
    let mut other = make(1e-3, 0.2);
    let before = bytes(&other);
    let e = other
        .load(
            &path,
            Checkpoint::new().policy(LoadPolicy::TakeLearningRates),
        )
        .unwrap_err();
    assert!(
        matches!(&e, OptimError::Checkpoint { reason, .. } if reason.contains("groups differ")),
        "{e}"
    );
    assert_eq!(bytes(&other), before);
}

/// Every slot of every parameter, as bytes (state 3 and the factorized statistics included).
fn all_slots(opt: &Optimizer, ids: &[(ParamId, usize)]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for &(id, _) in ids {
        for slot in lpmm_optim::SlotKind::ALL {
            for r in Parts::of(opt).export_slot(id, slot, None).unwrap().regions {
                out.push(r.bytes);
            }
        }
    }
    out
}

/// Adafactor, CAME, AdEMAMix, schedule-free AdamW, RMSprop (momentum and centered: all three
/// states), Adagrad (its initial accumulator read at the first step only) and LAMB (its trust
/// ratio from two tensor-wide sums) at their
/// low-precision presets: state 3, the factorized statistics, the rules' tensor-wide sums and
/// schedule-free's host state (its averaging weights) all resume bit for bit; a checkpoint saved at the evaluation point loads
/// there, refuses to step, and trains on after `train()` exactly as the uninterrupted run.
#[test]
fn the_newer_rules_resume_exactly() {
    use lpmm_optim::presets;
    let tmp = lpmm_optim::testing::temp_dir("lpmm-ckpt-");
    let dir = tmp.path();
    let configs: [(&str, ParamConfig); 7] = [
        (
            "adafactor",
            presets::adafactor_lpmm().weight_decay(0.01).build(),
        ),
        ("came", presets::came_lpmm(2e-4).weight_decay(0.01).build()),
        (
            "ademamix",
            presets::ademamix_8bit(1e-3)
                .warmup(Some(5), Some(5))
                .build(),
        ),
        (
            "schedule-free",
            presets::schedule_free_adamw_8bit(2.5e-3)
                .warmup_steps(3)
                .build(),
        ),
        (
            "rmsprop",
            presets::rmsprop_8bit(1e-3)
                .momentum(0.9)
                .centered(true)
                .weight_decay(0.01)
                .build(),
        ),
        (
            "adagrad",
            presets::adagrad_8bit(1e-2)
                .lr_decay(0.01)
                .initial_accumulator_value(0.1)
                .build(),
        ),
        (
            "lamb",
            presets::lamb_8bit(1e-3)
                .weight_decay(0.01)
                .debias(true)
                .build(),
        ),
    ];
    let shapes: [&[usize]; 3] = [&[64, 80], &[5000], &[3, 40, 50]];
    for (name, config) in configs {
        let make = || {
            let mut opt = Optimizer::new(OptimizerOptions::default().with_seed(5)).unwrap();
            let g = opt.add_group(config).unwrap();
            let ids: Vec<(ParamId, usize)> = shapes
                .iter()
                .enumerate()
                .map(|(k, shape)| {
                    let n: usize = shape.iter().product();
                    let init: Vec<f32> = (0..n)
                        .map(|i| ((i * 7919 + k) % 1000) as f32 / 1000.0 - 0.5)
                        .collect();
                    (opt.add_param(&format!("p{k}"), shape, &init, g).unwrap(), n)
                })
                .collect();
            (opt, ids)
        };
        let (mut first, ids) = make();
        train(&mut first, &ids, 1..4);
        let eval = name == "schedule-free";
        if eval {
            first.set_mode(Mode::Eval, lpmm_optim::Lent::None).unwrap();
        }
        let path = dir.join(format!("{name}.safetensors"));
        first.save(&path, Checkpoint::new()).unwrap();
        let mut resumed = Canonical::read(&path)
            .and_then(|c| c.into_optimizer(Cpu))
            .unwrap();
        assert_eq!(
            all_slots(&resumed, &ids),
            all_slots(&first, &ids),
            "{name}: loaded"
        );
        assert_eq!(resumed.status().mode == Mode::Eval, eval, "{name}: mode");
        for &(id, _) in &ids {
            assert_eq!(
                resumed.param(id).map(|p| p.rule_state).unwrap(),
                first.param(id).map(|p| p.rule_state).unwrap(),
                "{name}: rule state"
            );
        }
        if eval {
            assert!(matches!(
                resumed.step(lpmm_optim::Accumulated),
                Err(OptimError::EvalMode)
            ));
            resumed
                .set_mode(Mode::Train, lpmm_optim::Lent::None)
                .unwrap();
        }
        train(&mut resumed, &ids, 4..8);
        let (mut reference, ids2) = make();
        train(&mut reference, &ids2, 1..4);
        if eval {
            reference
                .set_mode(Mode::Eval, lpmm_optim::Lent::None)
                .unwrap();
            reference
                .set_mode(Mode::Train, lpmm_optim::Lent::None)
                .unwrap();
        }
        train(&mut reference, &ids2, 4..8);
        assert_eq!(
            all_slots(&resumed, &ids),
            all_slots(&reference, &ids2),
            "{name}: resumed"
        );
        if eval {
            assert!(resumed.param(ids[0].0).unwrap().rule_state.0[1] > 0.0);
        }
    }
}

/// The checkpoint codec (`lpmm_optim::checkpoint::codec`) in a container of the test's own (an in-memory map
/// of tensors): a parameter whose value is held outside the checkpoint has its parameter slot's
/// primary region left out and decodes without it, everything else as it was; what it decodes
/// encodes again to the same metadata and tensors; a flipped byte is refused by the checksum. A
/// safetensors file holding such a parameter is refused by `load`.
#[test]
fn the_codec_holds_values_outside_in_any_container() {
    use lpmm_optim::backend::Dtype;
    use lpmm_optim::checkpoint::codec::{Scheme, Source, Stored};
    use lpmm_optim::{SlotKind, checkpoint::Canonical};
    use std::collections::BTreeMap;

    struct Tensors(BTreeMap<String, (String, Vec<usize>, Vec<u8>)>, usize);
    impl Source for Tensors {
        fn names(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
        fn get(&self, name: &str) -> Option<Stored<'_>> {
            self.0.get(name).map(|(d, s, b)| Stored {
                dtype: d.clone(),
                shape: s,
                bytes: b,
            })
        }
        fn size(&self) -> usize {
            self.1
        }
    }
    fn dtype(d: Dtype) -> String {
        match d {
            Dtype::Bf16 => "BF16".into(),
            d => format!("{d:?}").to_uppercase(),
        }
    }
    fn store(e: &lpmm_optim::checkpoint::codec::Encoded<'_>) -> Tensors {
        let map: BTreeMap<_, _> = e
            .tensors
            .iter()
            .map(|t| {
                let v = (dtype(t.dtype), vec![t.len], t.bytes.to_vec());
                (t.name.clone(), v)
            })
            .collect();
        let size = e.metadata.len() + map.values().map(|v| v.2.len()).sum::<usize>();
        Tensors(map, size)
    }

    let (mut opt, ids) = build();
    train(&mut opt, &ids, 1..3);
    let c = Parts::of(&opt).canonical(None).unwrap();
    let scheme = Scheme {
        format: "test-container",
        version: 7,
        maps: false,
        noun: "container",
    };
    let outside: Vec<bool> = (0..c.params.len()).map(|i| i % 2 == 0).collect();
    let encoded = c.encode(&scheme, &outside).unwrap();
    for (i, p) in c.params.iter().enumerate() {
        let primary = format!("{}/param", p.name);
        let stored = encoded.tensors.iter().filter(|t| t.param == Some(i));
        let names: Vec<&str> = stored.map(|t| t.name.as_str()).collect();
        assert_eq!(names.contains(&primary.as_str()), !outside[i], "{names:?}");
        let regions: usize = p.slots.iter().map(|s| s.regions.len()).sum();
        assert_eq!(names.len(), regions - usize::from(outside[i]), "{names:?}");
    }
    assert!(encoded.tensors.iter().all(|t| !t.name.starts_with("maps/")));

    let tensors = store(&encoded);
    let decoded = Canonical::decode(&scheme, &encoded.metadata, &tensors).unwrap();
    assert_eq!(decoded.outside, outside);
    let mut want = c.clone();
    for (p, &o) in want.params.iter_mut().zip(&outside) {
        if o {
            p.slots[SlotKind::Param as usize]
                .regions
                .retain(|r| !r.spec.suffix.is_empty());
        }
    }
    assert_eq!(decoded.canonical, want);
    assert!(decoded.canonical.check().is_err(), "values are missing");
    let again = decoded.canonical.encode(&scheme, &decoded.outside).unwrap();
    assert_eq!(again, encoded);

    // Another container's scheme, and a flipped byte, are refused.
    let other = Scheme {
        version: 8,
        ..scheme
    };
    let e = Canonical::decode(&other, &encoded.metadata, &tensors).unwrap_err();
    assert!(e.contains("version 7"), "{e}");
    let mut flipped = store(&encoded);
    flipped.0.values_mut().next().unwrap().2[0] ^= 1;
    let e = Canonical::decode(&scheme, &encoded.metadata, &flipped).unwrap_err();
    assert!(
        e.starts_with("checksum mismatch (the container says"),
        "{e}"
    );

    // lpmm-optim's own file never holds a value outside.
    let file = Scheme {
        format: lpmm_optim::CHECKPOINT_FORMAT,
        version: lpmm_optim::CHECKPOINT_VERSION,
        maps: true,
        noun: "file",
    };
    let encoded = c.encode(&file, &outside).unwrap();
    let views: Vec<_> = encoded
        .tensors
        .iter()
        .map(|t| {
            let d = match t.dtype {
                Dtype::F32 => safetensors::Dtype::F32,
                Dtype::Bf16 => safetensors::Dtype::BF16,
                Dtype::U16 => safetensors::Dtype::U16,
                Dtype::U8 => safetensors::Dtype::U8,
                Dtype::U32 => safetensors::Dtype::U32,
            };
            let view = safetensors::tensor::TensorView::new(d, vec![t.len], &t.bytes).unwrap();
            (t.name.clone(), view)
        })
        .collect();
    let info = std::collections::HashMap::from([("lpmm".to_string(), encoded.metadata.clone())]);
    let bytes = safetensors::tensor::serialize(views, Some(info)).unwrap();
    let e = Canonical::from_bytes(&bytes).unwrap_err();
    assert!(e.contains("held outside the file"), "{e}");
}
