//! Run by `tests/mpi.rs` under `mpirun -np W`: every collective of [`Mpi`] against values each
//! rank computes locally (every rank knows what every rank contributes). Exits non-zero when a
//! check fails. The data are small multiples of 1/2, so every f32 sum is exact in any order.

#[cfg(feature = "nccl")]
use lpmm_dist::Nccl;
use lpmm_dist::{Collective, DistError, Mpi};
use mpi::traits::Communicator;

/// What rank `rank` contributes at index `i` of case `salt`.
fn val(rank: usize, i: usize, salt: usize) -> f32 {
    (((rank * 7919 + i * 31 + salt * 101) % 513) as f32 - 256.0) * 0.5
}

fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let o = *at;
            *at += c;
            Some(o)
        })
        .collect()
}

/// Count patterns (one entry per rank), zeros included.
fn count_patterns(w: usize) -> Vec<Vec<usize>> {
    vec![
        vec![4; w],
        (0..w).map(|r| r * 3 + 1).collect(),
        (0..w).map(|r| if r % 2 == 1 { 0 } else { 5 }).collect(),
        vec![0; w],
        (0..w).map(|r| if r + 1 == w { 37 } else { 2 }).collect(),
    ]
}

/// `world x world` matrices (row = sender), zeros included.
fn matrix_patterns(w: usize) -> Vec<Vec<Vec<usize>>> {
    let m = |f: &dyn Fn(usize, usize) -> usize| -> Vec<Vec<usize>> {
        (0..w).map(|r| (0..w).map(|q| f(r, q)).collect()).collect()
    };
    vec![
        m(&|r, q| (r * 3 + q * 5 + 1) % 4),
        m(&|r, q| (r + q) % 3 * 7),
        m(&|_, _| 0),
        m(&|r, q| if r == q { 6 } else { 0 }),
        m(&|r, _| if r == 0 { 23 } else { 1 }),
    ]
}

struct Checks {
    rank: usize,
    passed: usize,
    failures: Vec<String>,
}

impl Checks {
    fn eq<T: PartialEq + std::fmt::Debug>(&mut self, what: &str, got: &T, want: &T) {
        if got == want {
            self.passed += 1;
        } else {
            self.failures.push(format!(
                "rank {}: {what}:\n  got  {got:?}\n  want {want:?}",
                self.rank
            ));
        }
    }

    fn ok(&mut self, what: &str, r: Result<(), DistError>) {
        match r {
            Ok(()) => self.passed += 1,
            Err(e) => self
                .failures
                .push(format!("rank {}: {what}: unexpected error: {e}", self.rank)),
        }
    }

    fn err(&mut self, what: &str, r: Result<(), DistError>) {
        match r {
            Err(DistError::Collective(_)) => self.passed += 1,
            other => self.failures.push(format!(
                "rank {}: {what}: expected a collective error, got {other:?}",
                self.rank
            )),
        }
    }
}

