//! The CUDA backend against the CPU reference, bit for bit (lpmm-optim's conformance suite),
//! on every device this machine has: always the kernels compiled for the host (the `emulate`
//! feature: the same kernel source and the same driving code), and a real GPU when a CUDA driver
//! and device are present (otherwise a message says the GPU half was skipped; with
//! `LPMM_REQUIRE_CUDA=1` a missing GPU fails instead).

use lpmm_cuda::{Cuda, CudaError, CudaOptions};
use lpmm_optim::testing::{self, Rng, assert_same};
use lpmm_optim::{Optimizer, OptimizerOptions, ParamId, presets};

/// A small io buffer, so that gradients and decoded values of the larger test tensors move in
/// several launches (results must not depend on it).
const SMALL: CudaOptions = CudaOptions { io_floats: 8192 };

fn devices(options: CudaOptions) -> Vec<Cuda> {
    let mut out = vec![Cuda::emulated(options).expect("the emulated device")];
    let gpu = if Cuda::driver_present() {
        Cuda::new(0).and_then(|c| {
            let stream = c.stream().expect("a GPU backend has a stream").clone();
            Cuda::with_stream(stream, options)
        })
    } else {
        Err(CudaError::NoDriver)
    };
    match gpu {
        Ok(g) => {
            eprintln!("also on the GPU: {} ({})", g.device_name(), g.arch());
            out.push(g);
        }
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_CUDA=1 but {e}");
            }
            eprintln!("skipping the GPU half of this test (the emulated device ran): {e}");
        }
    }
    out
}

#[test]
fn presets_are_bit_exact() {
    for d in devices(SMALL) {
        testing::presets_are_bit_exact(&d);
    }
}

#[test]
fn every_optimizer_with_every_storage_is_bit_exact() {
    for d in devices(SMALL) {
        testing::every_optimizer_with_every_storage_is_bit_exact(&d);
    }
}

#[test]
fn clipping_and_non_finite_gradients_are_bit_exact() {
    for d in devices(SMALL) {
        testing::clipping_and_non_finite_gradients_are_bit_exact(&d);
    }
}

#[test]
fn reads_decode_as_the_cpu_does() {
    for d in devices(SMALL) {
        testing::reads_decode_as_the_cpu_does(&d);
    }
}

#[test]
fn checkpoints_move_between_cpu_and_cuda_and_resume_exactly() {
    for d in devices(SMALL) {
        testing::checkpoints_move_between_backends_and_resume_exactly(&d);
    }
}

#[test]
fn tensor_wide_second_moments_are_a_typed_error() {
    for d in devices(SMALL) {
        testing::tensor_wide_second_moments_are_a_typed_error(&d);
    }
}

#[test]
fn subnormal_values_are_bit_exact() {
    for d in devices(SMALL) {
        testing::subnormal_values(&d, true);
    }
}

#[test]
fn many_small_tensors_share_one_launch() {
    for d in devices(CudaOptions::default()) {
        let mut opt = Optimizer::with_backend(d.clone(), OptimizerOptions::default()).unwrap();
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
        let before = d.launches();
        assert_eq!(opt.step().unwrap().updated, 1000);
        // The finiteness check (SkipStep) decodes every accumulator in one launch, the step is one.
        assert_eq!(d.launches() - before, 2, "one decode and one step launch");
    }
}

#[test]
fn a_large_tensor_moves_through_io_in_several_launches() {
    let options = CudaOptions { io_floats: 1 << 18 };
    for d in devices(options) {
        let config = presets::adamw_4bit_bf16_sr_released(1e-3);
        let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
        let mut dev = Optimizer::with_backend(d.clone(), OptimizerOptions::default()).unwrap();
        cpu.add_group(config).unwrap();
        dev.add_group(config).unwrap();
        let n = (1 << 20) + 3 * 4096 + 5;
        let mut rng = Rng(6);
        let init = rng.spread(n, 0.5);
        let a = cpu.add_param("big", &[n], &init, 0).unwrap();
        dev.add_param("big", &[n], &init, 0).unwrap();
        for _ in 0..2 {
            let g = rng.spread(n, 1.0);
            cpu.step_param(a, &g).unwrap();
            let before = d.launches();
            dev.step_param(a, &g).unwrap();
            assert_eq!(
                d.launches() - before,
                5,
                "1M elements through a 256K io buffer"
            );
        }
        assert_same(&cpu, &dev, &[a], "a tensor larger than the io buffer");
    }
}

#[test]
fn without_a_driver_every_entry_point_is_a_typed_error() {
    if Cuda::driver_present() {
        // A driver is here: an ordinal past the last device is the typed error instead.
        let err = Cuda::new(4096).unwrap_err();
        assert!(
            matches!(err, CudaError::NoDevice { ordinal: 4096, .. }),
            "{err}"
        );
    } else {
        let err = Cuda::new(0).unwrap_err();
        assert!(matches!(err, CudaError::NoDriver), "{err}");
        assert!(err.to_string().contains("no CUDA driver"));
        let opt_err: lpmm_optim::OptimError = err.into();
        assert!(opt_err.to_string().contains("cuda"), "{opt_err}");
    }
}
