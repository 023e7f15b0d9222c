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

/// Every `mpirun` gets a `TMPDIR` of its own, the same on all its ranks, gone after the run: two
/// launches at once on one machine must not share Open MPI's session directory (open-mpi/ompi#8510;
/// see `Mpirun::run`).
#[test]
fn each_mpirun_has_its_own_temporary_directory() {
    let Some(mpirun) = mpirun::Mpirun::find_or_skip("each_mpirun_has_its_own_temporary_directory")
    else {
        return;
    };
    let ours = std::env::temp_dir();
    let tmpdirs = |out: &mpirun::MpiOutput| -> Vec<String> {
        out.stdout.lines().map(str::to_owned).collect()
    };
    let runs: Vec<Vec<String>> = std::thread::scope(|s| {
        let launches: Vec<_> = (0..2)
            .map(|_| s.spawn(|| mpirun.run("/bin/sh", 2, &["-c", "echo \"$TMPDIR\""])))
            .collect();
        launches
            .into_iter()
            .map(|h| {
                let out = h.join().unwrap();
                out.assert_success();
                tmpdirs(&out)
            })
            .collect()
    });
    for dirs in &runs {
        assert_eq!(dirs.len(), 2, "one line per rank: {dirs:?}");
        assert_eq!(dirs[0], dirs[1], "both ranks of a run share it");
        let dir = std::path::Path::new(&dirs[0]);
        assert_ne!(dir, ours, "not the test's own temporary directory");
        assert!(!dir.exists(), "{dir:?} is removed after the run");
    }
    assert_ne!(
        runs[0][0], runs[1][0],
        "two runs at once have different ones"
    );
}