/// Every collective of `c`; with `agreeing`, also the errors that only a group whose ranks agree
/// on the arguments first (`Mpi` with `verify`) returns on every rank.
fn run(c: &dyn Collective, t: &mut Checks, cfg: &str, agreeing: bool) {
    let (me, w) = (c.rank(), c.world());

    for len in [0, 1, 7, 1000] {
        let mut buf: Vec<f32> = (0..len).map(|i| val(me, i, 1)).collect();
        t.ok(
            &format!("{cfg} all_reduce_f32 len {len}"),
            c.all_reduce_sum_f32(&mut buf),
        );
        let want: Vec<f32> = (0..len)
            .map(|i| (0..w).map(|r| val(r, i, 1)).sum())
            .collect();
        t.eq(&format!("{cfg} all_reduce_f32 len {len}"), &buf, &want);
    }

    for len in [0, 1, 9, 300] {
        let v = |r: usize, i: usize| {
            (r as i64 + 1) * (1 << 40) * if i.is_multiple_of(2) { 1 } else { -1 } - i as i64
        };
        let mut buf: Vec<i64> = (0..len).map(|i| v(me, i)).collect();
        t.ok(
            &format!("{cfg} all_reduce_i64 len {len}"),
            c.all_reduce_sum_i64(&mut buf),
        );
        let want: Vec<i64> = (0..len).map(|i| (0..w).map(|r| v(r, i)).sum()).collect();
        t.eq(&format!("{cfg} all_reduce_i64 len {len}"), &buf, &want);
    }

    for counts in count_patterns(w) {
        let offs = offsets(&counts);
        let total: usize = counts.iter().sum();

        let send: Vec<f32> = (0..total).map(|i| val(me, i, 2)).collect();
        let mut recv = vec![f32::NAN; counts[me]];
        t.ok(
            &format!("{cfg} reduce_scatter {counts:?}"),
            c.reduce_scatter_sum_f32(&send, &mut recv, &counts),
        );
        let want: Vec<f32> = (0..counts[me])
            .map(|j| (0..w).map(|r| val(r, offs[me] + j, 2)).sum())
            .collect();
        t.eq(&format!("{cfg} reduce_scatter {counts:?}"), &recv, &want);

        let send: Vec<f32> = (0..counts[me]).map(|j| val(me, j, 3)).collect();
        let mut recv = vec![f32::NAN; total];
        t.ok(
            &format!("{cfg} all_gather_f32 {counts:?}"),
            c.all_gather_f32(&send, &mut recv, &counts),
        );
        let want: Vec<f32> = (0..w)
            .flat_map(|r| (0..counts[r]).map(move |j| val(r, j, 3)))
            .collect();
        t.eq(&format!("{cfg} all_gather_f32 {counts:?}"), &recv, &want);

        let byte = |r: usize, j: usize| (r * 37 + j * 11 + 5) as u8;
        let send: Vec<u8> = (0..counts[me]).map(|j| byte(me, j)).collect();
        let mut recv = vec![0xAAu8; total];
        t.ok(
            &format!("{cfg} all_gather_u8 {counts:?}"),
            c.all_gather_u8(&send, &mut recv, &counts),
        );
        let want: Vec<u8> = (0..w)
            .flat_map(|r| (0..counts[r]).map(move |j| byte(r, j)))
            .collect();
        t.eq(&format!("{cfg} all_gather_u8 {counts:?}"), &recv, &want);
    }

    for counts in matrix_patterns(w) {
        // Block (r -> q), element j: val(r * w + q, j, 4).
        let send: Vec<f32> = (0..w)
            .flat_map(|q| (0..counts[me][q]).map(move |j| val(me * w + q, j, 4)))
            .collect();
        let mut recv = vec![f32::NAN; (0..w).map(|q| counts[q][me]).sum()];
        t.ok(
            &format!("{cfg} all_to_all {counts:?}"),
            c.all_to_all_f32(&send, &mut recv, &counts),
        );
        let want: Vec<f32> = (0..w)
            .flat_map(|q| (0..counts[q][me]).map(move |j| val(q * w + me, j, 4)))
            .collect();
        t.eq(&format!("{cfg} all_to_all {counts:?}"), &recv, &want);
    }

    // Wrong arguments on every rank: each rank refuses on its own (no rank enters MPI).
    let mut recv = vec![0.0f32; 1];
    t.err(
        &format!("{cfg} all_gather, counts of the wrong length"),
        c.all_gather_f32(&[1.0], &mut recv, &vec![1; w + 1]),
    );

    if agreeing {
        // Rank 0's buffer does not match the counts: every rank gets the error, none hangs.
        let counts = vec![2; w];
        let send = vec![1.0f32; 2];
        let mut recv = vec![0.0f32; 2 * w + usize::from(me == 0)];
        t.err(
            &format!("{cfg} all_gather, rank 0's recv too long"),
            c.all_gather_f32(&send, &mut recv, &counts),
        );
        if w > 1 {
            // Valid on each rank, but rank 0 disagrees on the counts.
            let mut counts = vec![2; w];
            if me == 0 {
                counts[0] = 3;
                counts[1] = 1;
            }
            let send = vec![1.0f32; counts[me]];
            let mut recv = vec![0.0f32; 2 * w];
            t.err(
                &format!("{cfg} all_gather, counts disagree"),
                c.all_gather_f32(&send, &mut recv, &counts),
            );
            // Different collectives on rank 0 and the others.
            let r = if me == 0 {
                c.all_reduce_sum_f32(&mut [1.0, 2.0])
            } else {
                c.all_reduce_sum_i64(&mut [1, 2])
            };
            t.err(&format!("{cfg} all_reduce f32 on rank 0, i64 elsewhere"), r);
        }
        // The group is still in step.
        let mut buf = [1.0f32];
        t.ok(
            &format!("{cfg} all_reduce after errors"),
            c.all_reduce_sum_f32(&mut buf),
        );
        t.eq(&format!("{cfg} all_reduce after errors"), &buf, &[w as f32]);
    }
}

