//! lpmm's optimizers on burn's CPU backends: each step of a burn module equals lpmm's own
//! optimizer on the same gradients bit for bit (learning rate from burn's scheduler, clipping,
//! the skip-step policy), parameters are stepped in the module's own buffers, and records resume
//! exactly.

use crate::common::{
    D_IN, D_OUT, HIDDEN, Mlp, WithSpare, grads, host_grads, read, reference,
    reference_accumulated_step, reference_step, values,
};
use burn_core::module::Module;
use burn_core::tensor::{DType, Device, Tensor, TensorData};
use burn_optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use lpmm_burn::{BurnError, Lpmm8bitAdamWConfig, LpmmOptimizer, LpmmOptimizerConfig};
use lpmm_optim::{MissingGradientPolicy, NonFinitePolicy, OptimError, presets};

#[allow(deprecated)] // burn 0.22 deprecates ndarray in favour of flex; both are supported.
fn ndarray() -> Device {
    Device::ndarray().autodiff()
}

/// Trains `steps` steps with `optim` and with the reference, the learning rate from burn's
/// cosine scheduler, and checks every parameter bit after every step.
fn same_as_reference(device: &Device, config: LpmmOptimizerConfig, mut optim: LpmmOptimizer) {
    let mut model = Mlp::new(device, 7);
    let (mut r, ids) = reference(&config, &values(&model));
    let mut scheduler = CosineAnnealingLrSchedulerConfig::new(2e-2, 6)
        .init()
        .unwrap();
    let mut lrs = Vec::new();
    for step in 0..6 {
        let lr = scheduler.step();
        lrs.push(lr.base());
        let g = grads(&model, step, device);
        let want = reference_step(&mut r, &ids, host_grads(&model, &g), lr.base());
        model = optim.step(lr, model, g).unwrap();
        assert_eq!(optim.last_report(), Some(want), "step {step}");
        assert_eq!(model.bits(), read(&r, &ids), "step {step}");
    }
    // The scheduler did drive it.
    assert!(lrs.windows(2).all(|w| w[1] < w[0]), "{lrs:?}");
}

#[test]
fn eight_bit_adamw_on_ndarray_equals_lpmm_bit_for_bit() {
    let config = Lpmm8bitAdamWConfig::new();
    same_as_reference(&ndarray(), config.lpmm(), config.init_whole_module());
}

#[test]
fn with_an_f32_accumulator_the_step_equals_accumulating_and_stepping() {
    // burn's gradients added into lpmm's f32 accumulator inside the step: the same bits as lpmm's
    // plain accumulate-then-step, with clipping over the whole module.
    let device = ndarray();
    let mut config = Lpmm8bitAdamWConfig::new()
        .with_max_grad_norm(Some(0.05))
        .lpmm();
    config.param.grad = lpmm_optim::Storage::F32;
    let mut optim = config.init_whole_module();
    let mut model = Mlp::new(&device, 3);
    let (mut r, ids) = reference(&config, &values(&model));
    for step in 0..4 {
        let g = grads(&model, step, &device);
        let want = reference_accumulated_step(&mut r, &ids, host_grads(&model, &g), 1e-2);
        model = optim.step(1e-2, model, g).unwrap();
        assert_eq!(optim.last_report(), Some(want), "step {step}");
        assert_eq!(model.bits(), read(&r, &ids), "step {step}");
    }
    // The accumulator is lpmm's f32 one (the CPU backend allocates it at a parameter's first
    // accumulation and releases it when the step has consumed it, so its bytes are not asserted).
    assert!(
        optim
            .memory_report()
            .params
            .iter()
            .all(|p| p.storage[1] == lpmm_optim::Storage::F32)
    );
}

#[test]
fn global_norm_clipping_over_the_whole_module_equals_lpmm() {
    let config = Lpmm8bitAdamWConfig::new().with_max_grad_norm(Some(0.05));
    same_as_reference(&ndarray(), config.lpmm(), config.init_whole_module());
}

#[test]
fn eight_bit_parameters_held_by_lpmm_are_written_back_exactly() {
    // LPMM-SGDM: parameters, gradients and momentum 8-bit with stochastic rounding.
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(3);
    same_as_reference(&ndarray(), config, config.init_whole_module());
    // 4-bit AdamW with split-f32 parameters (bf16 + remainder: not an f32 tensor's dtype).
    let config = LpmmOptimizerConfig::from(presets::adamw_4bit_split(0.0));
    same_as_reference(&ndarray(), config, config.init_whole_module());
}

