//! The per-tensor optimizer under burn's `ModuleOptimizer` on burn's CPU backends: each step
//! equals lpmm's CPU reference and the whole-module optimizer bit for bit where their semantics
//! coincide (no global-norm clipping, no global skip), with burn's schedulers, groups, per-group
//! learning rates and gradient clipping; its records resume bit for bit; hostile records, a NaN
//! gradient, a changed shape and a refused parameter give what the docs promise.

use burn_core as burn;

use crate::common::{
    D_IN, D_OUT, HIDDEN, Mlp, WithSpare, grads, host_grads, read, reference, reference_step,
    shapes, values,
};
use burn_core::module::{Module, ParamGroup};
use burn_core::tensor::{DType, Device, Tensor, TensorData};
use burn_optim::grad_clipping::GradientClipping;
use burn_optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn_optim::lr_scheduler::module_lr_scheduler::ModuleLrSchedulerConfig;
use burn_optim::{AdamWConfig, GradientsParams, ModuleOptimizer, Optimizer as _, OptimizerRecord};
use lpmm_burn::{
    BurnError, Lpmm8bitAdamWConfig, LpmmOptimizerConfig, LpmmTensorOptimizer, check_gradients,
};
use lpmm_optim::{MissingGradientPolicy, NonFinitePolicy, SlotKind, presets};

pub fn flex() -> Device {
    Device::flex().autodiff()
}

#[allow(deprecated)] // burn 0.22 deprecates ndarray in favour of flex; both are supported.
fn ndarray() -> Device {
    Device::ndarray().autodiff()
}

/// The per-tensor optimizer of `config` and a handle on its counters.
fn per_tensor(config: LpmmOptimizerConfig) -> (ModuleOptimizer, LpmmTensorOptimizer) {
    let optim = config.build().unwrap();
    (ModuleOptimizer::from(optim.clone()), optim)
}

/// Trains the per-tensor optimizer, the whole-module one and lpmm's reference side by side, the
/// learning rate from burn's cosine scheduler; every parameter bit must agree after every step.
fn three_forms_agree(device: &Device, config: LpmmOptimizerConfig, dtype: DType) {
    let mut a = Mlp::new_in(device, 7, dtype);
    let mut b = Mlp::new_in(device, 7, dtype);
    let (mut r, ids) = reference(&config, &values(&a));
    let (mut module_optim, handle) = per_tensor(config);
    let mut whole = config.init_whole_module();
    let mut scheduler = CosineAnnealingLrSchedulerConfig::new(2e-2, 6)
        .init()
        .unwrap();
    for step in 0..6 {
        let lr = scheduler.step();
        let ga = grads(&a, step, device);
        let gb = grads(&b, step, device);
        reference_step(&mut r, &ids, host_grads(&a, &ga), lr.base());
        a = module_optim.step(lr.clone(), a, ga);
        b = whole.step(lr, b, gb).unwrap();
        assert_eq!(
            a.bits(),
            read(&r, &ids),
            "step {step}: per-tensor against lpmm"
        );
        assert_eq!(
            a.bits(),
            b.bits(),
            "step {step}: per-tensor against whole-module"
        );
    }
    assert_eq!(a.w1.val().dtype(), dtype);
    let stats = handle.stats();
    assert_eq!((stats.params, stats.steps, stats.error_count), (4, 24, 0));
    assert!(stats.errors.is_empty() && stats.reinitialised.is_empty());
}

#[test]
fn eight_bit_adamw_per_tensor_equals_lpmm_and_the_whole_module_form() {
    for policy in [NonFinitePolicy::SkipElements, NonFinitePolicy::SkipStep] {
        let config = Lpmm8bitAdamWConfig::new().lpmm().with_non_finite(policy);
        three_forms_agree(&flex(), config, DType::F32);
        three_forms_agree(&ndarray(), config, DType::F32);
    }
}

#[test]
fn stochastically_rounded_and_held_parameters_per_tensor_equal_lpmm() {
    // LPMM-SGDM: 8-bit parameters (held by lpmm, decoded into the f32 tensors), gradients and
    // momentum, every slot stochastically rounded: the streams follow the order in which burn
    // visits the parameters, as the whole-module optimizer's do.
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(3);
    three_forms_agree(&flex(), config, DType::F32);
    // 4-bit AdamW with split-f32 parameters (bf16 + remainder: held beside an f32 tensor).
    let config = LpmmOptimizerConfig::from(presets::adamw_4bit_split(0.0));
    three_forms_agree(&flex(), config, DType::F32);
    // bf16 tensors on flex are the parameters of bf16 storage, stochastically rounded in place.
    let config = LpmmOptimizerConfig::from(presets::adamw_8bit_bf16_sr(0.0)).with_seed(5);
    three_forms_agree(&flex(), config, DType::BF16);
}

