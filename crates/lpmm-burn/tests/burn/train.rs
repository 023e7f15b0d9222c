//! burn-train's `Learner` with lpmm's optimizer, as a burn user trains (the `train` example's
//! digits classifier, small): `SupervisedTraining` with metrics and burn-train's checkpointer, on
//! burn-flex and on burn's wgpu device. A run stopped after epoch 1 and resumed from burn-train's
//! checkpoint in a fresh model and optimizer ends with the same bits as the uninterrupted run,
//! every saved state loaded (none re-initialised).

#[path = "../../examples/train.rs"]
#[allow(dead_code)]
mod example;

use burn_core::module::{Module, ModuleVisitor, Param};
use burn_core::tensor::{Device, Tensor};
use burn_optim::ModuleOptimizer;
use example::{Classifier, Settings, evaluate, fit};
use lpmm_burn::Lpmm8bitAdamWConfig;

use crate::common::{serial, wgpu_device};
use crate::tensor::flex;

/// Every float parameter's bits, in visiting order.
#[derive(Default)]
struct Bits(Vec<Vec<u32>>);

impl ModuleVisitor for Bits {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let v: Vec<f32> = param
            .val()
            .into_data()
            .convert::<f32>()
            .try_to_vec()
            .unwrap();
        self.0.push(v.into_iter().map(f32::to_bits).collect());
    }
}

fn bits(model: &Classifier) -> Vec<Vec<u32>> {
    let mut b = Bits::default();
    model.visit(&mut b);
    b.0
}

fn resumes_bit_for_bit(device: &Device) {
    let settings = Settings {
        hidden: 64,
        epochs: 2,
        batch: 256,
        ..Settings::default()
    };
    let one = Settings {
        epochs: 1,
        ..settings
    };
    device.seed(7);
    let model = Classifier::new(device, settings.hidden);
    let (_, initial_loss) = evaluate(&model, device).unwrap();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // The optimizer line is a burn user's: `Lpmm8bitAdamWConfig::new().init()?`.
    let optim = Lpmm8bitAdamWConfig::new().init().unwrap();
    let straight = fit(model.clone(), optim, &settings, a.path(), None);
    assert!(straight.error.is_none(), "{:?}", straight.error);
    let optim = Lpmm8bitAdamWConfig::new().init().unwrap();
    let first = fit(model.clone(), optim, &one, b.path(), None);
    assert!(first.error.is_none(), "{:?}", first.error);
    assert_ne!(bits(&first.model), bits(&straight.model));
    // A fresh model (other values, other ids) and optimizer, resumed from epoch 1's checkpoint.
    let other = Classifier::new(device, settings.hidden);
    let handle = Lpmm8bitAdamWConfig::new().build().unwrap();
    let resumed = fit(
        other,
        ModuleOptimizer::from(handle.clone()),
        &settings,
        b.path(),
        Some(1),
    );
    assert!(resumed.error.is_none(), "{:?}", resumed.error);
    assert_eq!(bits(&resumed.model), bits(&straight.model));
    // Epoch 2 only: every batch stepped each of the 6 parameters from its loaded state.
    let stats = handle.stats();
    assert!(stats.reinitialised.is_empty(), "{:?}", stats.reinitialised);
    assert_eq!((stats.steps, stats.error_count), (6 * 6, 0), "{stats:?}");
    // The optimizer checkpoint names lpmm's slots readably.
    let reader =
        burn_pack::Reader::from_file(b.path().join("checkpoint").join("optim-1.bpk")).unwrap();
    let names = reader.tensor_names();
    for leaf in [".lpmm", ".state1", ".state1.absmax", ".state2"] {
        assert!(
            names.iter().any(|n| n.ends_with(leaf)),
            "{leaf} in {names:?}"
        );
    }
    // And it trained.
    let (accuracy, loss) = evaluate(&straight.model, device).unwrap();
    assert!(
        loss < initial_loss && accuracy > 0.2,
        "{initial_loss} -> {loss}, {accuracy}"
    );
}

#[test]
fn burn_trains_with_lpmm_and_resumes_bit_for_bit_on_flex() {
    resumes_bit_for_bit(&flex());
}

#[test]
fn burn_trains_with_lpmm_and_resumes_bit_for_bit_on_wgpu() {
    let _serial = serial();
    let Some(device) = wgpu_device() else {
        return;
    };
    resumes_bit_for_bit(&device);
}

#[test]
fn the_train_example_runs_both_arms_on_every_backend() {
    let _serial = serial();
    let settings = Settings {
        hidden: 128,
        epochs: 2,
        batch: 256,
        ..Settings::default()
    };
    for (backend, device) in [("flex", Some(flex())), ("wgpu", wgpu_device())] {
        let Some(device) = device else { continue };
        let mut runs = Vec::new();
        for arm in example::ARMS {
            let dir = tempfile::tempdir().unwrap();
            let run = example::run(&device, backend, arm, &settings, dir.path()).unwrap();
            assert_eq!(run.lpmm_errors, 0, "{run:?}");
            assert_eq!(run.steps, 12, "{run:?}");
            assert!(run.val_accuracy > 0.3 && run.ms_per_step > 0.0, "{run:?}");
            // (Peak and steady memory are the example's child processes' to compare: this process
            // runs other tests beside it.)
            assert!(run.peak_kib > 0 && run.steady_kib > 0, "{run:?}");
            assert_eq!(run.device.is_some(), backend == "wgpu", "{run:?}");
            runs.push(run);
        }
        let (burn, lpmm) = (&runs[0], &runs[1]);
        assert!(
            (burn.val_accuracy - lpmm.val_accuracy).abs() < 0.1,
            "{burn:?} {lpmm:?}"
        );
        // The two 8-bit states of the large matrices: about a quarter of burn's f32 moments.
        assert!(
            (lpmm.state_bytes as f64) < 0.45 * burn.state_bytes as f64,
            "{burn:?} {lpmm:?}"
        );
        // burn-train with 8-bit Muon for the hidden matrix (burn's parameter groups route; the
        // matrix phase is the CPU's): it trains, and its one 8-bit momentum holds less than
        // 8-bit AdamW's two moments.
        if backend == "flex" {
            let dir = tempfile::tempdir().unwrap();
            let muon = example::run(&device, backend, "lpmm-muon8", &settings, dir.path()).unwrap();
            assert_eq!((muon.lpmm_errors, muon.steps), (0, 12), "{muon:?}");
            assert!(muon.val_accuracy > 0.3, "{muon:?}");
            assert!(muon.state_bytes < lpmm.state_bytes, "{muon:?} {lpmm:?}");
        }
    }
}
