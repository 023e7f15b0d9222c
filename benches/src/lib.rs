//! Shared pieces of lpmm's criterion benches (`cargo xtask bench` runs them):
//!
//! - [`sizes`]: parameter counts per case (1M to 256M; `LPMM_BENCH_QUICK=1` for a smoke run);
//! - [`describe`]: a sidecar file per case (parameters, bytes moved per parameter, what it is
//!   read against) that xtask joins with criterion's timings into `bench.json`;
//! - [`RmwCeiling`]: the bandwidth ceiling of a step, an in-place read-modify-write over
//!   buffers of the step's sizes;
//! - peers: [`candle_peer`] (candle-nn's AdamW) and, with feature `burn`, `burn_peer`.

use rayon::prelude::*;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

#[cfg(feature = "burn")]
pub mod burn_peer;
pub mod candle_peer;

/// 2^20 parameters.
pub const M: usize = 1 << 20;

/// Whether this is a smoke run (`LPMM_BENCH_QUICK=1`, set by `cargo xtask bench --quick`).
pub fn quick() -> bool {
    std::env::var("LPMM_BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// Criterion's warm-up and measurement times for a group: `full` in a measuring run; in a smoke
/// run 50 ms and 100 ms, whatever `full` is (criterion still takes each group's samples, however
/// long they take; a smoke run's figures are not reported).
pub fn times(full: (Duration, Duration)) -> (Duration, Duration) {
    if quick() {
        (Duration::from_millis(50), Duration::from_millis(100))
    } else {
        full
    }
}

/// Parameter counts of the step cases: 1M, 16M, 64M and 256M (well past this machine's L3),
/// or 1M and 4M in a smoke run; `LPMM_BENCH_SIZES` (labels such as `1M,16M,64M`) chooses others,
/// e.g. to leave out 256M on a machine whose memory does not hold candle's AdamW at that size.
///
/// # Panics
/// If `LPMM_BENCH_SIZES` holds something other than sizes in millions (`16M`) or plain counts.
pub fn sizes() -> Vec<usize> {
    if let Ok(list) = std::env::var("LPMM_BENCH_SIZES") {
        return parse_sizes(&list).unwrap_or_else(|e| panic!("LPMM_BENCH_SIZES: {e}"));
    }
    if quick() {
        vec![M, 4 * M]
    } else {
        vec![M, 16 * M, 64 * M, 256 * M]
    }
}

/// Sizes as `LPMM_BENCH_SIZES` lists them: `16M` (millions of 2^20) or a plain count.
fn parse_sizes(list: &str) -> Result<Vec<usize>, String> {
    list.split(',')
        .map(|s| {
            let s = s.trim();
            let (digits, scale) = match s.strip_suffix('M') {
                Some(d) => (d, M),
                None => (s, 1),
            };
            match digits
                .parse::<usize>()
                .ok()
                .and_then(|d| d.checked_mul(scale))
            {
                Some(n) if n > 0 => Ok(n),
                _ => Err(format!("{s:?} is not a size (16M, 1048576)")),
            }
        })
        .collect()
}

/// Short label of a size (`1M`, `256M`).
pub fn label(n: usize) -> String {
    if n.is_multiple_of(M) {
        format!("{}M", n / M)
    } else {
        n.to_string()
    }
}

/// Deterministic normal-ish data (sum of uniforms from SplitMix64), scaled by `scale`.
pub fn data(n: usize, scale: f32) -> Vec<f32> {
    use rand_core::{Rng as _, SeedableRng};
    let mut rng = rand_xoshiro::SplitMix64::seed_from_u64(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            let mut s = 0.0f32;
            for _ in 0..4 {
                s += (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
            }
            (s - 2.0) * scale
        })
        .collect()
}

/// What a case is, for the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An lpmm operation.
    Lpmm,
    /// A bandwidth ceiling (or memcpy reference) other cases are read against.
    Ceiling,
    /// Another library doing the same job.
    Peer,
}

/// The sidecar of one case: criterion measures its time; this says what the time is of.
#[derive(Debug, Clone)]
pub struct CaseInfo<'a> {
    /// Criterion's full id: `group/function` or `group/function/parameter`.
    pub id: &'a str,
    /// Parameters (elements) one iteration processes.
    pub params: usize,
    /// Bytes one iteration moves per parameter, counted from the formats (each byte read once
    /// and each byte written once counts).
    pub bytes_per_param: f64,
    /// What it is.
    pub kind: Kind,
    /// The id of the ceiling this case is read against.
    pub ceiling: Option<&'a str>,
    /// The lpmm preset it corresponds to (for peers: the preset doing the same job).
    pub preset: Option<&'a str>,
}

