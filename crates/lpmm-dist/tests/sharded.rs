//! Sharded against unsharded, bit for bit, with the ranks as threads of this process (the MPI
//! tests run the same invariants under `mpirun`): every optimizer and format, ZeRO-1 and ZeRO-2,
//! 1 to 4 ranks, clipping and non-finite gradients, canonical checkpoints saved at W ranks and
//! loaded at W', and the memory each rank holds.

#[path = "common/model.rs"]
mod model;

use lpmm_dist::{
    Collective, Reduction, ShardOptions, ShardedOptimizer, Threads, UNIT, Zero, rank_order_sum,
};
use lpmm_optim::{Cpu, Parts, SlotKind};
use lpmm_optim::{NonFinitePolicy, OptimizerOptions, ParamConfig, checkpoint::Canonical, presets};
use model::{configs, grads, init, model, numels, reference, same_canonical, split_grads};

/// Runs `f` on `world` ranks (threads) and returns their results in rank order.
fn ranks<T: Send>(world: usize, f: impl Fn(Threads) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = Threads::group(world)
            .into_iter()
            .map(|c| s.spawn(|| f(c)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `steps` steps on `world` ranks and the same on one unsharded optimizer fed the rank-order
/// sum of the ranks' gradients; compares the gathered parameters after every step and the
/// canonical checkpoints at the end.
fn check(world: usize, zero: Zero, name: &str, config: ParamConfig, options: OptimizerOptions) {
    let steps = 3;
    let shard = ShardOptions::default()
        .with_zero(zero)
        .with_reduction(Reduction::FixedOrder);
    let tmp = lpmm_optim::testing::temp_dir("lpmm-dist-");
    let dir = tmp.path();
    let path = dir.join(format!(
        "{}-{world}-{zero:?}.safetensors",
        name.replace(' ', "_")
    ));
    let (mut refopt, ids) = reference(options, config);
    let mut expected = Vec::new();
    for step in 0..steps {
        let per_rank: Vec<Vec<Vec<f32>>> =
            (0..world).map(|r| grads(world, r, step, false)).collect();
        for (p, &id) in ids.iter().enumerate() {
            let parts: Vec<&[f32]> = per_rank.iter().map(|g| g[p].as_slice()).collect();
            refopt.accumulate(id, &rank_order_sum(&parts)).unwrap();
        }
        let report = refopt.step(lpmm_optim::Accumulated).unwrap();
        let values: Vec<Vec<u32>> = ids
            .iter()
            .zip(numels())
            .map(|(&id, n)| {
                let mut v = vec![0f32; n];
                refopt.read(id, SlotKind::Param, &mut v).unwrap();
                v.iter().map(|x| x.to_bits()).collect()
            })
            .collect();
        expected.push((report, values));
    }
    let got = ranks(world, |comm| {
        let mut opt =
            ShardedOptimizer::new(comm, options, shard, vec![config], model(), &init()).unwrap();
        let mut out = Vec::new();
        for step in 0..steps {
            let g = grads(world, opt.rank(), step, false);
            let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
            let report = opt.step(&refs).unwrap();
            let values: Vec<Vec<u32>> = opt
                .params()
                .iter()
                .map(|v| v.iter().map(|x| x.to_bits()).collect())
                .collect();
            out.push((report.skipped, report.grad_norm.map(f64::to_bits), values));
        }
        opt.save(&path).unwrap();
        out
    });
    for (r, per_step) in got.iter().enumerate() {
        for (step, ((skipped, norm, values), (rep, want))) in
            per_step.iter().zip(&expected).enumerate()
        {
            let what = format!(
                "{name}, {world} ranks, {zero:?}, rank {r}, step {}",
                step + 1
            );
            assert_eq!(*skipped, rep.skipped, "{what}: skipped");
            assert_eq!(
                *norm,
                rep.grad_norm.map(f64::to_bits),
                "{what}: gradient norm"
            );
            for (p, (a, b)) in values.iter().zip(want).enumerate() {
                if let Some(k) = a.iter().zip(b).position(|(x, y)| x != y) {
                    panic!(
                        "{what}: parameter {p} element {k}: {:#x} vs {:#x}",
                        a[k], b[k]
                    );
                }
            }
        }
    }
    let saved = Canonical::read(&path).unwrap();
    same_canonical(
        &saved,
        &Parts::of(&refopt).canonical(None).expect("canonical"),
        &format!("{name}, {world} ranks, {zero:?}: checkpoint"),
    );
}

#[test]
fn sharded_steps_equal_unsharded_for_every_optimizer_and_format() {
    let options = OptimizerOptions::default()
        .with_seed(5)
        .with_max_grad_norm(Some(50.0))
        .with_non_finite(NonFinitePolicy::SkipStep);
    for (name, config) in configs() {
        for world in 1..=4 {
            for zero in [Zero::One, Zero::Two] {
                check(world, zero, name, config, options);
            }
        }
    }
}

#[test]
fn non_finite_gradients_on_one_rank_skip_the_step_everywhere() {
    for policy in [NonFinitePolicy::SkipStep, NonFinitePolicy::SkipElements] {
        let options = OptimizerOptions::default()
            .with_seed(1)
            .with_max_grad_norm(None)
            .with_non_finite(policy);
        let config = presets::adamw_8bit_bf16_sr(1e-3);
        let world = 3;
        let (mut refopt, ids) = reference(options, config.build());
        let bad = |r: usize, p: usize, g: &mut Vec<f32>| {
            if r == 2 && p == 0 {
                g[5 * UNIT] = f32::NAN;
            }
        };
        let per_rank: Vec<Vec<Vec<f32>>> = (0..world)
            .map(|r| {
                let mut g = grads(world, r, 0, false);
                for (p, v) in g.iter_mut().enumerate() {
                    bad(r, p, v);
                }
                g
            })
            .collect();
        for (p, &id) in ids.iter().enumerate() {
            let parts: Vec<&[f32]> = per_rank.iter().map(|g| g[p].as_slice()).collect();
            refopt.accumulate(id, &rank_order_sum(&parts)).unwrap();
        }
        let want = refopt.step(lpmm_optim::Accumulated).unwrap();
        let got = ranks(world, |comm| {
            let shard = ShardOptions::default();
            let mut opt =
                ShardedOptimizer::new(comm, options, shard, vec![config.build()], model(), &init())
                    .unwrap();
            let r = opt.rank();
            let refs: Vec<&[f32]> = per_rank[r].iter().map(|v| v.as_slice()).collect();
            let report = opt.step(&refs).unwrap();
            (report, opt.params().to_vec())
        });
        for (report, params) in got {
            assert_eq!(report.skipped, want.skipped, "{policy:?}");
            for (p, &id) in ids.iter().enumerate() {
                let mut v = vec![0f32; params[p].len()];
                refopt.read(id, SlotKind::Param, &mut v).unwrap();
                assert!(
                    v.iter()
                        .zip(&params[p])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{policy:?}: parameter {p}"
                );
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_world_size() {
    // Exact gradients: the same total on 1..4 ranks, so every world size must store the same bits.
    let config = presets::adamw_8bit_bf16_sr(1e-3);
    let options = OptimizerOptions::default()
        .with_seed(3)
        .with_max_grad_norm(Some(10.0))
        .with_non_finite(NonFinitePolicy::SkipStep);
    let tmp = lpmm_optim::testing::temp_dir("lpmm-dist-w-");
    let dir = tmp.path();
    let mut canon = Vec::new();
    for world in 1..=4 {
        for (zero, reduction) in [
            (Zero::One, Reduction::FixedOrder),
            (Zero::Two, Reduction::FixedOrder),
            (Zero::Two, Reduction::Native),
        ] {
            let path = dir.join(format!("w{world}-{zero:?}-{reduction:?}.safetensors"));
            ranks(world, |comm| {
                let shard = ShardOptions::default()
                    .with_zero(zero)
                    .with_reduction(reduction);
                let mut opt = ShardedOptimizer::new(
                    comm,
                    options,
                    shard,
                    vec![config.build()],
                    model(),
                    &init(),
                )
                .unwrap();
                for step in 0..3 {
                    let g = split_grads(world, opt.rank(), step);
                    let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
                    opt.step(&refs).unwrap();
                }
                opt.save(&path).unwrap();
            });
            canon.push((world, Canonical::read(&path).unwrap()));
        }
    }
    for (world, c) in &canon[1..] {
        same_canonical(c, &canon[0].1, &format!("{world} ranks against 1"));
    }
}

#[test]
fn checkpoints_saved_at_w_ranks_resume_at_w_prime_ranks() {
    let config = presets::adamw_4bit_split(1e-3);
    let options = OptimizerOptions::default()
        .with_seed(9)
        .with_max_grad_norm(Some(5.0))
        .with_non_finite(NonFinitePolicy::SkipStep);
    let tmp = lpmm_optim::testing::temp_dir("lpmm-dist-ck-");
    let dir = tmp.path();
    let shard = ShardOptions::default();
    // The unsharded run: 2 steps, save, 2 more.
    let (mut refopt, ids) = reference(options, config.build());
    let total = |step: usize| grads(1, 0, step, true);
    for step in 0..4 {
        for (&id, g) in ids.iter().zip(total(step)) {
            refopt.accumulate(id, &g).unwrap();
        }
        refopt.step(lpmm_optim::Accumulated).unwrap();
    }
    for (w, w2) in [(2usize, 3usize), (4, 1), (1, 4), (3, 2)] {
        let path = dir.join(format!("{w}-to-{w2}.safetensors"));
        ranks(w, |comm| {
            let mut opt =
                ShardedOptimizer::new(comm, options, shard, vec![config.build()], model(), &init())
                    .unwrap();
            for step in 0..2 {
                let g = split_grads(w, opt.rank(), step);
                let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
                opt.step(&refs).unwrap();
            }
            opt.save(&path).unwrap();
        });
        // The unsharded optimizer reads the same file.
        let plain = Canonical::read(&path)
            .and_then(|c| c.into_optimizer(Cpu))
            .unwrap();
        assert_eq!(plain.status().steps, 2);
        let path2 = dir.join(format!("{w}-to-{w2}-end.safetensors"));
        ranks(w2, |comm| {
            let mut opt = ShardedOptimizer::load(comm, &path, shard).unwrap();
            for step in 2..4 {
                let g = split_grads(w2, opt.rank(), step);
                let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
                opt.step(&refs).unwrap();
            }
            opt.save(&path2).unwrap();
        });
        same_canonical(
            &Canonical::read(&path2).unwrap(),
            &Parts::of(&refopt).canonical(None).expect("canonical"),
            &format!("saved at {w} ranks, resumed at {w2}"),
        );
    }
}

#[test]
fn each_rank_holds_a_world_th_of_the_memory() {
    let config = presets::adamw_8bit_bf16(1e-3);
    let (refopt, _) = reference(OptimizerOptions::default(), config.build());
    let report = refopt.memory_report();
    let total = report.total() as f64;
    // One block of slack per parameter (the padding before it) and one per rank boundary, at the
    // largest footprint per element.
    let per_elem_max = report
        .params
        .iter()
        .map(|p| p.total() as f64 / p.numel as f64)
        .fold(0.0, f64::max);
    let align: usize = report
        .params
        .iter()
        .map(|p| {
            config
                .with_param(p.storage[0])
                .with_grad(p.storage[1])
                .with_state1(p.storage[2])
                .with_state2(p.storage[3])
                .build()
                .shard_alignment()
        })
        .sum();
    let slack = (align + UNIT) as f64 * per_elem_max;
    for world in 1..=4 {
        let held = ranks(world, |comm| {
            let opt = ShardedOptimizer::new(
                comm,
                OptimizerOptions::default(),
                ShardOptions::default(),
                vec![config.build()],
                model(),
                &init(),
            )
            .unwrap();
            opt.memory_report().total()
        });
        let sum: usize = held.iter().sum();
        assert!(
            (sum as f64 - total).abs() <= model().len() as f64 * 64.0,
            "{world} ranks hold {sum} bytes in all, unsharded {total}"
        );
        for (r, &h) in held.iter().enumerate() {
            let share = total / world as f64;
            assert!(
                (h as f64 - share).abs() <= slack,
                "{world} ranks: rank {r} holds {h} bytes, a {world}th is {share}"
            );
        }
        eprintln!("{world} ranks: bytes per rank {held:?} (unsharded {total})");
    }
}

#[test]
fn threads_collectives_match_their_definitions() {
    for world in 1..=4 {
        ranks(world, |c| {
            let r = c.rank() as f32;
            let mut v = vec![r, 2.0 * r, 1.0];
            c.all_reduce_sum_f32(&mut v).unwrap();
            let s: f32 = (0..world).map(|q| q as f32).sum();
            assert_eq!(v, vec![s, 2.0 * s, world as f32]);
            let per = 2;
            let send: Vec<f32> = (0..world * per).map(|i| i as f32 + r).collect();
            let out = lpmm_dist::fixed_reduce_scatter(&c, &send, per).unwrap();
            let me = c.rank();
            let want: Vec<f32> = (0..per)
                .map(|i| (0..world).map(|q| (me * per + i) as f32 + q as f32).sum())
                .collect();
            assert_eq!(out, want);
        });
    }
}

/// Shards on a device backend (`make` gives each rank's backend) against the unsharded CPU run:
/// random words keyed by logical element through the backend's descriptors.
fn check_backend<B: lpmm_optim::backend::Backend>(make: impl Fn() -> B + Sync, label: &str) {
    let options = OptimizerOptions::default()
        .with_seed(11)
        .with_max_grad_norm(Some(50.0))
        .with_non_finite(NonFinitePolicy::SkipStep);
    for (name, config) in configs().into_iter().take(5) {
        let world = 3;
        let (mut refopt, ids) = reference(options, config);
        for step in 0..2 {
            let total = grads(1, 0, step, true);
            for (&id, g) in ids.iter().zip(&total) {
                refopt.accumulate(id, g).unwrap();
            }
            refopt.step(lpmm_optim::Accumulated).unwrap();
        }
        let got = ranks(world, |comm| {
            let mut opt = ShardedOptimizer::with_backend(
                make(),
                comm,
                options,
                ShardOptions::default(),
                vec![config],
                model(),
                &init(),
            )
            .unwrap();
            for step in 0..2 {
                let g = split_grads(world, opt.rank(), step);
                let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
                opt.step(&refs).unwrap();
            }
            opt.params().to_vec()
        });
        for (r, params) in got.iter().enumerate() {
            for (p, &id) in ids.iter().enumerate() {
                let mut v = vec![0f32; params[p].len()];
                refopt.read(id, SlotKind::Param, &mut v).unwrap();
                assert!(
                    v.iter()
                        .zip(&params[p])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{label} {name}: rank {r} parameter {p}"
                );
            }
        }
    }
}

#[test]
fn shards_on_the_cuda_kernels_equal_the_cpu() {
    // The CUDA kernels compiled for the host (lpmm-cuda's `emulate`); a GPU runs the same code.
    let cuda = lpmm_cuda::Cuda::emulated(Default::default()).unwrap();
    check_backend(|| cuda.clone(), "cuda (emulated)");
}

#[test]
fn shards_on_wgpu_equal_the_cpu() {
    match lpmm_wgpu::Wgpu::new(Default::default()) {
        Ok(gpu) => check_backend(|| gpu.clone(), "wgpu"),
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_WGPU=1 but {e}");
            }
            eprintln!("skipping: {e}");
        }
    }
}