#[test]
fn the_per_tensor_step_allocates_no_parameter_or_gradient_memory() {
    let device = flex();
    let mut model = Mlp::new(&device, 1);
    let (mut optim, handle) = per_tensor(Lpmm8bitAdamWConfig::new().lpmm());
    for step in 0..3 {
        let g = grads(&model, step, &device);
        model = optim.step(1e-3, model, g);
    }
    let stats = handle.stats();
    assert_eq!(stats.lane, Some("cpu"));
    assert_eq!((stats.params, stats.copies), (4, 0));
    let report = handle.memory_report();
    assert_eq!(report.slot_totals()[0], 0, "{report:?}");
    assert_eq!(report.slot_totals()[1], 0, "{report:?}");
    let n1 = D_IN * HIDDEN;
    let small = HIDDEN + HIDDEN * D_OUT + D_OUT;
    assert_eq!(
        report.total(),
        2 * (n1 + 4 * n1.div_ceil(256)) + 2 * 4 * small
    );
    // A clone of the model kept by the caller (as burn-train's `Learner` keeps the model it
    // steps) shares the tensors: the step copies each, and the clone keeps its values.
    let kept = model.clone();
    let kept_bits = kept.bits();
    let g = grads(&model, 3, &device);
    model = optim.step(1e-3, model, g);
    assert_eq!(kept.bits(), kept_bits);
    assert_ne!(model.bits(), kept_bits);
    assert_eq!(handle.stats().copies, 4);
}

/// One wide weight: 300 x 400 elements, more than one chunk of the private copy a shared flex
/// tensor gets (2^16 elements, copied on every thread).
#[derive(Module, Debug)]
struct Wide {
    w: burn::module::Param<Tensor<2>>,
}

impl Wide {
    fn new(device: &Device, dtype: DType) -> Self {
        let mut rng = lpmm_optim::testing::Rng::new(11);
        let values = crate::common::uniform(&mut rng, 300 * 400, 0.1);
        let data = TensorData::new(values, [300, 400]).convert_dtype(dtype);
        Wide {
            w: burn::module::Param::from_tensor(Tensor::from_data(data, (device, dtype))),
        }
    }

    fn grads(&self, step: usize, device: &Device) -> GradientsParams {
        let mut rng = lpmm_optim::testing::Rng::new(100 + step as u64);
        let coeffs = crate::common::uniform(&mut rng, 300 * 400, 1.0);
        let coeffs = Tensor::<2>::from_data(TensorData::new(coeffs, [300, 400]), device);
        let loss = (self.w.val().cast(DType::F32) * coeffs).sum();
        GradientsParams::from_grads(loss.backward(), self)
    }

    fn bits(&self) -> Vec<u32> {
        let data = self.w.val().into_data().convert::<f32>();
        data.try_to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }
}

#[test]
fn a_shared_tensor_larger_than_a_copy_chunk_steps_as_an_unshared_one() {
    // burn-train's `Learner` keeps the model it steps: lpmm steps a private copy, made in chunks
    // on every thread. Stepped with a clone kept, the tensor must end with the bits it gets
    // stepped alone, and the clone keep its own.
    let device = flex();
    for (config, dtype) in [
        (Lpmm8bitAdamWConfig::new().lpmm(), DType::F32),
        (
            LpmmOptimizerConfig::from(presets::adamw_8bit_bf16_sr(1e-3)).with_seed(9),
            DType::BF16,
        ),
    ] {
        let (mut shared_optim, shared_handle) = per_tensor(config);
        let (mut alone_optim, alone_handle) = per_tensor(config);
        let mut shared = Wide::new(&device, dtype);
        let mut alone = Wide::new(&device, dtype);
        for step in 0..3 {
            let kept = shared.clone();
            let kept_bits = kept.bits();
            let g = shared.grads(step, &device);
            shared = shared_optim.step(1e-3, shared, g);
            let g = alone.grads(step, &device);
            alone = alone_optim.step(1e-3, alone, g);
            let differ = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(x, y)| x != y).count();
            let (now, kept_now) = (shared.bits(), kept.bits());
            assert_eq!(
                differ(&kept_now, &kept_bits),
                0,
                "{dtype:?} step {step}: the clone"
            );
            assert_eq!(
                differ(&now, &alone.bits()),
                0,
                "{dtype:?} step {step}: elements"
            );
            assert!(
                differ(&now, &kept_bits) > 0,
                "{dtype:?} step {step}: nothing moved"
            );
            assert_eq!(shared.w.val().dtype(), dtype);
        }
        assert_eq!(shared_handle.stats().copies, 3, "{dtype:?}");
        assert_eq!(alone_handle.stats().copies, 0, "{dtype:?}");
        assert_eq!(shared_handle.stats().error_count, 0, "{dtype:?}");
    }
}

