//! `cargo xtask <command>`: project automation, in Rust, with few dependencies.
//!
//! - `bench [--quick] [FILTER]`: runs the criterion benches of `benches/` (`--quick`: criterion's
//!   quick mode, a smoke run), then prints a markdown table of every case with its throughput and
//!   its ratio to the memcpy reference measured in the same run (the rate at which the case
//!   consumes f32 input, 4 bytes per element, divided by the rate at which memcpy copies bytes),
//!   and writes it to `target/lpmm-report/bench.md`. Earlier criterion results are cleared first.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("bench") => bench(&args[1..]),
        _ => Err("usage: cargo xtask bench [--quick] [FILTER]".to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn bench(args: &[String]) -> Result<(), String> {
    let root = workspace_root();
    let mut criterion_args: Vec<&str> = vec!["--noplot"];
    let mut filter = None;
    for a in args {
        match a.as_str() {
            "--quick" => criterion_args.push("--quick"),
            other if !other.starts_with('-') => filter = Some(other),
            other => return Err(format!("unknown option {other}")),
        }
    }
    // Results of earlier runs would be reported as if measured now.
    let criterion_dir = root.join("target/criterion");
    if criterion_dir.exists() {
        std::fs::remove_dir_all(&criterion_dir)
            .map_err(|e| format!("cannot clear {}: {e}", criterion_dir.display()))?;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args(["bench", "-p", "lpmm-benches", "--benches", "--"])
        .args(&criterion_args);
    if let Some(f) = filter {
        cmd.arg(f);
    }
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run cargo bench: {e}"))?;
    if !status.success() {
        return Err(format!("cargo bench failed: {status}"));
    }
    let table = summarize(&root.join("target/criterion"))?;
    let out = root.join("target/lpmm-report");
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    std::fs::write(out.join("bench.md"), &table).map_err(|e| e.to_string())?;
    println!("\n{table}\n(written to target/lpmm-report/bench.md)");
    Ok(())
}

/// One measured case read back from criterion's `new/` estimates.
struct Case {
    group: String,
    name: String,
    ns: f64,
    per_second: f64,
    unit: &'static str,
}

fn read_json(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

fn collect(dir: &Path, cases: &mut Vec<Case>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.ends_with("new") {
            let (Some(est), Some(meta)) = (
                read_json(&path.join("estimates.json")),
                read_json(&path.join("benchmark.json")),
            ) else {
                continue;
            };
            let Some(ns) = est["mean"]["point_estimate"].as_f64() else {
                continue;
            };
            let (count, unit) = match &meta["throughput"] {
                t if t["Bytes"].is_u64() => (t["Bytes"].as_f64().unwrap_or(0.0), "GB/s"),
                t if t["Elements"].is_u64() => (t["Elements"].as_f64().unwrap_or(0.0), "Gelem/s"),
                _ => continue,
            };
            cases.push(Case {
                group: meta["group_id"].as_str().unwrap_or("").to_string(),
                name: meta["title"].as_str().unwrap_or("").to_string(),
                ns,
                per_second: count / ns, // per ns = G per s
                unit,
            });
        } else if path.is_dir() {
            collect(&path, cases);
        }
    }
}

fn summarize(criterion: &Path) -> Result<String, String> {
    let mut cases = Vec::new();
    collect(criterion, &mut cases);
    if cases.is_empty() {
        return Err(format!(
            "no criterion results under {}",
            criterion.display()
        ));
    }
    cases.sort_by(|a, b| a.name.cmp(&b.name));
    let mut table = String::from(
        "| case | time | throughput | memcpy, same run | f32 input bytes/s ÷ memcpy bytes/s |\n|---|---|---|---|---|\n",
    );
    for c in &cases {
        let memcpy = cases
            .iter()
            .find(|m| m.group == c.group && m.unit == "GB/s" && m.name.contains("memcpy"))
            .map(|m| m.per_second);
        let (reference, ratio) = match (memcpy, c.unit) {
            (Some(m), "Gelem/s") => (
                format!("{m:.2} GB/s"),
                format!("{:.2}", c.per_second * 4.0 / m),
            ),
            (Some(m), _) => (format!("{m:.2} GB/s"), String::from("-")),
            _ => (String::from("-"), String::from("-")),
        };
        table += &format!(
            "| {} | {:.3} ms | {:.3} {} | {} | {} |\n",
            c.name,
            c.ns / 1e6,
            c.per_second,
            c.unit,
            reference,
            ratio
        );
    }
    Ok(table)
}