#[test]
fn flex_steps_too() {
    let device = Device::flex().autodiff();
    let config = Lpmm8bitAdamWConfig::new().lpmm();
    same_as_reference(&device, config, config.init_whole_module());
    // bf16 parameters with stochastic rounding: held by lpmm beside an f32 tensor.
    let config = LpmmOptimizerConfig::from(presets::adamw_8bit_bf16_sr(0.0)).with_seed(5);
    same_as_reference(&device, config, config.init_whole_module());
}

#[test]
fn parameters_are_stepped_in_the_modules_own_buffers() {
    let device = ndarray();
    let mut model = Mlp::new(&device, 1);
    let mut optim = Lpmm8bitAdamWConfig::new().init_whole_module();
    let before = model.w1.val().into_data();
    for step in 0..3 {
        let g = grads(&model, step, &device);
        model = optim.step(1e-3, model, g).unwrap();
    }
    assert_ne!(model.w1.val().into_data(), before);
    let stats = optim.stats();
    assert_eq!(stats.lane, Some("cpu"));
    assert_eq!((stats.params, stats.held, stats.copies), (4, 0, 0));
    // lpmm allocates no parameter memory (the module's tensors are the parameters) and no
    // gradient memory (burn's gradient tensors are read where they are): only the states, 8-bit
    // for w1 (a code and a scale per 256), f32 for the small tensors.
    let report = optim.memory_report();
    assert_eq!(report.slot_totals()[0], 0, "{report:?}");
    assert_eq!(report.slot_totals()[1], 0, "{report:?}");
    let n1 = D_IN * HIDDEN;
    assert_eq!(report.params[0].bytes[2], n1 + 4 * n1.div_ceil(256));
    assert_eq!(report.params[0].bytes[3], n1 + 4 * n1.div_ceil(256));
    let small = HIDDEN + HIDDEN * D_OUT + D_OUT;
    assert_eq!(
        report.total(),
        2 * (n1 + 4 * n1.div_ceil(256)) + 2 * 4 * small
    );

    // A clone of the model kept by the caller shares the tensors: the step copies (as burn's
    // own in-place operations do) and the clone keeps its values.
    let kept = model.clone();
    let kept_bits = kept.bits();
    let g = grads(&model, 3, &device);
    model = optim.step(1e-3, model, g).unwrap();
    assert_eq!(kept.bits(), kept_bits);
    assert_ne!(model.bits(), kept_bits);
    assert_eq!(optim.stats().copies, 4);
}

#[test]
fn a_non_finite_gradient_skips_the_whole_step_or_only_its_elements() {
    let device = ndarray();
    for policy in [NonFinitePolicy::SkipStep, NonFinitePolicy::SkipElements] {
        let mut model = Mlp::new(&device, 2);
        let mut optim = Lpmm8bitAdamWConfig::new()
            .lpmm()
            .with_non_finite(policy)
            .init_whole_module();
        let g = grads(&model, 0, &device);
        model = optim.step(1e-3, model, g).unwrap();
        let before = model.bits();
        let mut g = grads(&model, 1, &device);
        let mut bad = vec![0.5f32; D_OUT];
        bad[3] = f32::NAN;
        g.register(
            model.b2.id,
            Tensor::<1>::from_data(TensorData::new(bad, [D_OUT]), &device.clone().inner()),
        );
        model = optim.step(1e-3, model, g).unwrap();
        let after = model.bits();
        let report = optim.last_report().unwrap();
        match policy {
            NonFinitePolicy::SkipStep => {
                assert!(report.skipped);
                assert_eq!(after, before, "nothing moves");
            }
            NonFinitePolicy::SkipElements => {
                assert!(!report.skipped);
                assert_ne!(after[0], before[0], "w1 moves");
                assert_eq!(after[3][3], before[3][3], "the NaN element does not");
                assert_ne!(after[3][2], before[3][2]);
            }
        }
    }
}

