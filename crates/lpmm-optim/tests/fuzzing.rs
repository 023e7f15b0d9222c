//! The fuzzers' oracles under a deterministic mutation loop: the stable-toolchain stand-in for
//! `cargo fuzz` (fuzz/README.md runs the real fuzzers, and this loop for longer). Every mutated
//! checkpoint either loads — and then survives save, load, save bit for bit — or is refused with
//! `OptimError::Checkpoint`; nothing panics. `Blockwise::quantize` refuses non-finite input
//! naming the first element and otherwise stores exact block scales.
//!
//! Budget: `LPMM_FUZZ_SECS` seconds (default 25) or `LPMM_FUZZ_ITERS` inputs, whichever ends
//! first; `LPMM_FUZZ_SEED` changes the sequence. The inputs are the same on every run.

use lpmm_optim::{Cpu, checkpoint::Canonical};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lpmm_optim::OptimError;
use lpmm_optim::fuzzing::{self, Mutator, Outcome};
use lpmm_optim::testing::Rng;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/checkpoint")
}

/// Runs `f` on `input`; on a panic, writes the input next to the corpus and re-raises.
fn guarded<T>(what: &str, input: &[u8], f: impl FnOnce() -> T + std::panic::UnwindSafe) -> T {
    match std::panic::catch_unwind(f) {
        Ok(t) => t,
        Err(e) => {
            let path = std::env::temp_dir().join(format!("lpmm-fuzz-{what}-crash.bin"));
            let _ = std::fs::write(&path, input);
            eprintln!("{what}: the failing input is in {}", path.display());
            std::panic::resume_unwind(e)
        }
    }
}

#[test]
fn every_seed_loads_and_carries_the_checksum_save_writes() {
    for (name, bytes) in fuzzing::seeds() {
        assert_eq!(
            fuzzing::load_round_trip(&bytes),
            Outcome::Loaded,
            "seed {name}"
        );
        assert_eq!(
            fuzzing::reseal(&bytes).as_deref(),
            Some(&bytes[..]),
            "seed {name}: resealing a saved file changes nothing"
        );
    }
}

/// The committed seed corpus of the cargo-fuzz targets is what `fuzzing::seeds` makes (save is
/// deterministic); `LPMM_BLESS=1` rewrites it.
#[test]
fn the_committed_corpus_is_the_seeds() {
    let dir = corpus();
    let bless = std::env::var_os("LPMM_BLESS").is_some();
    if bless {
        std::fs::create_dir_all(&dir).unwrap();
    }
    for (name, bytes) in fuzzing::seeds() {
        let path = dir.join(format!("{name}.safetensors"));
        if bless {
            std::fs::write(&path, &bytes).unwrap();
        }
        let committed = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (LPMM_BLESS=1 writes it)", path.display()));
        assert!(
            committed == bytes,
            "{} is stale: run LPMM_BLESS=1 cargo test -p lpmm-optim --test fuzzing",
            path.display()
        );
    }
}

/// A refusal's kind, for the summary.
fn category(reason: &str) -> String {
    const KINDS: &[(&str, &str)] = &[
        ("no checksum", "no checksum"),
        ("checksum", "checksum mismatch"),
        ("not a readable safetensors", "not a safetensors container"),
        ("no lpmm metadata", "no lpmm metadata"),
        ("metadata:", "metadata does not parse"),
        ("format ", "foreign format"),
        ("version", "other version"),
        (
            "more elements than the file",
            "shape: more elements than the file",
        ),
        ("shape", "tensor shape or length"),
        ("missing", "tensor missing"),
        ("unexpected tensors", "unexpected tensors"),
        ("code map", "code map differs"),
        (" is ", "tensor dtype"),
        ("scale", "negative or non-finite scale"),
        ("non-finite", "non-finite value"),
        ("2^127", "Kahan bounds"),
        ("counter", "counter beyond 2^53"),
        ("two parameters", "duplicate name"),
        ("group", "group"),
        ("hyperparameter", "hyperparameter out of range"),
        ("cannot be stored", "storage not allowed"),
        ("pending", "pending without accumulator"),
        ("max_grad_norm", "options"),
        ("learning-rate scale", "learning-rate rule"),
        ("layout or length", "region layout or length"),
    ];
    KINDS.iter().find(|(k, _)| reason.contains(k)).map_or_else(
        || format!("other: {}", reason.chars().take(50).collect::<String>()),
        |(_, c)| c.to_string(),
    )
}

