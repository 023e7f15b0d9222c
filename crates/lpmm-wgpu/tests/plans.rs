//! The specialized steps (lpmm-backend's `plans`: on wgpu, `lpmm_step`'s pipeline with a plan's
//! rule and slot formats fixed by override constants) step the CPU's bits: every plan, from each
//! gradient source it is built for, on tensors whose items end inside a thread's 16 elements and
//! inside a block, with non-finite, overflowing and subnormal gradients and clipping; and they
//! run (the device counts their launches).

mod common;

use common::{backend, small};
use lpmm_backend::DeviceInput;
use lpmm_backend::plans::{GradInput, plans};
use lpmm_formats::bf16;
use lpmm_optim::backend::{Dtype, HostValues};
use lpmm_optim::testing::{Rng, assert_same};
use lpmm_optim::{NonFinitePolicy, Optimizer, OptimizerOptions, ParamId};
use lpmm_wgpu::WgpuView;
use wgpu::util::DeviceExt;

/// Tensors of the quantized size and above: whole tiles, a partial last tile, items ending inside
/// a thread's 16 elements and inside a block, several pieces.
const SHAPES: [&[usize]; 4] = [&[4096], &[8192 + 1000], &[5, 1001], &[4099]];

/// A gradient of `n` values with, past the first step, a value whose square overflows the
/// states, subnormals and, where it is not accumulated (`released`), a NaN and an infinity.
fn gradient(rng: &mut Rng, n: usize, step: usize, released: bool) -> Vec<f32> {
    let mut g = rng.spread(n, 1.0);
    if step > 0 {
        if released {
            g[n / 3] = f32::NAN;
            g[n / 2] = f32::INFINITY;
        }
        g[n - 1] = if released { 3.0e38 } else { 1.0e30 };
        g[7] = 1.0e-40;
        g[n / 5] = -f32::MIN_POSITIVE / 4.0;
    }
    g
}

#[test]
fn every_plan_steps_the_cpus_bits() {
    let Some(d) = backend(small()) else { return };
    for (k, plan) in plans().iter().enumerate() {
        let clip = if k % 2 == 0 { None } else { Some(1.0) };
        let options = OptimizerOptions::default()
            .with_seed(3 + k as u64)
            .with_max_grad_norm(clip)
            .with_non_finite(NonFinitePolicy::SkipElements);
        let mut cpu = Optimizer::new(options).unwrap();
        let mut dev = Optimizer::with_backend(d.clone(), options).unwrap();
        cpu.add_group(plan.config).unwrap();
        dev.add_group(plan.config).unwrap();
        let mut rng = Rng::new(17 + k as u64);
        let mut ids: Vec<(ParamId, usize)> = Vec::new();
        for (i, shape) in SHAPES.iter().enumerate() {
            let n: usize = shape.iter().product();
            let init = rng.spread(n, 0.5);
            let a = cpu.add_param(&format!("p{i}"), shape, &init, 0).unwrap();
            let b = dev.add_param(&format!("p{i}"), shape, &init, 0).unwrap();
            assert_eq!(a, b);
            ids.push((a, n));
        }
        let only: Vec<ParamId> = ids.iter().map(|&(id, _)| id).collect();
        let before = d.plan_launches();
        for step in 0..2 {
            match plan.input {
                GradInput::None => {
                    for &(id, n) in &ids {
                        let g = gradient(&mut rng, n, step, false);
                        cpu.accumulate(id, &g).unwrap();
                        dev.accumulate(id, &g).unwrap();
                    }
                    let r1 = cpu.step(lpmm_optim::Accumulated).unwrap();
                    let r2 = dev.step(lpmm_optim::Accumulated).unwrap();
                    assert_eq!(r1, r2, "{}: step reports", plan.name);
                }
                GradInput::F32 => {
                    for &(id, n) in &ids {
                        let g = gradient(&mut rng, n, step, true);
                        let r1 = cpu.step(lpmm_optim::Step::param(id, &g)).unwrap();
                        let r2 = dev.step(lpmm_optim::Step::param(id, &g)).unwrap();
                        assert_eq!(r1, r2, "{}: step reports", plan.name);
                    }
                }
                GradInput::Bf16 => {
                    for &(id, n) in &ids {
                        let g = gradient(&mut rng, n, step, true);
                        let g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
                        let r1 = cpu
                            .step(lpmm_optim::Step::param(
                                id,
                                lpmm_optim::Grad::Input(HostValues::Bf16(&g16)),
                            ))
                            .unwrap();
                        let mut bytes: Vec<u8> = bytemuck::cast_slice(&g16).to_vec();
                        bytes.resize(bytes.len().div_ceil(4) * 4, 0);
                        let buffer =
                            d.device()
                                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                                    label: Some("caller's bf16 gradient"),
                                    contents: &bytes,
                                    usage: wgpu::BufferUsages::STORAGE
                                        | wgpu::BufferUsages::COPY_SRC
                                        | wgpu::BufferUsages::COPY_DST,
                                });
                        let view = WgpuView {
                            buffer: &buffer,
                            offset: 0,
                            len: n,
                            dtype: Dtype::Bf16,
                        };
                        let r2 = dev
                            .step(lpmm_optim::Step::param(
                                id,
                                lpmm_optim::Grad::Input(DeviceInput::Device(view)),
                            ))
                            .unwrap();
                        assert_eq!(r1, r2, "{}: step reports", plan.name);
                    }
                }
            }
            assert_same(
                &cpu,
                &dev,
                &only,
                &format!("{} (clip {clip:?}), step {}", plan.name, step + 1),
            );
        }
        assert!(
            d.plan_launches() > before,
            "{}: its specialized step never ran",
            plan.name
        );
    }
}