/// Trains 3 steps, saves, and resumes in a new optimizer and a new model loaded from records;
/// the resumed run must equal the uninterrupted one bit for bit.
fn resumes_exactly(lpmm_checkpoint: bool) {
    let device = ndarray();
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.02, 0.9)).with_seed(9);
    let eight = Lpmm8bitAdamWConfig::new().lpmm().with_seed(9);
    for config in [config, eight] {
        let mut model = Mlp::new(&device, 4);
        let mut optim = config.init_whole_module();
        for step in 0..3 {
            let g = grads(&model, step, &device);
            model = optim.step(0.01, model, g).unwrap();
        }
        let dir = std::env::temp_dir().join(format!(
            "lpmm-burn-resume-{}-{lpmm_checkpoint}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let module_record = model.clone().into_record();
        let mut resumed = if lpmm_checkpoint {
            optim
                .save_lpmm(dir.join("optim.safetensors"), &model)
                .unwrap();
            config
                .init_whole_module()
                .load_lpmm(dir.join("optim.safetensors"))
                .unwrap()
        } else {
            optim.save(dir.join("optim.bpk")).unwrap();
            config
                .init_whole_module()
                .load(dir.join("optim.bpk"))
                .unwrap()
        };
        // A fresh model (other values, other ids) loaded from the module record.
        let mut other = Mlp::new(&device, 5).load_record(module_record);
        if lpmm_checkpoint {
            // lpmm's checkpoint holds the parameters too: zero the module to show it.
            other = Mlp::new(&device, 6).load_record(other.clone().into_record());
        }
        for step in 3..6 {
            let g = grads(&model, step, &device);
            model = optim.step(0.01, model, g).unwrap();
            let g = grads(&other, step, &device);
            other = resumed.step(0.01, other, g).unwrap();
            assert_eq!(model.bits(), other.bits(), "step {step}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_burn_record_resumes_bit_for_bit() {
    resumes_exactly(false);
}

#[test]
fn an_lpmm_checkpoint_resumes_bit_for_bit() {
    resumes_exactly(true);
}

/// A fresh model on ndarray and an 8-bit AdamW optimizer that has stepped it `steps` times.
fn stepped_8bit_adamw(steps: usize) -> (Mlp, LpmmOptimizer) {
    let device = ndarray();
    let mut model = Mlp::new(&device, 4);
    let mut optim = Lpmm8bitAdamWConfig::new().init_whole_module();
    for step in 0..steps {
        let g = grads(&model, step, &device);
        model = optim.step(0.01, model, g).unwrap();
    }
    (model, optim)
}

#[test]
fn a_record_from_another_model_is_a_typed_error() {
    let (model, optim) = stepped_8bit_adamw(1);
    let device = ndarray();
    let record = optim.to_record().unwrap();
    let mut loaded = Lpmm8bitAdamWConfig::new()
        .init_whole_module()
        .load_record(record)
        .unwrap();
    // A new model: other ParamIds.
    let other = Mlp::new(&device, 4);
    let g = grads(&other, 1, &device);
    let err = loaded.step(0.01, other, g).unwrap_err();
    assert!(matches!(err, lpmm_burn::BurnError::Record(_)), "{err}");
    drop(model);
}

/// The record with its lpmm metadata edited (tensors unchanged).
fn edit_record_metadata(
    record: burn_optim::OptimizerRecord,
    edit: impl Fn(&mut serde_json::Value),
) -> burn_optim::OptimizerRecord {
    let reader = burn_pack::Reader::from_bytes(record.into_bytes().unwrap()).unwrap();
    let mut meta: serde_json::Value = serde_json::from_str(&reader.metadata()["lpmm"]).unwrap();
    edit(&mut meta);
    let tensors = reader.into_tensors().unwrap();
    let bytes = burn_pack::Writer::new(tensors)
        .with_metadata("lpmm", &meta.to_string())
        .into_bytes()
        .unwrap();
    burn_optim::OptimizerRecord::from_bytes(bytes).unwrap()
}

/// The error of loading `record` into a fresh 8-bit AdamW optimizer.
fn load_error(record: burn_optim::OptimizerRecord) -> lpmm_burn::BurnError {
    match Lpmm8bitAdamWConfig::new()
        .init_whole_module()
        .load_record(record)
    {
        Ok(_) => panic!("the record loaded"),
        Err(e) => e,
    }
}

#[test]
fn a_record_with_a_metadata_key_this_build_does_not_know_is_a_typed_error() {
    let (model, optim) = stepped_8bit_adamw(1);
    let record = || optim.to_record().unwrap();
    // The edit pipeline itself keeps a record loadable.
    Lpmm8bitAdamWConfig::new()
        .init_whole_module()
        .load_record(edit_record_metadata(record(), |_| {}))
        .unwrap();
    for (what, edit) in [
        (
            "a newer writer's field",
            Box::new(|m: &mut serde_json::Value| m["future_field"] = true.into())
                as Box<dyn Fn(&mut serde_json::Value)>,
        ),
        (
            "a parameter's key corrupted (`rule_state` to `rule_statf`)",
            Box::new(|m: &mut serde_json::Value| {
                let p = m["params"][0].as_object_mut().unwrap();
                let v = p.remove("rule_state").unwrap_or(serde_json::Value::Null);
                p.insert("rule_statf".into(), v);
            }),
        ),
    ] {
        let err = load_error(edit_record_metadata(record(), edit));
        assert!(
            matches!(&err, lpmm_burn::BurnError::Record(m) if m.contains("unknown field")),
            "{what}: {err}"
        );
    }
    drop(model);
}

#[test]
fn a_record_with_any_bit_flipped_is_refused_or_loads_the_same_state() {
    use burn_core::tensor::Bytes;
    use burn_optim::OptimizerRecord;
    let (model, optim) = stepped_8bit_adamw(2);
    let bytes = optim.to_record().unwrap().into_bytes().unwrap().to_vec();
    // burn's own checks (the burnpack header) come first; then lpmm's.
    let load = |b: Vec<u8>| {
        OptimizerRecord::from_bytes(Bytes::from_bytes_vec(b))
            .map_err(|e| lpmm_burn::BurnError::Record(format!("burn: {e}")))
            .and_then(|r| {
                Lpmm8bitAdamWConfig::new()
                    .init_whole_module()
                    .load_record(r)
            })
    };
    // The unflipped record loads and writes itself back unchanged.
    let again = load(bytes.clone()).unwrap().to_record().unwrap();
    assert_eq!(again.into_bytes().unwrap().to_vec(), bytes);
    let mut by_checksum = 0;
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 1 << (i % 8);
        match load(b) {
            // A byte no reader looks at (alignment padding, a dtype lpmm takes from the
            // configuration): the state is the same.
            Ok(loaded) => {
                let back = loaded.to_record().unwrap().into_bytes().unwrap().to_vec();
                assert_eq!(back, bytes, "byte {i} flipped: loaded as another state");
            }
            Err(lpmm_burn::BurnError::Record(m)) => {
                by_checksum += usize::from(m.contains("checksum mismatch"));
            }
            Err(e) => panic!("byte {i}: {e}"),
        }
    }
    // Most of the record is the states' data, which only the checksum guards.
    assert!(
        by_checksum > bytes.len() / 2,
        "{by_checksum} of {}",
        bytes.len()
    );
    // Without its checksum a record is refused too (a renamed key is an unknown field).
    let record = optim.to_record().unwrap();
    let err = load_error(edit_record_metadata(record, |m| {
        m.as_object_mut().unwrap().remove("crc32").unwrap();
    }));
    assert!(
        matches!(&err, lpmm_burn::BurnError::Record(m) if m.contains("no checksum")),
        "{err}"
    );
    drop(model);
}

#[test]
fn bf16_tensors_on_flex_are_the_parameters_of_bf16_storage() {
    let device = Device::flex().autodiff();
    let config = LpmmOptimizerConfig::from(presets::adamw_8bit_bf16_sr(0.0)).with_seed(5);
    let mut optim = config.init_whole_module();
    let mut model = Mlp::new_in(&device, 8, DType::BF16);
    assert_eq!(model.w1.val().dtype(), DType::BF16);
    let (mut r, ids) = reference(&config, &values(&model));
    for step in 0..4 {
        let g = grads(&model, step, &device);
        reference_step(&mut r, &ids, host_grads(&model, &g), 1e-2);
        model = optim.step(1e-2, model, g).unwrap();
        assert_eq!(model.bits(), read(&r, &ids), "step {step}");
    }
    assert_eq!(model.w1.val().dtype(), DType::BF16);
    let stats = optim.stats();
    assert_eq!((stats.params, stats.held, stats.copies), (4, 0, 0));
    // One copy of each parameter: the module's bf16 tensor.
    assert_eq!(optim.memory_report().slot_totals()[0], 0);
}

#[test]
fn a_parameter_without_a_gradient_is_reported_and_the_error_policy_changes_nothing() {
    let device = ndarray();
    let config = Lpmm8bitAdamWConfig::new().lpmm();
    // The default policy warns: the step goes ahead and its report names the parameter.
    let mut optim = config.init_whole_module();
    let model = WithSpare::new(&device, 4, false);
    let label = model.spare_label();
    let g = model.grads(0, &device);
    let model = optim.step(1e-3, model, g).unwrap();
    let r = optim.last_report().unwrap();
    let m = &r.missing_gradients;
    assert_eq!(
        (m.count, m.checked, &m.names[..]),
        (1, 5, &[label.clone()][..])
    );
    assert_eq!(r.updated, 4);
    // Frozen on purpose (burn's `set_require_grad(false)`): nothing to report.
    let model = WithSpare {
        spare: model.spare.set_require_grad(false),
        ..model
    };
    let g = model.grads(1, &device);
    optim.step(1e-3, model, g).unwrap();
    let r = optim.last_report().unwrap();
    assert!(r.missing_gradients.is_empty(), "{r:?}");
    assert_eq!(r.missing_gradients.checked, 4);

    // The error policy: refused before anything changes, at the first step (nothing registered)
    // and at a later one (nothing stepped), naming the parameter.
    let strict = config.with_missing_gradient(MissingGradientPolicy::Error);
    let mut optim = strict.init_whole_module();
    let model = WithSpare::new(&device, 4, false);
    let label = model.spare_label();
    let g = model.grads(0, &device);
    let e = optim.step(1e-3, model.clone(), g).unwrap_err();
    assert!(
        matches!(&e, BurnError::Optim(OptimError::MissingGradient { names, .. }) if *names == [label.clone()]),
        "{e}"
    );
    assert!(e.to_string().contains("set_require_grad(false)"), "{e}");
    assert_eq!(optim.stats().params, 0);
    assert!(optim.last_report().is_none());
    // Frozen, it trains; unfrozen at the second step, the step is refused and changes nothing:
    // it then continues with the bits of a run that never saw the refused step.
    let frozen = |m: WithSpare, on: bool| WithSpare {
        spare: m.spare.set_require_grad(!on),
        ..m
    };
    let model = frozen(model, true);
    let g = model.grads(0, &device);
    let model = optim.step(1e-3, model, g).unwrap();
    let thawed = frozen(model, false);
    let before = thawed.mlp.bits();
    let g = thawed.grads(1, &device);
    assert!(optim.step(1e-3, thawed.clone(), g).is_err());
    assert_eq!(thawed.mlp.bits(), before, "a parameter moved");
    let model = frozen(thawed, true);
    let g = model.grads(1, &device);
    let model = optim.step(1e-3, model, g).unwrap();
    let mut reference = strict.init_whole_module();
    let mut other = WithSpare::new(&device, 4, true);
    for step in 0..2 {
        let g = other.grads(step, &device);
        other = reference.step(1e-3, other, g).unwrap();
    }
    assert_eq!(model.mlp.bits(), other.mlp.bits());
    assert_eq!(optim.last_report(), reference.last_report());
}

/// The model of `seed` with fixed burn `ParamId`s (1 to 4), so that a record written in one
/// build attaches to it in another.
fn with_fixed_ids(mut model: Mlp) -> Mlp {
    model.w1.id = 1.into();
    model.b1.id = 2.into();
    model.w2.id = 3.into();
    model.b2.id = 4.into();
    model
}

/// The configurations of the committed version-1 records (`tests/data/README.md`): 8-bit AdamW
/// (parameters lent: their values left to the module record) and 8-bit AdamW on bf16 storage
/// with stochastic rounding (parameters held by lpmm: their values in the record).
fn v1_record_configs() -> [(&'static str, LpmmOptimizerConfig); 2] {
    [
        (
            "record_v1_adamw_8bit.bpk",
            Lpmm8bitAdamWConfig::new().lpmm(),
        ),
        (
            "record_v1_adamw_8bit_bf16_sr.bpk",
            LpmmOptimizerConfig::from(presets::adamw_8bit_bf16_sr(0.0)).with_seed(3),
        ),
    ]
}

fn v1_record_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// A version 1 record (lpmm-burn's layout before the checkpoint codec, written by the code of
/// commit 33409f7: `tests/data/README.md`) still loads: into the state that a version 2 record of
/// it holds tensor for tensor, field for field, and it resumes as that record does. Its own
/// checksum is checked.
#[test]
fn a_version_1_record_still_loads() {
    use burn_core::tensor::Bytes;
    use burn_optim::OptimizerRecord;
    let device = ndarray();
    let record = |b: &[u8]| OptimizerRecord::from_bytes(Bytes::from_bytes_vec(b.to_vec())).unwrap();
    let reader =
        |b: &[u8]| burn_pack::Reader::from_bytes(Bytes::from_bytes_vec(b.to_vec())).unwrap();
    let meta = |r: &burn_pack::Reader| -> serde_json::Value {
        serde_json::from_str(&r.metadata()["lpmm"]).unwrap()
    };
    for ((name, config), lent) in v1_record_configs().into_iter().zip([true, false]) {
        let v1 = std::fs::read(v1_record_path(name)).unwrap();
        let loaded = config.init_whole_module().load_record(record(&v1)).unwrap();
        let v2 = loaded.to_record().unwrap().into_bytes().unwrap().to_vec();
        let (old, new) = (reader(&v1), reader(&v2));
        // Every tensor, renamed `{id}.{slot}` to `{id}/{slot}`, with the same bytes, and no other.
        let renamed: Vec<String> = old
            .tensor_names()
            .iter()
            .map(|n| n.replacen('.', "/", 1))
            .collect();
        let mut names: Vec<String> = new.tensor_names().iter().map(|n| n.to_string()).collect();
        names.sort();
        let mut sorted = renamed.clone();
        sorted.sort();
        assert_eq!(names, sorted, "{name}");
        for (n, r) in old.tensor_names().iter().zip(&renamed) {
            assert_eq!(
                old.tensor_data(n).unwrap(),
                new.tensor_data(r).unwrap(),
                "{name}: {n}"
            );
        }
        // The same metadata: `from_module` is `value_outside`, the version 2.
        let (a, b) = (meta(&old), meta(&new));
        assert_eq!(
            (a["version"].as_u64(), b["version"].as_u64()),
            (Some(1), Some(2))
        );
        for key in ["format", "options", "global_steps", "groups"] {
            assert_eq!(a[key], b[key], "{name}: {key}");
        }
        let (pa, pb) = (
            a["params"].as_array().unwrap(),
            b["params"].as_array().unwrap(),
        );
        assert_eq!(pa.len(), pb.len());
        for (p, q) in pa.iter().zip(pb) {
            for key in [
                "name",
                "shape",
                "group",
                "requested",
                "steps",
                "accumulations",
                "pending",
                "lr_rule",
            ] {
                assert_eq!(p[key], q[key], "{name}: {key}");
            }
            assert_eq!(p["from_module"].as_bool(), Some(lent), "{name}");
            assert_eq!(
                q["value_outside"].as_bool().unwrap_or(false),
                lent,
                "{name}"
            );
        }
        // It resumes as the version 2 record of it does.
        let model = with_fixed_ids(Mlp::new(&device, 4));
        let mut from_v1 = loaded;
        let mut from_v2 = config.init_whole_module().load_record(record(&v2)).unwrap();
        let (mut m1, mut m2) = (model.clone(), model);
        for step in 2..4 {
            let g = grads(&m1, step, &device);
            m1 = from_v1.step(0.01, m1, g).unwrap();
            let g = grads(&m2, step, &device);
            m2 = from_v2.step(0.01, m2, g).unwrap();
            assert_eq!(m1.bits(), m2.bits(), "{name}: step {step}");
        }
        // A version 1 record with a flipped tensor byte is refused by its own checksum.
        let mut tensors = reader(&v1).into_tensors().unwrap();
        let t = tensors.pop().unwrap();
        let (n, dtype, shape, id, bytes) = t.into_parts().unwrap();
        let mut bytes = bytes.to_vec();
        bytes[0] ^= 1;
        tensors.push(burn_pack::Tensor::new(
            n,
            dtype,
            shape,
            id,
            Bytes::from_bytes_vec(bytes),
        ));
        let flipped = burn_pack::Writer::new(tensors)
            .with_metadata("lpmm", &old.metadata()["lpmm"])
            .into_bytes()
            .unwrap();
        let err = match config
            .init_whole_module()
            .load_record(OptimizerRecord::from_bytes(flipped).unwrap())
        {
            Ok(_) => panic!("{name}: a flipped version 1 record loaded"),
            Err(e) => e,
        };
        assert!(
            matches!(&err, BurnError::Record(m) if m.contains("checksum mismatch")),
            "{name}: {err}"
        );
    }
}
