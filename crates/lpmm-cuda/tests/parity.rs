//! The CUDA backend against the CPU reference, bit for bit (lpmm-optim's conformance suite),
//! on every device this machine has: always the kernels compiled for the host (the `emulate`
//! feature: the same kernel program and the same driving code), and a real GPU when a CUDA
//! driver and device are present (otherwise a message says the GPU half was skipped; with
//! `LPMM_REQUIRE_CUDA=1` a missing GPU fails instead).

use lpmm_backend::{DeviceInput, DeviceOutput};
use lpmm_cuda::{Cuda, CudaError, CudaOptions, CudaView};
use lpmm_formats::bf16;
use lpmm_optim::backend::{HostValues, HostValuesMut};
use lpmm_optim::testing::{self, Rng, assert_same};
use lpmm_optim::{Optimizer, OptimizerOptions, ParamId, SlotKind, Storage, presets};
use lpmm_optim::{Out, Parts};

/// Small pieces and io buffer, so that the larger test tensors span several pieces and their
/// values move in several launches (results must not depend on it).
const SMALL: CudaOptions = CudaOptions::new(8192, 8192);

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

lpmm_optim::conformance_tests!(devices(SMALL));

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
        let mut rng = Rng::new(8);
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
        assert_eq!(opt.step(lpmm_optim::Accumulated).unwrap().updated, 1000);
        // The finiteness check (SkipStep) decodes every accumulator in one launch, the step is one.
        assert_eq!(d.launches() - before, 2, "one decode and one step launch");
    }
}

#[test]
fn a_large_tensor_moves_through_io_in_several_launches() {
    let options = CudaOptions::new(1 << 18, 1 << 18);
    for d in devices(options) {
        let config = presets::adamw_4bit_bf16_sr_released(1e-3);
        let mut cpu = Optimizer::new(OptimizerOptions::default()).unwrap();
        let mut dev = Optimizer::with_backend(d.clone(), OptimizerOptions::default()).unwrap();
        cpu.add_group(config).unwrap();
        dev.add_group(config).unwrap();
        let n = (1 << 20) + 3 * 4096 + 5;
        let mut rng = Rng::new(6);
        let init = rng.spread(n, 0.5);
        let a = cpu.add_param("big", &[n], &init, 0).unwrap();
        dev.add_param("big", &[n], &init, 0).unwrap();
        for _ in 0..2 {
            let g = rng.spread(n, 1.0);
            cpu.step(lpmm_optim::Step::param(a, &g)).unwrap();
            let before = d.launches();
            dev.step(lpmm_optim::Step::param(a, &g)).unwrap();
            assert_eq!(
                d.launches() - before,
                5,
                "five pieces of a 1M-element gradient through a 256K io buffer"
            );
        }
        assert_same(&cpu, &dev, &[a], "a tensor larger than the io buffer");
    }
}

/// The caller's buffer of a lent parameter: f32 or bf16.
fn lent<'a>(d: &Cuda, f32_param: bool, b32: &'a mut [f32], b16: &'a mut [bf16]) -> CudaView<'a> {
    if f32_param {
        CudaView::host(d, b32).unwrap()
    } else {
        CudaView::host(d, b16).unwrap()
    }
}

