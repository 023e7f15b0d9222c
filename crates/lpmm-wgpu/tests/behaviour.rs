//! Checkpoints across backends, typed errors for what the backend does not hold, many tensors
//! per dispatch, subnormal values, large tensors cut at the storage-binding limit.

mod common;

use common::{Rng, assert_same, backend, small};
use lpmm_optim::{
    Hyper, MapKind, OptimError, Optimizer, OptimizerOptions, ParamConfig, ParamId, Storage, presets,
};
use lpmm_wgpu::WgpuOptions;

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lpmm-wgpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn checkpoints_move_between_cpu_and_wgpu_and_resume_exactly() {
    let Some(gpu) = backend(small()) else { return };
    let options = OptimizerOptions {
        seed: 99,
        ..Default::default()
    };
    for (name, config) in [
        ("8bit", presets::adamw_8bit_bf16_sr(1e-3)),
        ("lpmm", presets::lpmm_sgdm(0.05, 0.9)),
        ("4bit", presets::adamw_4bit_split(1e-3)),
    ] {
        let mut rng = Rng(5);
        let mut cpu = Optimizer::new(options).unwrap();
        cpu.add_group(config).unwrap();
        let sizes = [20_000usize, 5000, 300];
        let ids: Vec<ParamId> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                cpu.add_param(&format!("w{k}"), &[n], &rng.spread(n, 0.5), 0)
                    .unwrap()
            })
            .collect();
        let grads = |rng: &mut Rng| sizes.map(|n| rng.spread(n, 1.0));
        let g = grads(&mut rng);
        for (&id, g) in ids.iter().zip(&g) {
            cpu.accumulate(id, g).unwrap();
        }
        cpu.step().unwrap();
        // A pending micro-batch travels too.
        let g = grads(&mut rng);
        cpu.accumulate(ids[0], &g[0]).unwrap();
        let path = temp(&format!("{name}-cpu.safetensors"));
        cpu.save(&path).unwrap();
        let mut dev = Optimizer::load_with(gpu.clone(), &path).unwrap();
        assert_same(&cpu, &dev, &ids, &format!("{name}: cpu checkpoint on wgpu"));
        for round in 0..2 {
            let g = grads(&mut rng);
            for (&id, g) in ids.iter().zip(&g) {
                cpu.accumulate(id, g).unwrap();
                dev.accumulate(id, g).unwrap();
            }
            assert_eq!(cpu.step().unwrap(), dev.step().unwrap());
            assert_same(&cpu, &dev, &ids, &format!("{name}: resumed step {round}"));
        }
        // And back: saved on wgpu, loaded on the CPU.
        let path = temp(&format!("{name}-wgpu.safetensors"));
        dev.save(&path).unwrap();
        let mut back = Optimizer::load(&path).unwrap();
        assert_same(
            &dev,
            &back,
            &ids,
            &format!("{name}: wgpu checkpoint on cpu"),
        );
        let g = grads(&mut rng);
        for (&id, g) in ids.iter().zip(&g) {
            back.accumulate(id, g).unwrap();
            dev.accumulate(id, g).unwrap();
        }
        back.step().unwrap();
        dev.step().unwrap();
        assert_same(&back, &dev, &ids, &format!("{name}: after the round trip"));
    }
}

#[test]
fn tensor_wide_second_moments_are_a_typed_error() {
    let Some(gpu) = backend(small()) else { return };
    for state2 in [
        Storage::Factorized,
        Storage::Rank1 {
            map: MapKind::LinearWithoutZero4,
            fallback: lpmm_quant::BlockSize::B128,
        },
    ] {
        let mut opt = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
        opt.add_group(ParamConfig {
            state2,
            ..presets::adamw_4bit_split(1e-3)
        })
        .unwrap();
        let err = opt
            .add_param("m", &[128, 64], &vec![0.1; 128 * 64], 0)
            .unwrap_err();
        assert!(
            matches!(&err, OptimError::Unsupported { backend: "wgpu", what } if what.contains("state2")),
            "{err}"
        );
        // Below the minimum quantized size the state is f32, which the backend holds.
        opt.add_param("small", &[10, 10], &[0.1; 100], 0).unwrap();
    }
}

