//! A framework's wgpu buffers take part directly: a parameter lent in the caller's buffer is
//! stepped in place (no copy of it is allocated), gradients are accumulated from the caller's
//! buffers, and a step reads nothing back to the host but its 4-byte non-finite flags.

mod common;

use common::{backend, small};
use lpmm_backend::{DeviceInput, DeviceOutput};
use lpmm_optim::Parts;
use lpmm_optim::backend::Dtype;
use lpmm_optim::testing::Rng;
use lpmm_optim::{NonFinitePolicy, Optimizer, OptimizerOptions, SlotKind, presets};
use lpmm_wgpu::{Wgpu, WgpuView};
use wgpu::util::DeviceExt;

fn buffer(gpu: &Wgpu, bytes: &[u8]) -> wgpu::Buffer {
    let mut padded = bytes.to_vec();
    padded.resize(bytes.len().div_ceil(4) * 4, 0);
    gpu.device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("caller's tensor"),
            contents: &padded,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        })
}

#[test]
fn a_lent_parameter_is_stepped_in_place_in_the_callers_buffer() {
    let Some(gpu) = backend(small()) else { return };
    let n = 20_000;
    let mut rng = Rng::new(12);
    let init: Vec<lpmm_formats::bf16> = rng
        .spread(n, 0.5)
        .into_iter()
        .map(lpmm_formats::bf16::from_f32)
        .collect();
    let options = OptimizerOptions::default()
        .with_seed(4)
        .with_max_grad_norm(None)
        .with_non_finite(NonFinitePolicy::SkipElements);
    let config = presets::adamw_8bit_bf16_sr(1e-3);
    // The reference: the CPU holding the parameter itself.
    let mut cpu = Optimizer::new(options).unwrap();
    cpu.add_group(config).unwrap();
    let start: Vec<f32> = init.iter().map(|x| x.to_f32()).collect();
    let a = cpu.add_param("w", &[n], &start, 0).unwrap();

    // The same parameter on wgpu, held once for comparison and lent once.
    let mut held = Optimizer::with_backend(gpu.clone(), options).unwrap();
    held.add_group(config).unwrap();
    let before = gpu.reserved_words();
    held.add_param("w", &[n], &start, 0).unwrap();
    let held_words = gpu.reserved_words() - before;

    let param = buffer(&gpu, bytemuck::cast_slice(&init));
    let view = WgpuView {
        buffer: &param,
        offset: 0,
        len: n,
        dtype: Dtype::Bf16,
    };
    let mut dev = Optimizer::with_backend(gpu.clone(), options).unwrap();
    dev.add_group(config).unwrap();
    let before = gpu.reserved_words();
    let b = dev
        .add_lent_param("w", &[n], DeviceInput::Device(view), 0, config)
        .unwrap();
    let lent_words = gpu.reserved_words() - before;
    // No copy: exactly the parameter's bf16 words fewer than when lpmm holds it.
    let piece = small().piece_elements;
    let param_words: usize = (0..n)
        .step_by(piece)
        .map(|s| piece.min(n - s).div_ceil(2))
        .sum();
    assert_eq!(held_words - lent_words, param_words as u64);
    assert_eq!(4 * lent_words as usize, dev.memory_report().total());

    for step in 0..3 {
        let g = rng.spread(n, 1.0);
        cpu.accumulate(a, &g).unwrap();
        // The gradient arrives in the caller's f32 buffer.
        let grad = buffer(&gpu, bytemuck::cast_slice(&g));
        let grad_view = WgpuView {
            buffer: &grad,
            offset: 0,
            len: n,
            dtype: Dtype::F32,
        };
        dev.accumulate(b, lpmm_optim::Grad::Input(DeviceInput::Device(grad_view)))
            .unwrap();
        let reads = gpu.host_reads();
        let r2 = dev
            .step(
                lpmm_optim::Step::accumulated().lent(lpmm_optim::Lent::Buffers(&mut [(
                    b,
                    DeviceOutput::Device(view),
                )])),
            )
            .unwrap();
        // Only the flags come back.
        assert_eq!(gpu.host_reads() - reads, 1, "step {step}: host reads");
        assert_eq!(
            cpu.step(lpmm_optim::Accumulated).unwrap(),
            r2,
            "step {step}"
        );
    }
    // The caller's buffer holds the parameter's bits; the other slots are the CPU's.
    let want = Parts::of(&cpu)
        .export_slot(a, SlotKind::Param, None)
        .unwrap();
    let got = Parts::of(&dev)
        .export_slot(b, SlotKind::Param, Some(DeviceInput::Device(view)))
        .unwrap();
    assert_eq!(want, got);
    for slot in [SlotKind::Grad, SlotKind::State1, SlotKind::State2] {
        assert_eq!(
            Parts::of(&cpu).export_slot(a, slot, None).unwrap(),
            Parts::of(&dev).export_slot(b, slot, None).unwrap()
        );
    }
    // A step without the buffer is a typed error.
    dev.accumulate(b, &rng.spread(n, 1.0)).unwrap();
    assert!(matches!(
        dev.step(lpmm_optim::Accumulated),
        Err(lpmm_optim::OptimError::Lent { .. })
    ));
}
