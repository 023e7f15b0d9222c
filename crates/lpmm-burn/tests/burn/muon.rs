//! burn-optim 0.22's `Muon` on the inputs of lpmm-optim's Muon golden file
//! (`crates/lpmm-optim/tests/golden/muon.safetensors`, torch 2.15's `torch.optim.Muon`): within
//! the bound lpmm's f32 Muon is held to (`TORCH_BOUND` of lpmm-optim's `tests/muon.rs`, 1e-2 of
//! the tensor's largest |value|), the two configurations burn has (burn has no
//! `"spectral_unclamped"`). burn's momentum is SGD's (`v = mu v + g`, the first `v = g`), torch's
//! a `lerp` (`buf = mu buf + (1 - mu) g`): the two differ by the factor `1 - mu`, which the
//! Newton–Schulz normalisation removes, so they agree up to rounding and eps.
//!
//! `cargo test --release -p lpmm-burn --test burn muon -- --nocapture` prints the differences.

use burn_core::tensor::{Device, Tensor, TensorData};
use burn_optim::decay::WeightDecayConfig;
use burn_optim::momentum::MomentumConfig;
use burn_optim::{AdjustLrFn, MuonConfig, Optimizer};

const GOLDEN: &[u8] = include_bytes!("../../../lpmm-optim/tests/golden/muon.safetensors");
/// lpmm-optim's `tests/muon.rs`: `TORCH_BOUND`.
const BOUND: f64 = 1e-2;
/// The golden matrices: (scenario tensor id, name, shape).
const MATRICES: [(u64, &str, [usize; 2]); 4] = [
    (10, "w", [40, 96]),
    (11, "t", [120, 36]),
    (12, "s", [48, 48]),
    (13, "x", [64, 200]),
];

/// The golden scenario's hash and values (lpmm-optim's `tests/common/mod.rs`, the same integer
/// arithmetic as its Python generators).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn u(tid: u64, t: u64, i: u64) -> f32 {
    let h = mix(tid
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(t.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(i));
    (h >> 40) as f32 / 8_388_608.0 - 1.0
}

fn init(tid: u64, n: usize) -> Vec<f32> {
    (0..n).map(|i| u(tid, 0, i as u64) * 0.5).collect()
}

fn grad(tid: u64, t: u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| u(tid, t, i as u64) * (0.01f32 * (1 + i % 7) as f32))
        .collect()
}

