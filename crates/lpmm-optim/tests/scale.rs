//! Many tensors: 100,000 register and resolve by name, and a checkpoint of 80,000 one-element
//! parameters saves and loads. Registration and lookups are O(1) amortised (they were linear:
//! 42 µs per `add_param` at 20,000 tensors) and the loader is linear in the file (its name
//! lookups were quadratic: 28–124 s at 80,000). The times are printed, never asserted (speed is
//! measured, not tested: `cargo test --release -p lpmm-optim --test scale -- --nocapture`).

use lpmm_optim::Checkpoint;
use lpmm_optim::{Cpu, checkpoint::Canonical};
use std::time::{Duration, Instant};

use lpmm_optim::{Hyper, Optimizer, OptimizerOptions, ParamConfig};

/// The tests print their times: one at a time.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn model(n: usize) -> (Optimizer, Duration) {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt
        .add_group(ParamConfig::f32(Hyper::sgd(0.1, 0.9)))
        .unwrap();
    let names: Vec<String> = (0..n).map(|k| format!("layer{k}.weight")).collect();
    let start = Instant::now();
    for name in &names {
        opt.add_param(name, &[1], &[0.5], g).unwrap();
    }
    (opt, start.elapsed())
}

#[test]
fn a_hundred_thousand_tensors_register_and_resolve() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let n = 100_000;
    let (opt, register) = model(n);
    let start = Instant::now();
    for k in (0..n).rev() {
        assert_eq!(
            opt.param(
                opt.param(&format!("layer{k}.weight"))
                    .map(|p| p.id)
                    .unwrap()
            )
            .map(|p| p.name)
            .unwrap(),
            format!("layer{k}.weight")
        );
    }
    let lookup = start.elapsed();
    println!("{n} tensors: registered in {register:?}, every name resolved in {lookup:?}");
}

#[test]
fn loads_of_many_parameters_take_linear_time() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("lpmm-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for n in [20_000, 80_000] {
        let (opt, _) = model(n);
        let path = dir.join(format!("{n}.safetensors"));
        opt.save(&path, Checkpoint::new()).unwrap();
        let start = Instant::now();
        let back = Canonical::read(&path)
            .and_then(|c| c.into_optimizer(Cpu))
            .unwrap();
        let took = start.elapsed();
        assert_eq!(back.status().params, n);
        let size = std::fs::metadata(&path).unwrap().len();
        println!("{n} one-element parameters: file {size} bytes, loaded in {took:?}");
        // Every parameter came back under its own name.
        for k in [0, n / 2, n - 1] {
            let name = format!("layer{k}.weight");
            assert_eq!(
                back.param(back.param(&name).map(|p| p.id).unwrap())
                    .map(|p| p.name)
                    .unwrap(),
                name
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
