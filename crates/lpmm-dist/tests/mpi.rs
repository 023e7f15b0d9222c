//! `Mpi` on 1 to 4 ranks under `mpirun` (oversubscribed): every collective against values
//! computed locally (tests/mpi_programs/collectives.rs). Skipped when `mpirun` is missing,
//! unless `LPMM_REQUIRE_MPI=1`.
#![cfg(feature = "mpi")]

#[path = "common/mpirun.rs"]
mod mpirun;

#[test]
fn mpi_collectives_match_local_reference() {
    let Some(mpirun) = mpirun::Mpirun::find_or_skip("mpi_collectives_match_local_reference") else {
        return;
    };
    for world in 1..=4 {
        let out = mpirun.run(env!("CARGO_BIN_EXE_lpmm-dist-mpi-collectives"), world, &[]);
        out.assert_success();
        // Every rank reports.
        for rank in 0..world {
            let line = format!("rank {rank}/{world}: ");
            assert!(
                out.stdout.contains(&line),
                "no report from {line}\n{}",
                out.transcript()
            );
        }
        eprintln!("{}", out.stdout.trim_end());
    }
}

#[test]
fn sharded_optimizer_over_mpi_is_bit_identical_to_unsharded() {
    let Some(mpirun) = mpirun::Mpirun::find_or_skip("sharded_optimizer_over_mpi") else {
        return;
    };
    let tmp = lpmm_optim::testing::temp_dir("lpmm-dist-mpi-");
    let dir = tmp.path();
    let d = dir.to_str().unwrap();
    let program = env!("CARGO_BIN_EXE_lpmm-dist-mpi-sharded");
    for world in 1..=4 {
        let out = mpirun.run(program, world, &["check", d]);
        out.assert_success();
        for rank in 0..world {
            assert!(
                out.stdout.contains(&format!("rank {rank}/{world}: memory")),
                "no report from rank {rank}\n{}",
                out.transcript()
            );
        }
        eprintln!("{}", out.stdout.trim_end());
    }
    // Saved at W ranks, resumed at W' ranks.
    for (w, w2) in [(2, 3), (4, 1), (3, 4)] {
        let saved = dir.join(format!("resume-{w}.safetensors"));
        let end = dir.join(format!("resume-{w}-{w2}.safetensors"));
        let (s, e) = (saved.to_str().unwrap(), end.to_str().unwrap());
        mpirun.run(program, w, &["save", s]).assert_success();
        let out = mpirun.run(program, w2, &["resume", s, e]);
        out.assert_success();
        eprintln!("saved at {w}, resumed at {w2}: {}", out.stdout.trim_end());
    }
}