#[test]
fn global_norm_clipping_is_refused_by_the_per_tensor_form() {
    let Err(err) = Lpmm8bitAdamWConfig::new()
        .with_max_grad_norm(Some(1.0))
        .init()
    else {
        panic!("global-norm clipping was accepted");
    };
    assert!(
        matches!(&err, BurnError::Config(m) if m.contains("GradientClipping")),
        "{err}"
    );
    // Invalid hyperparameters are refused before anything is built.
    let err = Lpmm8bitAdamWConfig::new()
        .with_beta_1(1.5)
        .build()
        .unwrap_err();
    assert!(matches!(err, BurnError::Optim(_)), "{err}");
}

/// burn's optimizer groups: `w1` and `w2` with lpmm's 8-bit AdamW, `b1` with LPMM-SGDM, `b2`
/// with burn's own f32 AdamW; the learning rate per group from burn's `ModuleLrScheduler`, and
/// `w2`'s gradients clipped by burn. Each lpmm group equals lpmm's reference over its own
/// parameters (registered in the order burn visits them), and `b2` equals burn's AdamW alone.
#[test]
fn groups_schedulers_and_clipping_reach_the_step() {
    let device = flex();
    let mut model = Mlp::new(&device, 9);
    let adamw8 = Lpmm8bitAdamWConfig::new().lpmm();
    let sgdm = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(2);
    let clip = GradientClipping::Value(2e-3);
    let mut optim = AdamWConfig::new()
        .init()
        .with_group(
            ParamGroup::from_predicate("w"),
            adamw8.build().unwrap(),
            None,
        )
        .with_group(
            ParamGroup::from_path("w2"),
            adamw8.build().unwrap(),
            Some(clip.clone()),
        )
        .with_group(ParamGroup::from_path("b1"), sgdm.build().unwrap(), None);
    // b2's reference: burn's own per-tensor AdamW on the same gradients.
    let burn_adamw = AdamWConfig::new().build();
    let mut b2 = model.b2.val().inner();
    let mut b2_state = None;
    let mut scheduler = ModuleLrSchedulerConfig::new(1e-2.into())
        .with_group(ParamGroup::from_path("w2"), 3e-2_f64)
        .with_group(ParamGroup::from_path("b1"), 5e-2_f64)
        .init()
        .unwrap();
    let v = values(&model);
    let s = shapes();
    let single = |config: &LpmmOptimizerConfig, k: usize| {
        let mut r = lpmm_optim::Optimizer::new(config.options).unwrap();
        r.add_group(config.param).unwrap();
        let id = r.add_param("p", &s[k], &v[k], 0).unwrap();
        (r, id)
    };
    let (mut r_w1, id_w1) = single(&adamw8, 0);
    let (mut r_w2, id_w2) = single(&adamw8, 2);
    let (mut r_b1, id_b1) = single(&sgdm, 1);
    for step in 0..4 {
        let lr = scheduler.step();
        let g = grads(&model, step, &device);
        let host = host_grads(&model, &g);
        // burn clips `w2`'s gradient before the optimizer sees it.
        let clipped_w2: Vec<f32> = clip
            .clip_gradient(g.get::<2>(model.w2.id).unwrap())
            .into_data()
            .try_to_vec()
            .unwrap();
        let one = |r: &mut lpmm_optim::Optimizer, id, grad: &Vec<f32>, lr: f64| {
            r.set_lr(lr).unwrap();
            let mut given = vec![Vec::new(); 1];
            given[lpmm_optim::ParamId::index(id)] = grad.clone();
            r.step(lpmm_optim::Step::given(&mut given)).unwrap();
        };
        one(&mut r_w1, id_w1, &host[0], 1e-2);
        one(&mut r_w2, id_w2, &clipped_w2, 3e-2);
        one(&mut r_b1, id_b1, &host[1], 5e-2);
        let g_b2 = g.get::<1>(model.b2.id).unwrap();
        (b2, b2_state) = burn_adamw.step(1e-2, b2, g_b2, b2_state);
        model = optim.step(lr, model, g);
        let bits = model.bits();
        let read1 = |r: &lpmm_optim::Optimizer, id, n: usize| {
            let mut out = vec![0f32; n];
            r.read(id, SlotKind::Param, &mut out).unwrap();
            out.into_iter().map(f32::to_bits).collect::<Vec<_>>()
        };
        assert_eq!(
            bits[0],
            read1(&r_w1, id_w1, D_IN * HIDDEN),
            "w1, step {step}"
        );
        assert_eq!(
            bits[2],
            read1(&r_w2, id_w2, HIDDEN * D_OUT),
            "w2, step {step}"
        );
        assert_eq!(bits[1], read1(&r_b1, id_b1, HIDDEN), "b1, step {step}");
        let b2_bits: Vec<u32> = b2
            .clone()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect();
        assert_eq!(bits[3], b2_bits, "b2 (burn's AdamW), step {step}");
    }
}

