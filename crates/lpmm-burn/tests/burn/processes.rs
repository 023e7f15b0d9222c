//! Across processes: two fresh processes that build the same model step the same bits (the
//! stochastic-rounding streams follow the module, not burn's random `ParamId`s), and a run saved
//! with burn's recorders (module record + optimizer record) and resumed in a fresh process
//! equals the uninterrupted run bit for bit (the optimizer state is matched to the tensors by the
//! `ParamId`s the module record restores).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{Mlp, grads};
use burn_core::module::Module;
use burn_core::tensor::Device;
use lpmm_burn::{Lpmm8bitAdamWConfig, LpmmOptimizerConfig};
use lpmm_optim::presets;

#[allow(deprecated)] // burn 0.22 deprecates ndarray in favour of flex; both are supported.
fn ndarray() -> Device {
    Device::ndarray().autodiff()
}

/// LPMM-SGDM (8-bit parameters, gradients and momentum, all stochastically rounded, held by
/// lpmm) and 8-bit AdamW (parameters stepped in the module's tensors).
fn configs() -> [(&'static str, LpmmOptimizerConfig); 2] {
    [
        (
            "sgdm",
            LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(11),
        ),
        ("adamw8", Lpmm8bitAdamWConfig::new().lpmm().with_seed(11)),
    ]
}

const STEPS: usize = 6;
const SPLIT: usize = 3;

fn write_bits(path: &Path, model: &Mlp) {
    let bytes: Vec<u8> = model
        .bits()
        .into_iter()
        .flatten()
        .flat_map(u32::to_le_bytes)
        .collect();
    std::fs::write(path, bytes).unwrap();
}

/// What a child process does, by `LPMM_BURN_CHILD=<mode>:<dir>`: `straight:<tag>` trains all
/// steps and writes the parameters' bits; `first` trains the first steps and saves both records;
/// `resume` loads them and trains the rest.
fn child_main(mode: &str, dir: &Path) {
    let device = ndarray();
    for (name, config) in configs() {
        let lr = 0.02;
        match mode.split_once(':').map_or((mode, ""), |(m, t)| (m, t)) {
            ("straight", tag) => {
                let mut model = Mlp::new(&device, 21);
                let mut optim = config.init_whole_module();
                for step in 0..STEPS {
                    let g = grads(&model, step, &device);
                    model = optim.step(lr, model, g).unwrap();
                }
                write_bits(&dir.join(format!("{name}-straight-{tag}.bin")), &model);
            }
            ("first", _) => {
                let mut model = Mlp::new(&device, 21);
                let mut optim = config.init_whole_module();
                for step in 0..SPLIT {
                    let g = grads(&model, step, &device);
                    model = optim.step(lr, model, g).unwrap();
                }
                model
                    .save_file(dir.join(format!("{name}-model.bpk")))
                    .unwrap();
                optim.save(dir.join(format!("{name}-optim.bpk"))).unwrap();
            }
            ("resume", _) => {
                // Another initial model: everything comes from the records.
                let mut model =
                    Mlp::new(&device, 99).load_file(dir.join(format!("{name}-model.bpk")));
                let mut optim = config
                    .init_whole_module()
                    .load(dir.join(format!("{name}-optim.bpk")))
                    .unwrap();
                for step in SPLIT..STEPS {
                    let g = grads(&model, step, &device);
                    model = optim.step(lr, model, g).unwrap();
                }
                write_bits(&dir.join(format!("{name}-resumed.bin")), &model);
            }
            (other, _) => panic!("unknown child mode {other}"),
        }
    }
}

/// The child process's entry (a no-op in a normal test run).
#[test]
fn child() {
    if let Ok(spec) = std::env::var("LPMM_BURN_CHILD") {
        let (mode, dir) = spec.rsplit_once('@').expect("mode@dir");
        child_main(mode, Path::new(dir));
    }
}

fn run_child(mode: &str, dir: &Path) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "processes::child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("LPMM_BURN_CHILD", format!("{mode}@{}", dir.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child {mode}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn two_processes_step_identical_bits_and_a_saved_run_resumes_exactly_in_a_fresh_process() {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("lpmm-burn-processes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    run_child("straight:a", &dir);
    run_child("straight:b", &dir);
    run_child("first", &dir);
    run_child("resume", &dir);
    for (name, _) in configs() {
        let read = |f: &str| std::fs::read(dir.join(format!("{name}-{f}.bin"))).unwrap();
        let (a, b, resumed) = (read("straight-a"), read("straight-b"), read("resumed"));
        assert!(!a.is_empty());
        assert!(a == b, "{name}: two fresh processes differ");
        assert!(
            a == resumed,
            "{name}: the resumed run differs from the uninterrupted one"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
