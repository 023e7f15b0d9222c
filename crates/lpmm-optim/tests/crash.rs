//! Saves killed at random points: a child process (this test binary, run as `crash_child`)
//! saves two different states to one path in a loop; the parent kills it with SIGKILL after a
//! random delay, at least 200 times, and checks each time that the path holds the old or the new
//! complete file and loads. The temporary files the kills leave behind are removed by the next
//! save or load of the path, so they never pile up. Unix only (SIGKILL).

#![cfg(unix)]

use lpmm_optim::Checkpoint;
use lpmm_optim::Cpu;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lpmm_optim::testing::Rng;
use lpmm_optim::{Optimizer, OptimizerOptions, ParamId, checkpoint::Canonical, presets};

const CHILD: &str = "LPMM_CRASH_CHILD";
const FIRST: &str = "LPMM_CRASH_FIRST";

/// One of two states, `which` = 0 or 1, about 2.5 MB each, so that a save takes a few ms.
fn state(which: u64) -> Optimizer {
    let mut opt = Optimizer::new(OptimizerOptions::default().with_seed(3)).unwrap();
    let g = opt.add_group(presets::adamw_8bit_bf16_sr(1e-3)).unwrap();
    let mut rng = Rng::new(which);
    let ids: Vec<(ParamId, usize)> = [300_077usize, 100_000, 1000]
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let id = opt
                .add_param(&format!("p{k}"), &[n], &rng.spread(n, 0.5), g)
                .unwrap();
            (id, n)
        })
        .collect();
    for _ in 0..=which {
        for &(id, n) in &ids {
            opt.accumulate(id, &rng.spread(n, 1.0)).unwrap();
        }
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
    opt
}

/// The child: loads the two states the parent saved beside the path, then saves them to the
/// path alternately until it is killed.
#[test]
fn crash_child() {
    let Some(path) = std::env::var_os(CHILD) else {
        return;
    };
    let path = PathBuf::from(path);
    let first: usize = std::env::var(FIRST).unwrap().parse().unwrap();
    let states = [0, 1].map(|k| {
        Canonical::read(source(&path, k))
            .and_then(|c| c.into_optimizer(Cpu))
            .unwrap()
    });
    for k in first.. {
        states[k % 2].save(&path, Checkpoint::new()).unwrap();
    }
}

/// Spawns the child, saving state `first` first.
fn spawn(path: &Path, first: usize) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--test-threads=1", "--quiet"])
        .env(CHILD, path)
        .env(FIRST, first.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The file's identity (a rename replaces it).
fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.ino())
}

/// How long a child takes to start and finish its first save, and how long a save takes.
fn calibrate(path: &Path) -> (Duration, Duration) {
    let mut child = spawn(path, 1);
    let start = Instant::now();
    let mut times = Vec::new();
    let mut last = inode(path);
    while times.len() < 3 && start.elapsed() < Duration::from_secs(20) {
        let now = inode(path);
        if now != last {
            times.push(start.elapsed());
            last = now;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(times.len(), 3, "the child does not save");
    (times[0], (times[2] - times[0]) / 2)
}

fn source(path: &Path, which: usize) -> PathBuf {
    path.with_file_name(format!("state{which}.safetensors"))
}

fn temps(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .count()
}

#[test]
fn killed_saves_leave_the_old_or_the_new_file_and_no_leftovers() {
    let kills: usize = std::env::var("LPMM_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(220);
    let dir: PathBuf = std::env::temp_dir().join(format!("lpmm-crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ckpt.safetensors");
    let states = [state(0), state(1)];
    for (k, s) in states.iter().enumerate() {
        s.save(source(&path, k), Checkpoint::new()).unwrap();
    }
    let want: Vec<Vec<u8>> = (0..2)
        .map(|k| std::fs::read(source(&path, k)).unwrap())
        .collect();
    std::fs::write(&path, &want[0]).unwrap();
    let size = want[0].len();
    let (first_save, save) = calibrate(&path);
    let mut current = want
        .iter()
        .position(|w| *w == std::fs::read(&path).unwrap())
        .unwrap();
    // Kills anywhere from the child's start to its third save.
    let window = (first_save + 2 * save).as_micros() as u64;
    let mut rng = Rng::new(0x22);
    let start = Instant::now();
    let (mut mid_save, mut seen, mut changed) = (0usize, [0usize; 2], 0usize);
    for kill in 0..kills {
        // The child first saves the state the path does not hold: old and new differ.
        let mut child = spawn(&path, 1 - current);
        std::thread::sleep(Duration::from_micros(rng.next_u64() % window));
        child.kill().unwrap();
        child.wait().unwrap();
        // Leftovers of the killed save (counted before anything cleans them).
        let left = temps(&dir);
        mid_save += usize::from(left > 0);
        assert!(left <= 1, "kill {kill}: {left} temporary files");
        // The old or the new complete file, byte for byte (saving is deterministic)...
        let bytes = std::fs::read(&path).unwrap();
        let which = want
            .iter()
            .position(|w| *w == bytes)
            .unwrap_or_else(|| panic!("kill {kill}: the path holds neither state"));
        seen[which] += 1;
        changed += usize::from(which != current);
        current = which;
        // ...which loads (and the load removes the leftover).
        Canonical::read(&path)
            .unwrap_or_else(|e| panic!("kill {kill}: the path does not load: {e}"));
        assert_eq!(
            temps(&dir),
            0,
            "kill {kill}: the load left a temporary file"
        );
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "crash loop: {kills} kills in {secs:.1} s (a child starts and saves in {first_save:?}, a save of {size} bytes takes {save:?}); {mid_save} killed mid-save (a temporary file left, removed by the next load); the path held the old file {} times and the new one {changed} times, complete and loadable every time",
        kills - changed
    );
    assert!(
        mid_save > 0 && changed > 0 && changed < kills,
        "the kills must land before, during and after saves"
    );
    for k in 0..2 {
        Canonical::read(source(&path, k))
            .and_then(|c| c.into_optimizer(Cpu))
            .unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