/// Trains `steps` per-tensor steps of `config` from a fresh model.
fn trained(config: LpmmOptimizerConfig, device: &Device, steps: usize) -> (Mlp, ModuleOptimizer) {
    trained_in(config, device, steps, DType::F32)
}

/// [`trained`] with parameters of `dtype`.
fn trained_in(
    config: LpmmOptimizerConfig,
    device: &Device,
    steps: usize,
    dtype: DType,
) -> (Mlp, ModuleOptimizer) {
    let mut model = Mlp::new_in(device, 4, dtype);
    let mut optim = config.init().unwrap();
    for step in 0..steps {
        let g = grads(&model, step, device);
        model = optim.step(0.01, model, g);
    }
    (model, optim)
}

#[test]
fn records_resume_bit_for_bit_in_a_new_model_and_optimizer() {
    let device = flex();
    let kahan = presets::adamw_8bit(0.0).with_param(lpmm_optim::Storage::Bf16Kahan);
    let configs = [
        // Lent f32 parameters, 8-bit states.
        (Lpmm8bitAdamWConfig::new().lpmm().with_seed(9), DType::F32),
        // Held 8-bit parameters, every slot stochastically rounded.
        (
            LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.02, 0.9)).with_seed(9),
            DType::F32,
        ),
        // Held bf16 + 8-bit correction parameters.
        (
            LpmmOptimizerConfig::from(presets::adamw_8bit_bf16_plus8(0.0)).with_seed(9),
            DType::F32,
        ),
        // Lent bf16 parameters with a Kahan compensation lpmm keeps (`param.comp`).
        (LpmmOptimizerConfig::from(kahan).with_seed(9), DType::BF16),
        // A third state, factorized for the matrices and resolved to none for the vectors (the
        // record carried the resolved configuration, which does not validate, so it lost them).
        (
            LpmmOptimizerConfig::from(presets::came_8bit(0.01)).with_seed(9),
            DType::F32,
        ),
    ];
    for (config, dtype) in configs {
        let (mut model, mut optim) = trained_in(config, &device, 3, dtype);
        let module_record = model.clone().into_record();
        // Through bytes, as a checkpoint file holds it.
        let bytes = optim.into_bytes().unwrap();
        let fresh = config.build().unwrap();
        let mut resumed = ModuleOptimizer::from(fresh.clone())
            .from_bytes(bytes)
            .unwrap();
        // A fresh model (other values, other ids) loaded from the module record.
        let mut other = Mlp::new_in(&device, 5, dtype).load_record(module_record);
        for step in 3..6 {
            let g = grads(&model, step, &device);
            model = optim.step(0.01, model, g);
            let g = grads(&other, step, &device);
            other = resumed.step(0.01, other, g);
            assert_eq!(model.bits(), other.bits(), "{config:?}, step {step}");
        }
        let stats = fresh.stats();
        assert!(stats.reinitialised.is_empty(), "{:?}", stats.reinitialised);
        assert_eq!(stats.params, 4);
    }
}

#[test]
fn the_record_names_lpmms_slots_readably() {
    let (model, optim) = trained(Lpmm8bitAdamWConfig::new().lpmm(), &flex(), 2);
    let bytes = optim.into_bytes().unwrap();
    let reader = burn_pack::Reader::from_bytes(bytes).unwrap();
    let names = reader.tensor_names();
    let w1 = model.w1.id.val();
    for leaf in ["lpmm", "state1", "state1.absmax", "state2", "state2.absmax"] {
        let name = format!("{w1}.{leaf}");
        assert!(names.iter().any(|n| *n == name), "{name} in {names:?}");
    }
    // The module record holds the parameter's value: no `param` tensor for a lent parameter.
    assert!(
        !names.iter().any(|n| *n == format!("{w1}.param")),
        "{names:?}"
    );
}