fn main() {
    let (comm, universe) = match Mpi::init() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("MPI init failed: {e}");
            std::process::exit(2);
        }
    };
    let (rank, world) = (comm.rank(), comm.world());
    let mut t = Checks {
        rank,
        passed: 0,
        failures: Vec::new(),
    };
    t.eq("rank", &rank, &(universe.world().rank() as usize));
    t.eq("world", &world, &(universe.world().size() as usize));
    t.err("second Mpi::init", Mpi::init().map(drop));

    // Default limits (one MPI call per collective), then tiny ones (many rounds per collective),
    // each with and without the agreement step.
    for (max_count, verify) in [
        (None, true),
        (None, false),
        (Some(5), true),
        (Some(3), false),
    ] {
        let c = Mpi::from_communicator(universe.world())
            .expect("world communicator")
            .verify(verify);
        let c = match max_count {
            Some(n) => c.max_count(n),
            None => c,
        };
        let cfg = format!("[max_count {max_count:?}, verify {verify}]");
        run(&c, &mut t, &cfg, verify);
    }

    // A duplicated communicator (freed on drop, before MPI_Finalize).
    let dup = Mpi::from_communicator(universe.world().duplicate()).expect("duplicate communicator");
    let mut buf = [rank as f32];
    t.ok("duplicate: all_reduce", dup.all_reduce_sum_f32(&mut buf));
    t.eq(
        "duplicate: all_reduce",
        &buf,
        &[(world * (world - 1) / 2) as f32],
    );
    drop(dup);

    #[cfg(feature = "nccl")]
    nccl_checks(&comm, &mut t);

    let failed = !t.failures.is_empty();
    for f in &t.failures {
        eprintln!("{f}");
    }
    println!(
        "rank {rank}/{world}: {} checks passed, {} failed",
        t.passed,
        t.failures.len()
    );
    drop(comm);
    drop(universe); // MPI_Finalize
    if failed {
        std::process::exit(1);
    }
}

/// With NCCL: every collective over NCCL when each rank has a GPU of its own on its node (one
/// rank per GPU), else the setup fails the same way on every rank (no panic, no hang).
#[cfg(feature = "nccl")]
fn nccl_checks(comm: &Mpi, t: &mut Checks) {
    let gpus = Nccl::available()
        .ok()
        .and_then(|()| cudarc::driver::CudaContext::device_count().ok())
        .unwrap_or(0);
    let node = comm.communicator().split_shared(comm.rank() as i32);
    let mut fits = [i64::from(gpus >= node.size())];
    t.ok("nccl: agree on GPUs", comm.all_reduce_sum_i64(&mut fits));
    let r = Nccl::from_mpi(comm, None);
    if fits[0] == comm.world() as i64 {
        match r {
            Ok(nccl) => {
                println!("rank {}: NCCL collectives on GPU", comm.rank());
                run(&nccl, t, "[nccl]", false);
            }
            Err(e) => t
                .failures
                .push(format!("rank {}: Nccl::from_mpi: {e}", t.rank)),
        }
    } else {
        println!(
            "rank {}: no NCCL or too few GPUs: checking the setup error",
            comm.rank()
        );
        t.err("nccl: Nccl::from_mpi without NCCL or GPUs", r.map(drop));
    }
}
