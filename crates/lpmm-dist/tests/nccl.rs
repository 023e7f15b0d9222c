//! lpmm-dist over NCCL (feature `nccl`) on GPU 0: a world of one rank, the size one GPU allows
//! (NCCL refuses two ranks on one device). Its collectives must be identities, and the sharded
//! optimizer on them must step bit for bit like the unsharded one, checkpoint included. Runs
//! where NCCL and a CUDA device are present and says so plainly elsewhere; `LPMM_REQUIRE_NCCL=1`
//! makes their absence a failure.

#![cfg(feature = "nccl")]

#[path = "common/model.rs"]
mod model;

use lpmm_dist::{Collective, Nccl, NcclId, Reduction, ShardOptions, ShardedOptimizer, Zero};
use lpmm_optim::{NonFinitePolicy, OptimizerOptions, checkpoint::Canonical};
use lpmm_optim::{Parts, SlotKind};
use model::{configs, grads, init, model, numels, reference, same_canonical};

/// Rank 0 of a new world of one on GPU 0, or `None` with a message when NCCL, the driver or a
/// device is missing.
fn world_of_one() -> Option<Nccl> {
    let made = NcclId::new().and_then(|id| Nccl::new(0, 0, 1, &id));
    match made {
        Ok(c) => Some(c),
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_NCCL").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_NCCL=1 but {e}");
            }
            eprintln!("skipping the NCCL test: {e}");
            None
        }
    }
}

#[test]
fn collectives_of_one_rank_are_identities() {
    let Some(c) = world_of_one() else {
        return;
    };
    assert_eq!((c.rank(), c.world()), (0, 1));
    let values = vec![1.5f32, -0.0, f32::MIN_POSITIVE / 4.0, 3e38];
    let mut v = values.clone();
    c.all_reduce_sum_f32(&mut v).unwrap();
    assert_eq!(bits(&v), bits(&values));
    let mut i = vec![i64::MAX, -1, 0];
    c.all_reduce_sum_i64(&mut i).unwrap();
    assert_eq!(i, vec![i64::MAX, -1, 0]);
    let mut out = vec![0f32; 4];
    c.reduce_scatter_sum_f32(&values, &mut out, &[4]).unwrap();
    assert_eq!(bits(&out), bits(&values));
    c.all_gather_f32(&values, &mut out, &[4]).unwrap();
    assert_eq!(bits(&out), bits(&values));
    let bytes = [7u8, 0, 255];
    let mut got = [0u8; 3];
    c.all_gather_u8(&bytes, &mut got, &[3]).unwrap();
    assert_eq!(got, bytes);
    c.all_to_all_f32(&values, &mut out, &[vec![4]]).unwrap();
    assert_eq!(bits(&out), bits(&values));
    // Buffers that do not match the counts are a typed error, not an NCCL call.
    assert!(c.all_gather_f32(&values, &mut out, &[3]).is_err());
}

#[test]
fn a_sharded_optimizer_on_nccl_steps_like_the_unsharded_one() {
    let options = OptimizerOptions::default()
        .with_seed(5)
        .with_max_grad_norm(Some(50.0))
        .with_non_finite(NonFinitePolicy::SkipStep);
    let tmp = lpmm_optim::testing::temp_dir("lpmm-dist-nccl-");
    for (name, config) in configs() {
        for zero in [Zero::One, Zero::Two] {
            let Some(comm) = world_of_one() else {
                return;
            };
            let shard = ShardOptions::default()
                .with_zero(zero)
                .with_reduction(Reduction::FixedOrder);
            let (mut want, ids) = reference(options, config);
            let mut opt =
                ShardedOptimizer::new(comm, options, shard, vec![config], model(), &init())
                    .unwrap();
            for step in 0..3 {
                let g = grads(1, 0, step, false);
                for (&id, v) in ids.iter().zip(&g) {
                    want.accumulate(id, v).unwrap();
                }
                let expected = want.step(lpmm_optim::Accumulated).unwrap();
                let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
                let report = opt.step(&refs).unwrap();
                let what = format!("{name}, {zero:?}, step {}", step + 1);
                assert_eq!(report.skipped, expected.skipped, "{what}: skipped");
                assert_eq!(
                    report.grad_norm.map(f64::to_bits),
                    expected.grad_norm.map(f64::to_bits),
                    "{what}: gradient norm"
                );
                for (p, (&id, n)) in ids.iter().zip(numels()).enumerate() {
                    let mut v = vec![0f32; n];
                    want.read(id, SlotKind::Param, &mut v).unwrap();
                    assert_eq!(bits(&opt.params()[p]), bits(&v), "{what}: parameter {p}");
                }
            }
            let path = tmp
                .path()
                .join(format!("{}-{zero:?}.safetensors", name.replace(' ', "_")));
            opt.save(&path).unwrap();
            same_canonical(
                &Canonical::read(&path).unwrap(),
                &Parts::of(&want).canonical(None).expect("canonical"),
                &format!("{name}, {zero:?}: checkpoint"),
            );
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