#[test]
fn a_record_from_burns_adamw_is_reinitialised_and_said() {
    // burn's AdamW record, loaded into lpmm: every parameter's state is re-initialised (what burn
    // does with a state it cannot rebuild), each reported; the run equals a fresh lpmm run.
    let device = flex();
    let mut model = Mlp::new(&device, 4);
    let mut adamw = AdamWConfig::new().init();
    for step in 0..2 {
        let g = grads(&model, step, &device);
        model = adamw.step(0.01, model, g);
    }
    let fresh = Lpmm8bitAdamWConfig::new().build().unwrap();
    let mut loaded = ModuleOptimizer::from(fresh.clone()).load_record(adamw.to_record());
    let mut clean = Lpmm8bitAdamWConfig::new().init().unwrap();
    let mut twin = model.clone();
    let g = grads(&model, 2, &device);
    model = loaded.step(0.01, model, g);
    let g = grads(&twin, 2, &device);
    twin = clean.step(0.01, twin, g);
    assert_eq!(model.bits(), twin.bits());
    let stats = fresh.stats();
    assert_eq!(stats.reinitialised.len(), 4, "{:?}", stats.reinitialised);
    assert!(
        stats.reinitialised[0].contains("no lpmm state"),
        "{:?}",
        stats.reinitialised
    );
    // And lpmm's record loaded into burn's AdamW: burn re-initialises (its documented
    // behaviour), no panic.
    let (model, optim) = trained(Lpmm8bitAdamWConfig::new().lpmm(), &device, 2);
    let mut burn_loaded = AdamWConfig::new().init().load_record(optim.to_record());
    let g = grads(&model, 2, &device);
    burn_loaded.step(0.01, model, g);
}

#[test]
fn a_damaged_record_is_reinitialised_never_loaded_as_another_state() {
    // One bit flipped in each of w1's record tensors (its metadata, codes and scales) at its
    // first, middle and last byte: the state is refused (the checksum, or the metadata that no
    // longer reads) and re-initialised, and the reason given.
    let device = flex();
    let (model, optim) = trained(Lpmm8bitAdamWConfig::new().lpmm(), &device, 2);
    let bytes = optim.into_bytes().unwrap();
    let reader = burn_pack::Reader::from_bytes(bytes.clone()).unwrap();
    let w1 = model.w1.id.val();
    let mut targets = Vec::new();
    for t in reader.into_tensors().unwrap() {
        let (name, _, _, _, data) = t.into_parts().unwrap();
        if name.starts_with(&format!("{w1}.")) {
            targets.push((name, data.to_vec()));
        }
    }
    assert_eq!(
        targets.len(),
        5,
        "{:?}",
        targets.iter().map(|t| &t.0).collect::<Vec<_>>()
    );
    let bytes = bytes.to_vec();
    for (name, data) in targets {
        // The tensor's bytes in the file (burnpack stores them as they are).
        let at = bytes
            .windows(data.len())
            .position(|w| w == data.as_slice())
            .expect("the tensor's bytes in the file");
        for offset in [0, data.len() / 2, data.len() - 1] {
            let mut edited = bytes.clone();
            edited[at + offset] ^= 0x10;
            let record =
                OptimizerRecord::from_bytes(burn_core::tensor::Bytes::from_bytes_vec(edited))
                    .expect("burn reads the record");
            let fresh = Lpmm8bitAdamWConfig::new().build().unwrap();
            let mut loaded = ModuleOptimizer::from(fresh.clone()).load_record(record);
            let m = Mlp::new(&device, 4).load_record(model.clone().into_record());
            let g = grads(&m, 2, &device);
            loaded.step(0.01, m, g);
            let stats = fresh.stats();
            assert_eq!(stats.reinitialised.len(), 1, "{name}+{offset}: {stats:?}");
        }
    }
}

/// Two of the MLP's parameters, under the same names.
#[derive(Module, Debug)]
struct Two {
    w1: burn_core::module::Param<Tensor<2>>,
    b2: burn_core::module::Param<Tensor<1>>,
}

#[test]
fn a_parameter_whose_shape_changed_is_reinitialised_and_said() {
    // The record of a model whose `b2` had 16 elements, loaded where `b2` has 8 (same ParamId).
    let device = flex();
    let (model, optim) = trained(Lpmm8bitAdamWConfig::new().lpmm(), &device, 2);
    let record = optim.to_record();
    let fresh = Lpmm8bitAdamWConfig::new().build().unwrap();
    let mut loaded = ModuleOptimizer::from(fresh.clone()).load_record(record);
    let mut changed = model.clone();
    changed.b2 = burn_core::module::Param::initialized(
        model.b2.id,
        Tensor::<1>::from_data(TensorData::new(vec![0.1f32; 8], [8]), &device).require_grad(),
    );
    let two = Two {
        w1: changed.w1.clone(),
        b2: changed.b2.clone(),
    };
    let x = Tensor::<2>::ones([2, D_IN], &device);
    let loss = (x.matmul(two.w1.val()).sum() + two.b2.val().sum()).mean();
    let g = GradientsParams::from_grads(loss.backward(), &two);
    let two = loaded.step(0.01, two, g);
    let stats = fresh.stats();
    assert_eq!(stats.reinitialised.len(), 1, "{stats:?}");
    assert!(stats.reinitialised[0].contains("shape"), "{stats:?}");
    assert_eq!(two.b2.val().dims(), [8]);
}