/// Writes the sidecar of a case into `$LPMM_BENCH_CASES` (set by xtask; default
/// `target/lpmm-report/cases`).
pub fn describe(info: &CaseInfo<'_>) {
    let dir = std::env::var_os("LPMM_BENCH_CASES").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/lpmm-report/cases"),
        PathBuf::from,
    );
    let kind = match info.kind {
        Kind::Lpmm => "lpmm",
        Kind::Ceiling => "ceiling",
        Kind::Peer => "peer",
    };
    let json = serde_json::json!({
        "id": info.id,
        "params": info.params,
        "bytes_per_param": info.bytes_per_param,
        "kind": kind,
        "ceiling": info.ceiling,
        "preset": info.preset,
    });
    let name: String = info
        .id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    // A bench must not fail for want of a report folder; xtask reports missing sidecars.
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join(format!("{name}.json")), json.to_string());
    }
}

/// The memory-bandwidth ceiling of a step: every byte the step reads and writes, moved by the
/// simplest kernel that can — one in-place read-modify-write pass over buffers of the step's
/// slot sizes, plus a read-only pass over buffers the step only reads (a released gradient).
/// All threads (rayon), in chunks like the step's. A memcpy would understate it: its
/// destination costs a read for ownership that an in-place update does not pay.
#[derive(Debug)]
pub struct RmwCeiling {
    rmw: Vec<Vec<u64>>,
    read: Vec<Vec<u64>>,
}

impl RmwCeiling {
    /// Buffers of `rmw_bytes` (read and written) and `read_bytes` (only read).
    pub fn new(rmw_bytes: &[usize], read_bytes: &[usize]) -> Self {
        let make = |b: &usize| vec![1u64; b.div_ceil(8)];
        Self {
            rmw: rmw_bytes.iter().filter(|&&b| b > 0).map(make).collect(),
            read: read_bytes.iter().filter(|&&b| b > 0).map(make).collect(),
        }
    }

    /// Bytes one pass moves.
    pub fn bytes(&self) -> usize {
        let len = |v: &Vec<Vec<u64>>| v.iter().map(|b| 8 * b.len()).sum::<usize>();
        2 * len(&self.rmw) + len(&self.read)
    }

    /// One pass.
    pub fn run(&mut self) {
        const CHUNK: usize = 1 << 15; // 256 KiB of u64
        for buf in &mut self.rmw {
            buf.par_chunks_mut(CHUNK).for_each(|c| {
                c.iter_mut().for_each(|w| *w = w.wrapping_add(1));
            });
        }
        for buf in &self.read {
            let s: u64 = buf
                .par_chunks(CHUNK)
                .map(|c| c.iter().fold(0u64, |a, &w| a.wrapping_add(w)))
                .sum();
            black_box(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_parsed_from_labels_and_counts() {
        assert_eq!(parse_sizes("1M,16M").unwrap(), vec![M, 16 * M]);
        assert_eq!(parse_sizes(" 4096 , 2M").unwrap(), vec![4096, 2 * M]);
        for bad in ["", "0", "16G", "M", "-1M", "99999999999999999999M"] {
            assert!(parse_sizes(bad).is_err(), "{bad:?}");
        }
    }
}