fn golden(st: &safetensors::SafeTensors<'_>, key: &str) -> Vec<f32> {
    let t = st.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Steps each golden matrix 100 times with burn's `optim` at `lr` and returns the largest
/// difference from torch's parameters after step 100 (`{cfg}.{ns}`), relative to the tensor's
/// largest |value|.
fn worst(optim: &burn_optim::Muon, lr: f64, cfg: &str, ns: &str) -> f64 {
    let device = Device::flex();
    let st = safetensors::SafeTensors::deserialize(GOLDEN).expect("golden file parses");
    let mut worst = 0f64;
    for (tid, name, shape) in MATRICES {
        let n = shape[0] * shape[1];
        let mut p = Tensor::<2>::from_data(TensorData::new(init(tid, n), shape), &device);
        let mut state = None;
        for t in 1..=100u64 {
            let g = Tensor::<2>::from_data(TensorData::new(grad(tid, t, n), shape), &device);
            (p, state) = optim.step(lr, p, g, state);
        }
        let got: Vec<f32> = p.into_data().try_to_vec::<f32>().unwrap();
        let want = golden(&st, &format!("{cfg}.{ns}.step100.{name}"));
        let scale = want.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
        let diff = want
            .iter()
            .zip(&got)
            .fold(0f64, |m, (a, b)| m.max(f64::from((a - b).abs())));
        println!(
            "burn-optim Muon, {cfg} ({ns} NS) {name}: {:.3e}",
            diff / scale
        );
        worst = worst.max(diff / scale);
    }
    worst
}

#[test]
fn burn_optims_muon_agrees_with_torch_within_lpmms_bound() {
    let default = MuonConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(0.1)))
        .build();
    let plain_rms = MuonConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
        .with_momentum(MomentumConfig {
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
        })
        .with_ns_steps(3)
        .with_adjust_lr_fn(AdjustLrFn::MatchRmsAdamW)
        .build();
    for (cfg, optim) in [("muon_default", &default), ("muon_plain_rms", &plain_rms)] {
        for ns in ["bf16", "f32"] {
            let w = worst(optim, 0.02, cfg, ns);
            assert!(w <= BOUND, "{cfg} ({ns} NS): {w:.3e} > {BOUND:.0e}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// lpmm's Muon through lpmm-burn: the whole-module form routed by `with_hybrid`, the per-tensor
// form routed by burn's own parameter groups.
// ---------------------------------------------------------------------------------------------

mod reach {
    use crate::common::{Mlp, grads, host_grads, read, shapes, values};
    use crate::tensor::flex;
    use burn_core::module::Module;
    use burn_core::module::ParamGroup;
    use burn_optim::ModuleOptimizer;
    use burn_optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
    use burn_optim::lr_scheduler::module_lr_scheduler::ModuleLrSchedulerConfig;
    use lpmm_burn::{BurnError, LpmmOptimizerConfig};
    use lpmm_optim::{Hybrid, OptimizerOptions, ParamConfig, ParamId, Route, SlotKind, presets};

    const NAMES: [&str; 4] = ["w1", "b1", "w2", "b2"];
    const MUON_LR: f64 = 2e-2;
    const ADAMW_LR: f64 = 1e-3;

    /// 8-bit Muon and 8-bit AdamW with f32 parameters (round to nearest everywhere, so the two
    /// burn forms, which key stochastic-rounding streams differently, give the same bits), `w2`
    /// (the output layer) routed to AdamW by the user's route.
    fn hybrid() -> (ParamConfig, ParamConfig, Hybrid) {
        let muon = presets::muon_8bit(MUON_LR).build();
        let adamw = presets::adamw_8bit(ADAMW_LR).build();
        (
            muon,
            adamw,
            Hybrid::new(muon, adamw).route("w2", Route::Others),
        )
    }

    /// lpmm-optim's optimizer with each parameter in the group its route gives.
    fn reference(h: &Hybrid, init: &[Vec<f32>]) -> (lpmm_optim::Optimizer, Vec<ParamId>) {
        let mut r = lpmm_optim::Optimizer::new(OptimizerOptions::default()).unwrap();
        r.add_group(h.matrices).unwrap();
        r.add_group(h.others).unwrap();
        let ids = NAMES
            .iter()
            .zip(shapes())
            .zip(init)
            .map(|((name, shape), v)| {
                let group = match h.route_of(name, &shape) {
                    Route::Matrices => 0,
                    Route::Others => 1,
                };
                r.add_param(name, &shape, v, group).unwrap()
            })
            .collect();
        r.set_group_lr(0, MUON_LR).unwrap();
        r.set_group_lr(1, ADAMW_LR).unwrap();
        (r, ids)
    }

    fn scheduler() -> ModuleLrScheduler {
        ModuleLrSchedulerConfig::new(ADAMW_LR.into())
            .with_group(ParamGroup::from_path("w1"), MUON_LR)
            .init()
            .unwrap()
    }

    /// The whole-module optimizer routed by `with_hybrid` (module paths and shapes), burn's
    /// `ModuleOptimizer` with lpmm's Muon in a parameter group of its own, and lpmm-optim's
    /// optimizer routed by `Hybrid::route_of` give the same bits at every step.
    #[test]
    fn muon_through_both_burn_forms_equals_lpmm_routed_by_hybrid() {
        let device = flex();
        let (muon, adamw, h) = hybrid();
        let routes: Vec<Route> = NAMES
            .iter()
            .zip(shapes())
            .map(|(n, s)| h.route_of(n, &s))
            .collect();
        assert_eq!(
            routes,
            [Route::Matrices, Route::Others, Route::Others, Route::Others]
        );
        let mut a = Mlp::new(&device, 5);
        let mut b = Mlp::new(&device, 5);
        let (mut r, ids) = reference(&h, &values(&a));
        let mut whole = LpmmOptimizerConfig::from(adamw)
            .init_whole_module()
            .with_hybrid(h.clone())
            .unwrap();
        let muon_optim = LpmmOptimizerConfig::from(muon).build().unwrap();
        let mut per_tensor = ModuleOptimizer::from(
            LpmmOptimizerConfig::from(adamw).build().unwrap(),
        )
        .with_group(ParamGroup::from_path("w1"), muon_optim.clone(), None);
        let (mut sa, mut sb) = (scheduler(), scheduler());
        for step in 0..6 {
            let ga = grads(&a, step, &device);
            let gb = grads(&b, step, &device);
            let mut given = host_grads(&a, &ga);
            let mut full = vec![Vec::new(); r.status().params];
            for (&id, g) in ids.iter().zip(given.drain(..)) {
                full[id.index()] = g;
            }
            r.step(lpmm_optim::Step::given(&mut full)).unwrap();
            a = per_tensor.step(sa.step(), a, ga);
            b = whole.step(sb.step(), b, gb).unwrap();
            let want = read(&r, &ids);
            assert_eq!(a.bits(), want, "step {step}: per-tensor against lpmm");
            assert_eq!(b.bits(), want, "step {step}: whole-module against lpmm");
        }
        // w1 really went through Muon: its state is one momentum buffer in 8 bits.
        let mut codes = vec![0f32; 64 * 128];
        r.read(ids[0], SlotKind::State1, &mut codes).unwrap();
        assert!(codes.iter().any(|&c| c != 0.0));
        let stats = muon_optim.stats();
        assert_eq!((stats.params, stats.steps, stats.error_count), (1, 6, 0));
        let report = whole.memory_report();
        assert!(report.workspace > 0, "Muon's matrix workspace: {report:?}");
    }

    /// A 1-D parameter routed to Muon: the whole-module step refuses it with the parameter's
    /// path and `NotAMatrix`, changing nothing; the per-tensor form (which cannot return an
    /// error to burn) leaves it unchanged and reports it; the other parameters step.
    #[test]
    fn a_vector_routed_to_muon_is_refused_with_its_name() {
        let device = flex();
        let (muon, adamw, h) = hybrid();
        let model = Mlp::new(&device, 5);
        let g = grads(&model, 0, &device);
        let mut whole = LpmmOptimizerConfig::from(adamw)
            .init_whole_module()
            .with_hybrid(h.route("b1", Route::Matrices))
            .unwrap();
        let err = whole.step(1e-3, model, g).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("b1") && text.contains("matri"),
            "whole-module: {text}"
        );
        // The parameter is named once, with its path.
        assert_eq!(
            text.matches("parameter ").count(),
            1,
            "whole-module: {text}"
        );
        assert!(whole.stats().params <= 1, "{:?}", whole.stats());

        let model = Mlp::new(&device, 5);
        let before = model.bits();
        let muon_optim = LpmmOptimizerConfig::from(muon).build().unwrap();
        let mut per_tensor = ModuleOptimizer::from(
            LpmmOptimizerConfig::from(adamw).build().unwrap(),
        )
        .with_group(ParamGroup::from_path("b1"), muon_optim.clone(), None);
        let g = grads(&model, 0, &device);
        let model = per_tensor.step(1e-3, model, g);
        let after = model.bits();
        assert_eq!(after[1], before[1], "b1 is left as it was");
        assert_ne!(after[0], before[0], "w1 steps");
        let stats = muon_optim.stats();
        assert_eq!(stats.error_count, 1, "{stats:?}");
        assert!(
            stats.errors[0].contains("matri"),
            "per-tensor: {:?}",
            stats.errors
        );
    }

    /// `with_hybrid` after the first step, or with an invalid configuration, is refused.
    #[test]
    fn with_hybrid_is_refused_once_parameters_are_registered() {
        let device = flex();
        let (_, adamw, h) = hybrid();
        let mut whole = LpmmOptimizerConfig::from(adamw).init_whole_module();
        let model = Mlp::new(&device, 5);
        let g = grads(&model, 0, &device);
        let _ = whole.step(1e-3, model, g).unwrap();
        assert!(matches!(
            whole.with_hybrid(h.clone()),
            Err(BurnError::Config(_))
        ));
        let bad = Hybrid::new(presets::muon_f32(-1.0).momentum(1.5), adamw);
        let fresh = LpmmOptimizerConfig::from(adamw).init_whole_module();
        assert!(fresh.with_hybrid(bad).is_err());
    }

    /// A routed whole-module optimizer saved after 3 steps and loaded into a new one (routed
    /// the same way) continues with the bits of an uninterrupted run.
    #[test]
    fn a_routed_record_resumes_bit_for_bit() {
        let device = flex();
        let (_, adamw, h) = hybrid();
        let routed = || {
            LpmmOptimizerConfig::from(adamw)
                .init_whole_module()
                .with_hybrid(h.clone())
                .unwrap()
        };
        let mut a = Mlp::new(&device, 3);
        let mut optim = routed();
        let mut s = scheduler();
        for step in 0..3 {
            let g = grads(&a, step, &device);
            a = optim.step(s.step(), a, g).unwrap();
        }
        let module_record = a.clone().into_record();
        let record = optim.to_record().unwrap();
        // A fresh model (other values, other ids) loaded from the module record.
        let mut b = Mlp::new(&device, 8).load_record(module_record);
        let mut resumed = routed().load_record(record).unwrap();
        let mut sb = scheduler();
        for _ in 0..3 {
            sb.step();
        }
        for step in 3..6 {
            let lr = s.step();
            let g = grads(&a, step, &device);
            a = optim.step(lr, a, g).unwrap();
            let g = grads(&b, step, &device);
            b = resumed.step(sb.step(), b, g).unwrap();
            assert_eq!(a.bits(), b.bits(), "step {step}");
        }
    }
}
