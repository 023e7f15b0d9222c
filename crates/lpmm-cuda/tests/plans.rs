//! The specialized steps (lpmm-backend's `plans`: one kernel per hot plan) step the CPU's bits:
//! every plan, on the kernels' host emulation (warp shuffles emulated), from each gradient source
//! it is compiled for, on tensors whose items end inside a thread's 16 elements and inside a
//! block, with non-finite, overflowing and subnormal gradients and clipping; and they run (the
//! device counts their launches). Each plan twice: as a GPU runs it, and with every cold path
//! forced (kernels/plan_lanes.cuh `PLAN_FORCE_COLD`: IEEE division and rounding, per-thread
//! random blocks), so that both ways are held to the reference.

use lpmm_backend::DeviceInput;
use lpmm_backend::plans::{GradInput, plans};
use lpmm_cuda::{Cuda, CudaOptions, CudaView};
use lpmm_formats::bf16;
use lpmm_optim::backend::HostValues;
use lpmm_optim::testing::{Rng, assert_same};
use lpmm_optim::{NonFinitePolicy, Optimizer, OptimizerOptions, ParamId};

/// Pieces of 8192 elements, so the larger tensors span several pieces and launches carry
/// several items.
const SMALL: CudaOptions = CudaOptions::new(8192, 8192);

/// Tensors of the quantized size and above: whole tiles, a partial last tile, items ending inside
/// a thread's 16 elements and inside a block, several pieces.
const SHAPES: [&[usize]; 5] = [
    &[4096],
    &[8192 + 1000],
    &[5, 1001],
    &[3 * 8192 + 77],
    &[4099],
];

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
    every_plan(false);
}

#[test]
fn every_plan_steps_the_cpus_bits_on_its_cold_paths() {
    lpmm_cuda::testing::force_cold_paths(true);
    every_plan(true);
    lpmm_cuda::testing::force_cold_paths(false);
}

/// Every plan against the CPU (`cold`: with the cold paths forced, for the messages).
fn every_plan(cold: bool) {
    let d = Cuda::emulated(SMALL).unwrap();
    for (k, plan) in plans().iter().enumerate() {
        for clip in [None, Some(1.0)] {
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
            for step in 0..3 {
                match plan.input {
                    GradInput::None => {
                        for _micro in 0..2 {
                            for &(id, n) in &ids {
                                let g = gradient(&mut rng, n, step, false);
                                cpu.accumulate(id, &g).unwrap();
                                dev.accumulate(id, &g).unwrap();
                            }
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
                            let mut g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
                            let r1 = cpu
                                .step(lpmm_optim::Step::param(
                                    id,
                                    lpmm_optim::Grad::Input(HostValues::Bf16(&g16)),
                                ))
                                .unwrap();
                            let view = CudaView::host(&d, &mut g16).unwrap();
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
                    &format!(
                        "{} (clip {clip:?}{}), step {}",
                        plan.name,
                        if cold { ", cold paths" } else { "" },
                        step + 1
                    ),
                );
            }
            assert!(
                d.plan_launches() > before,
                "{}: its specialized step never ran",
                plan.name
            );
        }
    }
}