#[test]
fn a_replaced_tensor_of_another_shape_reinitialises_its_live_state() {
    // The module's tensor under w1's id replaced by one of the transposed shape (the same element
    // count) between two steps: its slots are laid out for the old shape, so the state is
    // re-initialised and said, as a loaded one of another shape is (it was stepped with them).
    let device = flex();
    let (mut optim, handle) = per_tensor(Lpmm8bitAdamWConfig::new().lpmm());
    let mut m = Mlp::new(&device, 4);
    let g = grads(&m, 0, &device);
    m = optim.step(0.01, m, g);
    let mut replaced = Two {
        w1: burn_core::module::Param::initialized(
            m.w1.id,
            Tensor::<2>::from_data(
                TensorData::new(vec![0.01f32; D_IN * HIDDEN], [HIDDEN, D_IN]),
                &device,
            )
            .require_grad(),
        ),
        b2: m.b2.clone(),
    };
    let before = replaced.w1.val().into_data();
    let x = Tensor::<2>::ones([2, HIDDEN], &device);
    let loss = (x.matmul(replaced.w1.val()).sum() + replaced.b2.val().sum()).mean();
    let g = GradientsParams::from_grads(loss.backward(), &replaced);
    replaced = optim.step(0.01, replaced, g);
    let stats = handle.stats();
    assert_eq!(stats.reinitialised.len(), 1, "{stats:?}");
    assert!(
        stats.reinitialised[0].contains("shape changed from [64, 128] to [128, 64]"),
        "{stats:?}"
    );
    assert_eq!(stats.error_count, 0, "{stats:?}");
    assert_eq!(replaced.w1.val().dims(), [HIDDEN, D_IN]);
    assert_ne!(
        replaced.w1.val().into_data(),
        before,
        "stepped from a fresh state"
    );
}

/// A vector met before a matrix: under Muon the vector is refused.
#[derive(Module, Debug)]
struct BiasFirst {
    b: burn_core::module::Param<Tensor<1>>,
    w: burn_core::module::Param<Tensor<2>>,
}

/// The matrix alone, under the same id.
#[derive(Module, Debug)]
struct MatrixOnly {
    w: burn_core::module::Param<Tensor<2>>,
}

#[test]
fn a_parameter_refused_at_registration_takes_no_stream_from_the_ones_after_it() {
    // The whole module given to per-tensor Muon, a bias first: the bias is refused (not a
    // matrix) and left unchanged; the matrix after it trains, with the bits it has where the bias
    // is not there at all (the refused bias took a stream, and the placeholder that moved the
    // matrix to the next one was a Muon parameter of one element, refused too: nothing trained).
    let device = flex();
    let w = Tensor::<2>::from_data(
        TensorData::new(
            (0..32 * 64)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 400.0)
                .collect::<Vec<_>>(),
            [32, 64],
        ),
        &device,
    );
    let b = Tensor::<1>::from_data(TensorData::new(vec![0.5f32; 64], [64]), &device);
    let config = LpmmOptimizerConfig::from(presets::muon_8bit(0.02)).with_seed(3);
    let mut both = BiasFirst {
        b: burn_core::module::Param::from_tensor(b.require_grad()),
        w: burn_core::module::Param::from_tensor(w.clone().require_grad()),
    };
    let mut alone = MatrixOnly {
        w: burn_core::module::Param::initialized(both.w.id, w.require_grad()),
    };
    let (mut optim_both, handle) = per_tensor(config);
    let (mut optim_alone, _) = per_tensor(config);
    let start = both.w.val().into_data();
    for step in 0..3 {
        let gw = |id| {
            let values = (0..32 * 64)
                .map(|i| (((i + 7 * step) * 53 % 97) as f32 - 48.0) / 100.0)
                .collect::<Vec<_>>();
            let mut g = GradientsParams::new();
            g.register(
                id,
                Tensor::<2>::from_data(TensorData::new(values, [32, 64]), &device.clone().inner()),
            );
            g
        };
        let mut g = gw(both.w.id);
        g.register(
            both.b.id,
            Tensor::<1>::from_data(
                TensorData::new(vec![0.1f32; 64], [64]),
                &device.clone().inner(),
            ),
        );
        both = optim_both.step(0.02, both, g);
        let g = gw(alone.w.id);
        alone = optim_alone.step(0.02, alone, g);
    }
    assert_ne!(both.w.val().into_data(), start, "the matrix trains");
    assert_eq!(both.w.val().into_data(), alone.w.val().into_data());
    assert_eq!(
        both.b.val().into_data(),
        TensorData::new(vec![0.5f32; 64], [64])
    );
    let stats = handle.stats();
    assert_eq!(stats.params, 1, "{stats:?}");
    assert!(stats.error_count >= 1, "{stats:?}");
    assert!(
        stats
            .errors
            .iter()
            .all(|e| e.contains("[64]") && !e.contains("pad")),
        "only the bias is refused: {:?}",
        stats.errors
    );
}