#[test]
fn mutated_checkpoints_load_and_round_trip_or_are_refused() {
    let seeds: Vec<Vec<u8>> = fuzzing::seeds().into_iter().map(|(_, b)| b).collect();
    let secs = env("LPMM_FUZZ_SECS", 25);
    let iters = env("LPMM_FUZZ_ITERS", u64::MAX);
    let mut mutator = Mutator::new(env("LPMM_FUZZ_SEED", 0x22));
    let dir = std::env::temp_dir().join(format!("lpmm-fuzzing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("input.safetensors");
    let mut through_files = 0u64;
    let start = Instant::now();
    let (mut loaded, mut refused, mut n) = (0u64, 0u64, 0u64);
    let mut reasons: BTreeMap<String, u64> = BTreeMap::new();
    while n < iters && start.elapsed() < Duration::from_secs(secs) {
        let input = mutator.next(&seeds);
        let seen = guarded("checkpoint", &input, || fuzzing::checkpoint(&input));
        // Every 32nd input also through the file API: the same verdict, and a refusal is an
        // `OptimError::Checkpoint` (the docs promise it for every bad file).
        if n % 32 == 0 {
            std::fs::write(&file, &input).unwrap();
            match (
                Canonical::read(&file).and_then(|c| c.into_optimizer(Cpu)),
                &seen.raw,
            ) {
                (Ok(_), Outcome::Loaded) => {}
                (Err(OptimError::Checkpoint { .. }), Outcome::Refused(_)) => {}
                (other, want) => {
                    let path = std::env::temp_dir().join("lpmm-fuzz-checkpoint-file-crash.bin");
                    let _ = std::fs::write(&path, &input);
                    panic!(
                        "loading gave {other:?} where the oracle saw {want:?} (the input is in {})",
                        path.display()
                    );
                }
            }
            through_files += 1;
        }
        for outcome in std::iter::once(seen.raw).chain(seen.resealed) {
            match outcome {
                Outcome::Loaded => loaded += 1,
                Outcome::Refused(reason) => {
                    refused += 1;
                    *reasons.entry(category(&reason)).or_default() += 1;
                }
            }
        }
        n += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "mutation loop: {n} inputs in {secs:.1} s ({:.0}/s), {} loads (each input as it is, and resealed where that changes it): {loaded} loaded and round-tripped, {refused} refused, 0 panics",
        n as f64 / secs,
        loaded + refused
    );
    for (reason, count) in &reasons {
        println!("  {count:8}  {reason}");
    }
    println!(
        "  {through_files} inputs also loaded from a file: the same verdicts, every refusal an OptimError::Checkpoint"
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(n >= 200, "too few inputs ran ({n})");
    assert!(
        loaded > 0 && refused > 0,
        "the mutator must reach both outcomes"
    );
}

#[test]
fn blockwise_quantize_takes_arbitrary_bytes() {
    let mut rng = Rng::new(env("LPMM_FUZZ_SEED", 0x22));
    let secs = env("LPMM_FUZZ_SECS", 25) / 5;
    let start = Instant::now();
    let (mut n, mut quantized) = (0u64, 0u64);
    let specials: [u32; 8] = [
        0x7FC0_0000,
        0x7F80_0000,
        0xFF80_0000,
        0x7F7F_FFFF,
        0x0000_0001,
        0x8000_0000,
        0,
        0x3F80_0000,
    ];
    while n < 200 || start.elapsed() < Duration::from_secs(secs.max(1)) {
        let len = 2 + (rng.next_u64() % 9000) as usize;
        let mut data: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        // Finite values of every magnitude; in half of the inputs, some special patterns.
        let specials_too = rng.next_u64().is_multiple_of(2);
        for c in data[2..].chunks_exact_mut(4) {
            let r = rng.next_u64();
            let bits = if specials_too && r.is_multiple_of(64) {
                specials[(r >> 8) as usize % specials.len()]
            } else if r.is_multiple_of(2) {
                (rng.uniform() * 10f32.powi((r >> 8) as i32 % 76 - 38)).to_bits()
            } else {
                u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0xBFFF_FFFF
            };
            c.copy_from_slice(&bits.to_le_bytes());
        }
        quantized += u64::from(guarded("blockwise", &data, || fuzzing::blockwise(&data)));
        n += 1;
    }
    println!(
        "blockwise: {n} inputs, {quantized} quantized, the rest refused (a non-finite value, or a negative one into a map without negative values)"
    );
    assert!(quantized > 0 && quantized < n);
}