#[test]
fn many_small_tensors_share_one_dispatch() {
    let Some(gpu) = backend(WgpuOptions::default()) else {
        return;
    };
    let mut opt = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
    opt.add_group(presets::adamw_8bit_bf16(1e-3)).unwrap();
    let mut rng = Rng(8);
    let ids: Vec<ParamId> = (0..1000)
        .map(|k| {
            opt.add_param(&format!("b{k}"), &[64], &rng.spread(64, 0.1), 0)
                .unwrap()
        })
        .collect();
    for &id in &ids {
        opt.accumulate(id, &rng.spread(64, 1.0)).unwrap();
    }
    let before = gpu.dispatches();
    assert_eq!(opt.step().unwrap().updated, 1000);
    assert_eq!(gpu.segments(), 1);
    // The finiteness check (SkipStep) decodes every accumulator in one dispatch, the step in one.
    assert_eq!(
        gpu.dispatches() - before,
        2,
        "one segment: one decode and one step dispatch"
    );
}

#[test]
fn subnormal_values_are_bit_exact_where_the_probe_says_so() {
    let Some(gpu) = backend(small()) else { return };
    let behaviour = gpu.float_behaviour();
    eprintln!("{behaviour:?}");
    let config = ParamConfig::f32(Hyper::adamw(1e-3));
    let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
    let mut dev = Optimizer::with_backend(gpu, OptimizerOptions::default()).unwrap();
    cpu.add_group(config).unwrap();
    dev.add_group(config).unwrap();
    let n = 10_000;
    let mut rng = Rng(4);
    let init = rng.spread(n, 1e-37);
    let a = cpu.add_param("w", &[n], &init, 0).unwrap();
    dev.add_param("w", &[n], &init, 0).unwrap();
    for _ in 0..3 {
        // Squares of these are subnormal or underflow.
        let g = rng.spread(n, 1e-19);
        cpu.step_param(a, &g).unwrap();
        dev.step_param(a, &g).unwrap();
    }
    let mut v = vec![0f32; n];
    cpu.read_state(a, 2, &mut v).unwrap();
    let subnormal = v.iter().filter(|x| x.is_subnormal()).count();
    assert!(
        subnormal > 1000,
        "the case must produce subnormal states ({subnormal})"
    );
    if behaviour.bit_exact() {
        assert_same(&cpu, &dev, &[a], "subnormal states");
    } else {
        eprintln!("this adapter is not bit-exact on subnormals; see docs/BACKENDS.md");
    }
}

#[test]
fn a_tensor_larger_than_a_segment_is_cut_into_pieces() {
    // 1.5 segments of parameter memory in one tensor, with the real piece size.
    let options = WgpuOptions {
        segment_bytes: 8 << 20,
        ..WgpuOptions::default()
    };
    let Some(gpu) = backend(options) else { return };
    let config = presets::adamw_8bit_bf16(1e-3);
    let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
    let mut dev = Optimizer::with_backend(gpu.clone(), OptimizerOptions::default()).unwrap();
    cpu.add_group(config).unwrap();
    dev.add_group(config).unwrap();
    let n = 3 << 20;
    let mut rng = Rng(6);
    let init = rng.spread(n, 0.5);
    let a = cpu.add_param("big", &[n], &init, 0).unwrap();
    dev.add_param("big", &[n], &init, 0).unwrap();
    for _ in 0..2 {
        let g = rng.spread(n, 1.0);
        cpu.accumulate(a, &g).unwrap();
        dev.accumulate(a, &g).unwrap();
        cpu.step().unwrap();
        dev.step().unwrap();
    }
    assert!(gpu.segments() >= 2);
    assert_same(&cpu, &dev, &[a], "a tensor over several segments");
}
