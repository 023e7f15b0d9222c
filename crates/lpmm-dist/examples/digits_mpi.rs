//! Data-parallel training of the digits classifier (64 -> 128 -> 10, candle for the forward and
//! backward passes) over MPI, with 8-bit AdamW state sharded across the ranks (ZeRO-2).
//!
//! ```text
//! cargo build --release -p lpmm-dist --features mpi --example digits_mpi
//! mpirun -np 2 target/release/examples/digits_mpi [--steps 300] [--zero 1|2]
//! ```
//!
//! (As root, Open MPI also wants `--allow-run-as-root`; on a machine with fewer cores than
//! ranks, `--oversubscribe`.) Each rank takes its share of every batch of 64, computes the
//! gradient of its share of the mean loss, and calls `ShardedOptimizer::step`: the gradients are
//! summed over ranks, each rank steps the shards it holds, and the parameters come back gathered.
//! Rank 0 prints the loss every 50 steps and the validation accuracy; every rank prints the model
//! memory it holds.

use candle_core::{D, DType, Device, Tensor};
use candle_nn::{Module, VarMap};
use lpmm_candle_examples::experiments::{Mlp, Rng, digits, schedule, seeded_var_builder};
use lpmm_dist::{Collective, Mpi, ParamDef, Reduction, ShardOptions, ShardedOptimizer, Zero};
use lpmm_optim::{NonFinitePolicy, OptimizerOptions, presets};

/// The digits MLP trained data-parallel with sharded 8-bit AdamW state.
#[derive(Debug, clap::Parser)]
struct Args {
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// ZeRO stage: 1 (all-reduce gradients) or 2 (reduce-scatter).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    zero: u8,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mpi, _universe) = Mpi::init()?;
    let (rank, world) = (mpi.rank(), mpi.world());
    let args = <Args as clap::Parser>::parse();
    let steps = args.steps;
    let zero = if args.zero == 1 { Zero::One } else { Zero::Two };
    let data = digits()?;
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    // The same initial model on every rank (a seeded initialiser).
    let model = Mlp::new(seeded_var_builder(&varmap, 7, &dev))?;
    let mut named: Vec<(String, candle_core::Var)> = varmap
        .data()
        .lock()
        .map_err(|_| "var map lock")?
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let defs: Vec<ParamDef> = named
        .iter()
        .map(|(name, v)| ParamDef::new(name, v.dims(), 0))
        .collect();
    let init: Vec<Vec<f32>> = named
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all()?.to_vec1::<f32>())
        .collect::<Result<_, _>>()?;
    let lr = 2e-3;
    let options = OptimizerOptions::default()
        .with_seed(1)
        .with_max_grad_norm(Some(1.0))
        .with_non_finite(NonFinitePolicy::SkipStep);
    let shard = ShardOptions::default()
        .with_zero(zero)
        .with_reduction(Reduction::FixedOrder);
    let mut opt = ShardedOptimizer::new(
        &mpi,
        options,
        shard,
        vec![presets::adamw_8bit_bf16(lr).build()],
        defs,
        &init,
    )?;
    let set_vars = |opt: &ShardedOptimizer<&Mpi>| -> candle_core::Result<()> {
        for ((_, var), values) in named.iter().zip(opt.params()) {
            var.set(&Tensor::from_vec(values.clone(), var.shape(), &dev)?)?;
        }
        Ok(())
    };
    set_vars(&opt)?;
    let n = data.train_y.len();
    let batch = 64;
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = Rng::new(1234); // the same data order on every rank
    let mut at = n;
    let start = std::time::Instant::now();
    for step in 0..steps {
        opt.set_lr(schedule(lr, step, steps))?;
        let mut global = Vec::with_capacity(batch);
        while global.len() < batch {
            if at == n {
                for i in (1..n).rev() {
                    order.swap(i, rng.below(i + 1));
                }
                at = 0;
            }
            global.push(order[at]);
            at += 1;
        }
        // This rank's share: every world-th sample.
        let mine: Vec<usize> = global.iter().skip(rank).step_by(world).copied().collect();
        let xs: Vec<f32> = mine
            .iter()
            .flat_map(|&i| data.train_x[64 * i..64 * i + 64].iter().copied())
            .collect();
        let ys: Vec<u32> = mine.iter().map(|&i| data.train_y[i]).collect();
        let x = Tensor::from_vec(xs, (mine.len(), 64), &dev)?;
        let y = Tensor::from_vec(ys, mine.len(), &dev)?;
        // This rank's share of the batch's mean loss: the shares' gradients sum to the mean's.
        let weight = mine.len() as f64 / batch as f64;
        let loss = (candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)? * weight)?;
        let grads = loss.backward()?;
        let g: Vec<Vec<f32>> = named
            .iter()
            .map(|(_, v)| match grads.get(v) {
                Some(t) => t.flatten_all()?.to_vec1::<f32>(),
                None => Ok(vec![0f32; v.elem_count()]),
            })
            .collect::<Result<_, _>>()?;
        let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
        opt.step(&refs)?;
        set_vars(&opt)?;
        let mut total = [f64::from(loss.to_scalar::<f32>()?) as f32];
        mpi.all_reduce_sum_f32(&mut total)?;
        if rank == 0 && (step + 1) % 50 == 0 {
            println!("step {:4}: loss {:.4}", step + 1, total[0]);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let memory = opt.memory_report();
    println!(
        "rank {rank}/{world}: holds {} bytes of model memory ({} elements) for {} parameters",
        memory.total(),
        memory.numel(),
        opt.params().iter().map(Vec::len).sum::<usize>()
    );
    if rank == 0 {
        let x = Tensor::from_vec(data.val_x.clone(), (data.val_y.len(), 64), &dev)?;
        let y = Tensor::from_vec(data.val_y.clone(), data.val_y.len(), &dev)?;
        let logits = model.forward(&x)?;
        let correct = logits
            .argmax(D::Minus1)?
            .eq(&y)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        println!(
            "{world} ranks, ZeRO-{}: {steps} steps in {secs:.1} s, validation accuracy {:.3}",
            if zero == Zero::One { 1 } else { 2 },
            f64::from(correct) / data.val_y.len() as f64
        );
    }
    Ok(())
}
