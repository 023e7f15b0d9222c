//! Many tensors: registration and name lookups are O(1) amortised (they were linear: 42 µs per
//! `add_param` at 20,000 tensors), and a checkpoint of many one-element parameters loads in time
//! linear in the file (the loader's name lookups were quadratic: 28–124 s at 80,000).
//! Bounds are for release builds (the test command), with a wide margin for a loaded machine;
//! debug builds get ten times as much.

use std::time::{Duration, Instant};

use lpmm_optim::{Hyper, Optimizer, OptimizerOptions, ParamConfig};

/// The tests time themselves: one at a time.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn bound(release: f64) -> Duration {
    let scale = if cfg!(debug_assertions) { 10.0 } else { 1.0 };
    Duration::from_secs_f64(release * scale)
}

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
fn a_hundred_thousand_tensors_register_and_resolve_in_well_under_a_second() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let n = 100_000;
    let (opt, register) = model(n);
    let start = Instant::now();
    for k in (0..n).rev() {
        assert_eq!(
            opt.name(opt.param_id(&format!("layer{k}.weight")).unwrap())
                .unwrap(),
            format!("layer{k}.weight")
        );
    }
    let lookup = start.elapsed();
    println!("{n} tensors: registered in {register:?}, every name resolved in {lookup:?}");
    assert!(register < bound(1.0), "registration took {register:?}");
    assert!(lookup < bound(1.0), "lookups took {lookup:?}");
}

#[test]
fn loads_of_many_parameters_take_linear_time() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("lpmm-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut times = Vec::new();
    for n in [20_000, 80_000] {
        let (opt, _) = model(n);
        let path = dir.join(format!("{n}.safetensors"));
        opt.save(&path).unwrap();
        let start = Instant::now();
        let back = Optimizer::load(&path).unwrap();
        let took = start.elapsed();
        assert_eq!(back.len(), n);
        let size = std::fs::metadata(&path).unwrap().len();
        println!("{n} one-element parameters: file {size} bytes, loaded in {took:?}");
        times.push(took);
    }
    // 80,000 parameters: measured about 1.3 s; quadratic lookups took 28-124 s.
    assert!(
        times[1] < bound(8.0),
        "80,000 parameters took {:?}",
        times[1]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
