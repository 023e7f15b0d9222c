//! Run by `tests/mpi.rs` under `mpirun -np W`: the sharded optimizer over MPI against the
//! unsharded optimizer that every rank computes locally (every rank can compute every rank's
//! gradients), bit for bit. Panics (exit status non-zero) on the first difference.
//!
//! Modes: `check DIR` (every optimizer and format, ZeRO-1 and ZeRO-2, fixed-order reduction with
//! random gradients, native MPI reductions with exactly summable gradients, canonical checkpoints,
//! the memory each rank holds), `save PATH` (two steps, checkpoint), `resume PATH OUT` (load at
//! this world size, two more steps, compare with four unsharded steps).

#[path = "../common/model.rs"]
mod model;

use lpmm_dist::{Collective, Mpi, Reduction, ShardOptions, ShardedOptimizer, Zero, rank_order_sum};
use lpmm_optim::{NonFinitePolicy, OptimizerOptions, ParamConfig, checkpoint::Canonical, presets};
use lpmm_optim::{Parts, SlotKind};
use model::{configs, grads, init, model, numels, reference, same_canonical, split_grads};

fn options() -> OptimizerOptions {
    OptimizerOptions::default()
        .with_seed(5)
        .with_max_grad_norm(Some(50.0))
        .with_non_finite(NonFinitePolicy::SkipStep)
}

/// Steps `mpi`'s ranks and a local unsharded optimizer through 3 steps; `exact` picks exactly
/// summable gradients (any summation order gives the same totals).
fn check(mpi: &Mpi, name: &str, config: ParamConfig, shard: ShardOptions, exact: bool, dir: &str) {
    let (world, rank) = (mpi.world(), mpi.rank());
    let grad = |r: usize, step: usize| {
        if exact {
            split_grads(world, r, step)
        } else {
            grads(world, r, step, false)
        }
    };
    let (mut refopt, ids) = reference(options(), config);
    let mut opt = ShardedOptimizer::new(mpi, options(), shard, vec![config], model(), &init())
        .expect("sharded optimizer");
    for step in 0..3 {
        let all: Vec<Vec<Vec<f32>>> = (0..world).map(|r| grad(r, step)).collect();
        for (p, &id) in ids.iter().enumerate() {
            let parts: Vec<&[f32]> = all.iter().map(|g| g[p].as_slice()).collect();
            refopt
                .accumulate(id, &rank_order_sum(&parts))
                .expect("accumulate");
        }
        let want = refopt.step(lpmm_optim::Accumulated).expect("step");
        let mine: Vec<&[f32]> = all[rank].iter().map(|v| v.as_slice()).collect();
        let got = opt.step(&mine).expect("sharded step");
        let what = format!("{name} {shard:?} rank {rank}/{world} step {}", step + 1);
        assert_eq!(got.skipped, want.skipped, "{what}: skipped");
        assert_eq!(
            got.grad_norm.map(f64::to_bits),
            want.grad_norm.map(f64::to_bits),
            "{what}: norm"
        );
        for (p, (&id, n)) in ids.iter().zip(numels()).enumerate() {
            let mut v = vec![0f32; n];
            refopt.read(id, SlotKind::Param, &mut v).expect("read");
            if let Some(k) = v
                .iter()
                .zip(&opt.params()[p])
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{what}: parameter {p} element {k}: {} vs {}",
                    opt.params()[p][k],
                    v[k]
                );
            }
        }
    }
    let path = format!(
        "{dir}/{}-{world}-{:?}-{:?}.safetensors",
        name.replace(' ', "_"),
        shard.zero,
        shard.reduction
    );
    opt.save(&path).expect("save");
    same_canonical(
        &Canonical::read(&path).expect("read"),
        &Parts::of(&refopt).canonical(None).expect("canonical"),
        &format!("{name} {shard:?} at {world} ranks"),
    );
}

fn main() {
    let (mpi, _universe) = Mpi::init().expect("MPI");
    let (world, rank) = (mpi.world(), mpi.rank());
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shard = ShardOptions::default();
    match args.first().map(String::as_str) {
        Some("check") => {
            let dir = &args[1];
            for (name, config) in configs() {
                for zero in [Zero::One, Zero::Two] {
                    check(
                        &mpi,
                        name,
                        config,
                        ShardOptions::default()
                            .with_zero(zero)
                            .with_reduction(Reduction::FixedOrder),
                        false,
                        dir,
                    );
                    check(
                        &mpi,
                        name,
                        config,
                        ShardOptions::default()
                            .with_zero(zero)
                            .with_reduction(Reduction::Native),
                        true,
                        dir,
                    );
                }
                println!(
                    "rank {rank}/{world}: {name}: bit-identical (ZeRO-1, ZeRO-2; fixed-order and native)"
                );
            }
            // Memory each rank holds, 8-bit AdamW.
            let config = presets::adamw_8bit_bf16(1e-3);
            let (refopt, _) = reference(options(), config.build());
            let opt = ShardedOptimizer::new(
                &mpi,
                options(),
                shard,
                vec![config.build()],
                model(),
                &init(),
            )
            .expect("sharded optimizer");
            println!(
                "rank {rank}/{world}: memory {} bytes of {} unsharded",
                opt.memory_report().total(),
                refopt.memory_report().total()
            );
        }
        Some("save") => {
            let mut opt = ShardedOptimizer::new(
                &mpi,
                options(),
                shard,
                vec![presets::adamw_4bit_split(1e-3).build()],
                model(),
                &init(),
            )
            .expect("sharded optimizer");
            for step in 0..2 {
                let g = split_grads(world, rank, step);
                let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
                opt.step(&refs).expect("step");
            }
            opt.save(&args[1]).expect("save");
            println!("rank {rank}/{world}: saved");
        }
        Some("resume") => {
            let mut opt = ShardedOptimizer::load(&mpi, &args[1], shard).expect("load");
            for step in 2..4 {
                let g = split_grads(world, rank, step);
                let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
                opt.step(&refs).expect("step");
            }
            opt.save(&args[2]).expect("save");
            let (mut refopt, ids) = reference(options(), presets::adamw_4bit_split(1e-3).build());
            for step in 0..4 {
                for (&id, g) in ids.iter().zip(grads(1, 0, step, true)) {
                    refopt.accumulate(id, &g).expect("accumulate");
                }
                refopt.step(lpmm_optim::Accumulated).expect("step");
            }
            same_canonical(
                &Canonical::read(&args[2]).expect("read"),
                &Parts::of(&refopt).canonical(None).expect("canonical"),
                "resumed",
            );
            println!("rank {rank}/{world}: resumed bit-identically");
        }
        _ => panic!("usage: check DIR | save PATH | resume PATH OUT"),
    }
}