/// Two matrices.
#[derive(Module, Debug)]
struct TwoMatrices {
    a: burn_core::module::Param<Tensor<2>>,
    b: burn_core::module::Param<Tensor<2>>,
}

#[test]
fn a_muon_record_resumes_when_its_second_matrix_steps_first() {
    // Resumed, the first step gives only `b` a gradient: its loaded state (stream 1) is
    // registered first, behind a placeholder at stream 0. The placeholder was a Muon parameter of
    // one element, which Muon refuses, so `b`'s state did not import and was re-initialised.
    let device = flex();
    let config = LpmmOptimizerConfig::from(presets::muon_8bit(0.02)).with_seed(5);
    let matrix = |k: usize| {
        let values = (0..16 * 24)
            .map(|i| (((i + k) * 37 % 101) as f32 - 50.0) / 400.0)
            .collect::<Vec<_>>();
        Tensor::<2>::from_data(TensorData::new(values, [16, 24]), &device)
    };
    let grad = |k: usize| {
        let values = (0..16 * 24)
            .map(|i| (((i + 3 * k) * 53 % 97) as f32 - 48.0) / 100.0)
            .collect::<Vec<_>>();
        Tensor::<2>::from_data(TensorData::new(values, [16, 24]), &device.clone().inner())
    };
    let step = |optim: &mut ModuleOptimizer, m: TwoMatrices, k: usize, both: bool| {
        let mut g = GradientsParams::new();
        if both {
            g.register(m.a.id, grad(k));
        }
        g.register(m.b.id, grad(k + 1));
        optim.step(0.02, m, g)
    };
    let mut model = TwoMatrices {
        a: burn_core::module::Param::from_tensor(matrix(0).require_grad()),
        b: burn_core::module::Param::from_tensor(matrix(1).require_grad()),
    };
    let mut optim = config.init().unwrap();
    model = step(&mut optim, model, 0, true);
    let bytes = optim.into_bytes().unwrap();
    let fresh = config.build().unwrap();
    let mut resumed = ModuleOptimizer::from(fresh.clone())
        .from_bytes(bytes)
        .unwrap();
    let mut other = TwoMatrices {
        a: burn_core::module::Param::initialized(model.a.id, model.a.val()),
        b: burn_core::module::Param::initialized(model.b.id, model.b.val()),
    };
    for k in 1..3 {
        model = step(&mut optim, model, k, k > 1);
        other = step(&mut resumed, other, k, k > 1);
    }
    let stats = fresh.stats();
    assert!(stats.reinitialised.is_empty(), "{:?}", stats.reinitialised);
    assert_eq!(stats.error_count, 0, "{stats:?}");
    assert_eq!(model.a.val().into_data(), other.a.val().into_data());
    assert_eq!(model.b.val().into_data(), other.b.val().into_data());
}

#[test]
fn a_nan_gradient_skips_that_tensor_or_its_elements() {
    let device = flex();
    for policy in [NonFinitePolicy::SkipStep, NonFinitePolicy::SkipElements] {
        let mut model = Mlp::new(&device, 2);
        let (mut optim, handle) =
            per_tensor(Lpmm8bitAdamWConfig::new().lpmm().with_non_finite(policy));
        let g = grads(&model, 0, &device);
        model = optim.step(1e-3, model, g);
        let before = model.bits();
        let mut g = grads(&model, 1, &device);
        let mut bad = vec![0.5f32; D_OUT];
        bad[3] = f32::NAN;
        g.register(
            model.b2.id,
            Tensor::<1>::from_data(TensorData::new(bad, [D_OUT]), &device.clone().inner()),
        );
        model = optim.step(1e-3, model, g);
        let after = model.bits();
        let stats = handle.stats();
        assert_eq!(stats.non_finite, 1, "{stats:?}");
        assert_ne!(after[0], before[0], "w1 moves: no global skip here");
        match policy {
            NonFinitePolicy::SkipStep => {
                assert_eq!(stats.skipped, 1);
                assert_eq!(after[3], before[3], "b2's step is skipped");
            }
            NonFinitePolicy::SkipElements => {
                assert_eq!(stats.skipped, 0);
                assert_eq!(after[3][3], before[3][3], "the NaN element does not move");
                assert_ne!(after[3][2], before[3][2]);
            }
        }
    }
}