/// A parameter lent by the caller (here host memory of the emulated device, as a framework's
/// device tensor would be on a GPU) is stepped in place, bit for bit as the CPU steps the same
/// parameter held by lpmm, with no memory reserved for it; gradients come from the caller's
/// buffers too (f32, and bf16 at an odd element offset), and decoded values go to one.
#[test]
fn a_lent_parameter_is_stepped_in_place() {
    let d = Cuda::emulated(SMALL).unwrap();
    let options = OptimizerOptions::default()
        .with_seed(5)
        .with_max_grad_norm(Some(1.0));
    let n = 3 * 8192 + 1000;
    let shape = [n / 8, 8];
    let mut rng = Rng::new(11);
    let init = rng.spread(n, 0.5);
    for (name, config) in [
        ("f32 sgdm", presets::sgdm_f32(0.1, 0.9).build()),
        (
            "8-bit adamw, bf16 sr",
            presets::adamw_8bit_bf16_sr(1e-3).build(),
        ),
        (
            "4-bit adamw, split f32",
            presets::adamw_4bit_split(1e-3).build(),
        ),
    ] {
        let f32_param = config.param == Storage::F32;
        let mut buf32 = init.clone();
        let mut buf16: Vec<bf16> = init.iter().map(|&x| bf16::from_f32(x)).collect();
        let start: Vec<f32> = if f32_param {
            init.clone()
        } else {
            buf16.iter().map(|x| x.to_f32()).collect()
        };
        let mut cpu = Optimizer::new(options).unwrap();
        cpu.add_group(config).unwrap();
        let a = cpu.add_param("w", &shape, &start, 0).unwrap();
        let mut dev = Optimizer::with_backend(d.clone(), options).unwrap();
        dev.add_group(config).unwrap();

        let before = d.reserved_words();
        let input = DeviceInput::Device(lent(&d, f32_param, &mut buf32, &mut buf16));
        let b = dev.add_lent_param("w", &shape, input, 0, config).unwrap();
        let reserved = d.reserved_words() - before;
        let bytes = dev.memory_report().params[0].bytes;
        assert_eq!(4 * reserved as usize, bytes.iter().sum::<usize>(), "{name}");
        let primary = Parts::of(&cpu)
            .export_slot(a, SlotKind::Param, None)
            .unwrap()
            .regions[0]
            .bytes
            .len();
        assert_eq!(
            bytes[0] + primary,
            cpu.memory_report().params[0].bytes[0],
            "{name}: no memory for the lent region"
        );

        for k in 0..3 {
            let mut g = rng.spread(n + 1, 0.1);
            if k == 1 {
                // A bf16 gradient starting at an odd element of the caller's buffer.
                let mut g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
                cpu.accumulate(a, lpmm_optim::Grad::Input(HostValues::Bf16(&g16[1..])))
                    .unwrap();
                let gv = CudaView::host(&d, &mut g16[1..]).unwrap();
                dev.accumulate(b, lpmm_optim::Grad::Input(DeviceInput::Device(gv)))
                    .unwrap();
            } else {
                cpu.accumulate(a, &g[..n]).unwrap();
                let gv = CudaView::host(&d, &mut g[..n]).unwrap();
                dev.accumulate(b, lpmm_optim::Grad::Input(DeviceInput::Device(gv)))
                    .unwrap();
            }
            let r1 = cpu.step(lpmm_optim::Accumulated).unwrap();
            let out = DeviceOutput::Device(lent(&d, f32_param, &mut buf32, &mut buf16));
            let r2 = dev
                .step(
                    lpmm_optim::Step::accumulated()
                        .lent(lpmm_optim::Lent::Buffers(&mut [(b, out)])),
                )
                .unwrap();
            assert_eq!(r1, r2, "{name}: step {k}");
        }
        assert_eq!(
            d.reserved_words() - before,
            reserved,
            "{name}: the steps reserved memory"
        );
        // The caller's buffer holds the parameter's bits, and every other slot is the same.
        let want = Parts::of(&cpu)
            .export_slot(a, SlotKind::Param, None)
            .unwrap();
        let have = if f32_param {
            HostValues::F32(&buf32)
        } else {
            HostValues::Bf16(&buf16)
        };
        assert_eq!(want.regions[0].bytes, have.bytes(), "{name}: parameter");
        let input = DeviceInput::Device(lent(&d, f32_param, &mut buf32, &mut buf16));
        let got = Parts::of(&dev)
            .export_slot(b, SlotKind::Param, Some(input))
            .unwrap();
        assert_eq!(want, got, "{name}: parameter slot");
        for slot in [SlotKind::Grad, SlotKind::State1, SlotKind::State2] {
            let (x, y) = (
                Parts::of(&cpu).export_slot(a, slot, None).unwrap(),
                Parts::of(&dev).export_slot(b, slot, None).unwrap(),
            );
            assert_eq!(x, y, "{name}: {}", slot.name());
            // Decoded into a caller's bf16 buffer, as the CPU rounds it.
            let mut want16 = vec![bf16::ZERO; n];
            cpu.read(a, slot, Out::Backend(HostValuesMut::Bf16(&mut want16)))
                .unwrap();
            let mut have16 = vec![bf16::ZERO; n + 1];
            let out = CudaView::host(&d, &mut have16[1..]).unwrap();
            dev.read(b, slot, Out::Backend(DeviceOutput::Device(out)))
                .unwrap();
            assert_eq!(want16[..], have16[1..], "{name}: {} decoded", slot.name());
        }
        // Without its buffer the step is a typed error, not a panic.
        dev.accumulate(b, &init).unwrap();
        assert!(matches!(
            dev.step(lpmm_optim::Accumulated),
            Err(lpmm_optim::OptimError::Lent { .. })
        ));
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

#[test]
fn a_lent_buffer_the_kernels_cannot_address_in_words_is_a_typed_error() {
    let d = Cuda::emulated(SMALL).unwrap();
    let config = presets::adamw_8bit_bf16(1e-3);
    let mut opt = Optimizer::with_backend(d.clone(), OptimizerOptions::default()).unwrap();
    opt.add_group(config).unwrap();
    // A bf16 tensor from its second element: 2-byte aligned, which the kernels' word accesses
    // to a parameter's storage cannot take.
    let mut values = vec![bf16::from_f32(0.5); 4097];
    let view = CudaView::host(&d, &mut values[1..]).unwrap();
    let id = opt
        .add_lent_param("w", &[4096], DeviceInput::Device(view), 0, config)
        .unwrap();
    opt.accumulate(id, &[1e-3; 4096]).unwrap();
    let err = opt
        .step(
            lpmm_optim::Step::accumulated().lent(lpmm_optim::Lent::Buffers(&mut [(
                id,
                DeviceOutput::Device(view),
            )])),
        )
        .unwrap_err();
    assert!(err.to_string().contains("multiple of 4 bytes"), "{err}");
    // Without a GPU, a host view is all the emulated device takes, and a GPU takes none.
    let mut host = vec![0f32; 4];
    assert!(CudaView::host(&d, &mut host).is_ok());
}
