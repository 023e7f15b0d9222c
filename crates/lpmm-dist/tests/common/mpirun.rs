//! Runs a program on several MPI ranks under `mpirun`, for integration tests. Shared by test
//! binaries (`#[path = "common/mpirun.rs"] mod mpirun;`), each using a part of it.
//!
//! ```ignore
//! #[test]
//! fn my_mpi_test() {
//!     let Some(mpirun) = mpirun::Mpirun::find_or_skip("my_mpi_test") else { return };
//!     for world in 2..=4 {
//!         // A `[[bin]]` of this package (required-features = ["mpi"]), built by cargo for the
//!         // integration tests; it exits non-zero when a check fails.
//!         mpirun.run(env!("CARGO_BIN_EXE_my-mpi-program"), world, &["--some-arg"]).assert_success();
//!     }
//! }
//! ```
//!
//! Environment: `LPMM_REQUIRE_MPI=1` makes a missing `mpirun` fail the test instead of skipping
//! it; `LPMM_MPIRUN` names the launcher (default `mpirun` on `PATH`; `mpiexec` works too);
//! `LPMM_MPIRUN_ARGS` adds launcher arguments (split on whitespace, e.g. `--mca btl self,vader`);
//! `LPMM_MPIRUN_TIMEOUT` is the limit per run in seconds (default 300).
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// A working MPI launcher.
#[derive(Debug, Clone)]
pub struct Mpirun {
    launcher: PathBuf,
    /// Open MPI's `mpirun` (else, e.g., MPICH's Hydra): decides the extra flags.
    open_mpi: bool,
    extra_args: Vec<String>,
    timeout: Duration,
}

/// What one `mpirun` run did.
#[derive(Debug)]
pub struct MpiOutput {
    /// The command line, for messages.
    pub command: String,
    pub world: usize,
    /// `None` when the run was killed after the timeout.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

impl MpiOutput {
    /// Whether the run finished in time and every rank exited with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// Panics with the command and everything it printed unless [`MpiOutput::success`].
    #[track_caller]
    pub fn assert_success(&self) -> &Self {
        if !self.success() {
            let why = match self.status {
                Some(s) => format!("failed ({s})"),
                None => "timed out (killed)".to_string(),
            };
            panic!("{why}: {}\n{}", self.command, self.transcript());
        }
        self
    }

    /// Everything the run printed, stdout then stderr.
    pub fn transcript(&self) -> String {
        format!(
            "--- stdout ---\n{}--- stderr ---\n{}",
            self.stdout, self.stderr
        )
    }
}

fn truthy(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| !v.is_empty() && v != "0")
}

impl Mpirun {
    /// The launcher, when one runs. Without one: prints why `test` is skipped and returns
    /// `None`, or panics when `LPMM_REQUIRE_MPI=1`.
    pub fn find_or_skip(test: &str) -> Option<Mpirun> {
        match Mpirun::find() {
            Ok(m) => Some(m),
            Err(why) if truthy("LPMM_REQUIRE_MPI") => {
                panic!("{test}: LPMM_REQUIRE_MPI=1 but no MPI launcher: {why}")
            }
            Err(why) => {
                eprintln!("skipping {test}: {why} (set LPMM_REQUIRE_MPI=1 to fail instead)");
                None
            }
        }
    }

    /// The launcher named by `LPMM_MPIRUN` (default `mpirun`), if `--version` runs.
    pub fn find() -> Result<Mpirun, String> {
        let launcher =
            PathBuf::from(std::env::var("LPMM_MPIRUN").unwrap_or_else(|_| "mpirun".into()));
        let out = Command::new(&launcher)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run `{} --version`: {e}", launcher.display()))?;
        if !out.status.success() {
            return Err(format!(
                "`{} --version` failed ({})",
                launcher.display(),
                out.status
            ));
        }
        let version = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        let open_mpi = version.contains("Open MPI") || version.contains("OpenRTE");
        let extra_args = std::env::var("LPMM_MPIRUN_ARGS")
            .map(|a| a.split_whitespace().map(String::from).collect())
            .unwrap_or_default();
        let secs = std::env::var("LPMM_MPIRUN_TIMEOUT")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(300);
        Ok(Mpirun {
            launcher,
            open_mpi,
            extra_args,
            timeout: Duration::from_secs(secs),
        })
    }

    /// The limit per run (default from `LPMM_MPIRUN_TIMEOUT`).
    pub fn timeout(mut self, limit: Duration) -> Mpirun {
        self.timeout = limit;
        self
    }

    /// Runs `program args` on `world` ranks and collects what they print. Open MPI gets
    /// `--oversubscribe` (more ranks than cores) and, through the environment, permission to run
    /// as root; a run past the timeout is terminated.
    ///
    /// Each run gets a fresh temporary directory of its own as `TMPDIR`, removed after it. Open
    /// MPI 4 puts its session directory under it (`$TMPDIR/ompi.<host>.<uid>`), and two `mpirun`s
    /// starting at once on one machine race to create a shared one: the loser fails with "A call
    /// to mkdir was unable to create the desired directory ... File exists" (open-mpi/ompi#8510).
    /// The test binaries run their tests on parallel threads, so that happens; CI once failed on
    /// it.
    pub fn run(&self, program: impl AsRef<Path>, world: usize, args: &[&str]) -> MpiOutput {
        // Removed when this returns (after the run, or after it was killed).
        let tmp = lpmm_optim::testing::temp_dir("lpmm-mpirun-");
        let mut cmd = Command::new(&self.launcher);
        cmd.env("TMPDIR", tmp.path());
        cmd.arg("-np").arg(world.to_string());
        if self.open_mpi {
            cmd.arg("--oversubscribe");
            // Open MPI refuses root unless both are set (containers and CI machines run as root).
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
        cmd.args(&self.extra_args).arg(program.as_ref()).args(args);
        let command = format!("{cmd:?}");
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command}: {e}"));
        // Readers on threads (a full pipe would stall the ranks); results through channels, so
        // that ranks left running after a kill, holding the pipes open, cannot block us.
        let drain = |pipe: Option<Box<dyn Read + Send>>| {
            let (tx, rx) = mpsc::channel();
            thread::spawn(move || {
                let mut s = Vec::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut s);
                }
                let _ = tx.send(String::from_utf8_lossy(&s).into_owned());
            });
            rx
        };
        let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
        let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
        let start = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if start.elapsed() < self.timeout => {
                    thread::sleep(Duration::from_millis(20))
                }
                Ok(None) | Err(_) => {
                    // SIGTERM first: mpirun then stops its ranks; SIGKILL if it does not exit.
                    let _ = Command::new("kill")
                        .arg("-TERM")
                        .arg(child.id().to_string())
                        .status();
                    let grace = Instant::now();
                    while grace.elapsed() < Duration::from_secs(10) {
                        if let Ok(Some(_)) = child.try_wait() {
                            break;
                        }
                        thread::sleep(Duration::from_millis(50));
                    }
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
            }
        };
        MpiOutput {
            command,
            world,
            status,
            stdout: collect(&out),
            stderr: collect(&err),
        }
    }
}

fn collect(rx: &mpsc::Receiver<String>) -> String {
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| "<not collected: the output pipe stayed open>\n".into())
}