#[test]
fn a_refused_parameter_is_left_unchanged_and_reported() {
    // lpmm refuses to register a parameter that is not finite: the step leaves it (and every
    // other parameter's step goes ahead), and the handle reports it.
    let device = flex();
    let mut model = WithSpare::new(&device, 2, false);
    let mut spare = vec![0.25f32; 8];
    spare[0] = f32::INFINITY;
    model.spare = burn_core::module::Param::initialized(
        model.spare.id,
        Tensor::<1>::from_data(TensorData::new(spare, [8]), &device).require_grad(),
    );
    let (mut optim, handle) = per_tensor(Lpmm8bitAdamWConfig::new().lpmm());
    let (before, spare_before) = (model.mlp.bits(), model.spare.val().into_data());
    let mut g = model.grads(0, &device);
    g.register(
        model.spare.id,
        Tensor::<1>::from_data(
            TensorData::new(vec![0.5f32; 8], [8]),
            &device.clone().inner(),
        ),
    );
    model = optim.step(1e-3, model, g);
    assert_eq!(model.spare.val().into_data(), spare_before);
    assert_ne!(model.mlp.bits()[0], before[0]);
    let stats = handle.stats();
    assert_eq!((stats.error_count, stats.params), (1, 4), "{stats:?}");
    assert!(stats.errors[0].contains("finite"), "{:?}", stats.errors);
}

#[test]
fn a_cloned_optimizer_steps_its_own_copy_of_the_state() {
    let device = flex();
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(4);
    let (model, optim) = trained(config, &device, 2);
    let mut a = optim.clone();
    let mut b = optim;
    let (mut ma, mut mb) = (model.clone(), model);
    for step in 2..5 {
        let g = grads(&ma, step, &device);
        ma = a.step(0.01, ma, g);
        let g = grads(&mb, step, &device);
        mb = b.step(0.01, mb, g);
        assert_eq!(ma.bits(), mb.bits(), "step {step}");
    }
}

#[test]
fn a_state_moves_between_devices_and_continues_bit_for_bit() {
    // Per-tensor steps with explicit tensors: 2 steps on flex, the state moved to ndarray
    // (`to_device`, as burn's `ModuleOptimizer` calls it), 2 more; equal to 4 steps on flex.
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(6);
    let (cpu1, cpu2) = (Device::flex(), ndarray().inner());
    let values: Vec<f32> = (0..64 * 70)
        .map(|i| ((i % 13) as f32 - 6.0) * 0.01)
        .collect();
    let grad = |k: usize, d: &Device| {
        let g: Vec<f32> = (0..64 * 70)
            .map(|i| (((i * 7 + k * 3) % 17) as f32 - 8.0) * 1e-3)
            .collect();
        Tensor::<2>::from_data(TensorData::new(g, [64, 70]), d)
    };
    let t0 = |d: &Device| Tensor::<2>::from_data(TensorData::new(values.clone(), [64, 70]), d);
    // Each run with an optimizer of its own (a second tensor met by one optimizer is another
    // parameter, with another random stream).
    let optim = config.build().unwrap();
    let (mut t, mut s) = (t0(&cpu1), None);
    for k in 0..4 {
        (t, s) = optim.step(0.01, t, grad(k, &cpu1), s);
    }
    let straight: Vec<f32> = t.into_data().try_to_vec().unwrap();
    let optim = config.build().unwrap();
    let (mut t, mut s) = (t0(&cpu1), None);
    for k in 0..2 {
        (t, s) = optim.step(0.01, t, grad(k, &cpu1), s);
    }
    let mut s = s.map(|s| LpmmTensorOptimizer::to_device(s, &cpu2));
    let mut t = t.to_device(&cpu2);
    for k in 2..4 {
        (t, s) = optim.step(0.01, t, grad(k, &cpu2), s);
    }
    let moved: Vec<f32> = t.into_data().try_to_vec().unwrap();
    assert_eq!(
        moved.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        straight.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(optim.stats().error_count, 0);
}

#[test]
fn check_gradients_names_a_parameter_that_never_gets_one() {
    let device = flex();
    let model = WithSpare::new(&device, 4, false);
    let g = model.grads(0, &device);
    let m = check_gradients(&model, &g, MissingGradientPolicy::Ignore).unwrap();
    assert_eq!((m.count, m.checked), (1, 5));
    assert_eq!(m.names, [model.spare_label()]);
    let err = check_gradients(&model, &g, MissingGradientPolicy::Error).unwrap_err();
    assert!(err.to_string().contains(&model.spare_label()), "{err}");
    // Frozen on purpose: nothing to report.
    let frozen = WithSpare::new(&device, 4, true);
    let g = frozen.grads(0, &device);
    let m = check_gradients(&frozen, &g, MissingGradientPolicy::Error).unwrap();
    assert_eq!((m.count, m.checked), (0, 4));
}
