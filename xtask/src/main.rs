//! `cargo xtask <command>`: project automation, in Rust, with few dependencies.
//!
//! `bench [--quick] [--peers] [FILTER]` runs the criterion benches of `benches/` (with burn's
//! AdamW as a peer), joins criterion's timings with the sidecar each case writes (parameters,
//! bytes moved per parameter, its bandwidth ceiling), and writes `target/lpmm-report/bench.json`
//! and `bench.md` (the table of docs/BENCHMARKS.md).
//!
//! - `--quick`: a smoke run (1M and 4M parameters, short measurements), what CI runs. It builds
//!   with the release profile, as the tests do, where burn's stack is unoptimised: its burn peer
//!   figure is not burn's speed.
//! - `--report-only`: no measuring; rebuilds the report from the last run's criterion results,
//!   sidecars and (with `--peers`) `peers.json`.
//! - `--peers`: also torch's fused AdamW and bitsandbytes' AdamW8bit at the same sizes and thread
//!   count, from a Python venv created at `target/peers-venv` (pip: torch, bitsandbytes), or the
//!   interpreter named by `LPMM_PEERS_PYTHON`.
//!
//! bench.json (schema 1): `{"schema": 1, "quick", "threads", "cpu", "cases": [...],
//! "memory": {...} | null}`; each case: `name`, `kind` (`lpmm` | `ceiling` | `peer`), `preset`,
//! `params`, `ns_per_param` (criterion's median; a ceiling's fastest sample), `bytes_per_param`, `gbps` (bytes moved / time),
//! `ceiling` (the ceiling case's name), `ceiling_gbps`, `ratio_to_ceiling` (`gbps /
//! ceiling_gbps`), and `peer_ratios`: for each optimizer peer (a peer with a preset) measured at
//! the same size, its time per parameter divided by this case's (above 1: this case is faster).
//!
//! `kernels [--check]` compiles `crates/lpmm-cuda/kernels/lpmm.generated.cu` with NVRTC for every
//! architecture of `lpmm_cuda::kernels::ARCHS` and writes `crates/lpmm-cuda/ptx/lpmm.<arch>.ptx`,
//! then assembles each with ptxas. The pinned wheels (`nvidia-cuda-{nvrtc,runtime,nvcc}-cu12`,
//! `nvidia-cuda-nvdisasm`; `lpmm_cuda::kernels::WHEELS`) are found in `LPMM_CUDA_WHEELS` (a
//! site-packages directory) or by `python3`; as the dynamic loader reads `LD_LIBRARY_PATH` only at start, xtask re-runs itself with the wheel's
//! `nvidia/cuda_nvrtc/lib` prepended to it when it is not there yet.
//!
//! Then it checks the specialized steps' static gates on the committed PTX (`lpmm_cuda::sass`:
//! `ptxas -v`'s registers, stack frame and spills; from the SASS of the pinned `nvdisasm`,
//! 128-bit accesses, barriers and each kernel's fast-path instructions per element against its
//! budget) and fails if one breaks them.
//!
//! - `--check`: writes nothing; fails, naming the architectures, if the committed PTX differs.
//! - `--report`: prints the figures for every architecture, where each fast path's instructions
//!   go (from a build with line information) and the issue-rate model's estimate of each kernel
//!   at 1e9 parameters on an H200 (`--calibration FILE`: the rate a device run measured).
//! - `--json FILE`: writes the figures as JSON.
//!
//! `gpu-bundle` builds every GPU test binary and the GPU example on a machine without a GPU or a
//! CUDA toolkit, and packs them with `xtask/gpu-run.sh`, which runs them on a GPU machine
//! (`target/gpu-bundle/bundle.tar.xz`; how: `gpu_bundle.rs`).

mod gpu_bundle;
mod kernels;

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// Project automation.
#[derive(Debug, clap::Parser)]
#[command(name = "cargo xtask")]
enum Task {
    /// Runs the criterion benches and writes target/lpmm-report/bench.json and bench.md.
    Bench {
        /// A smoke run.
        #[arg(long)]
        quick: bool,
        /// Add torch's fused AdamW and bitsandbytes' AdamW8bit from a venv it creates.
        #[arg(long)]
        peers: bool,
        /// Rebuild the report from the last run, measuring nothing.
        #[arg(long)]
        report_only: bool,
        /// Only the cases whose id contains this.
        filter: Option<String>,
    },
    /// Builds (checks) lpmm-cuda's PTX with the pinned NVRTC wheel, and checks the specialized
    /// steps' static gates (their instruction budgets included).
    Kernels {
        /// Check instead of writing.
        #[arg(long)]
        check: bool,
        /// Print the specialized steps' static figures (ptxas -v, SASS), where their
        /// instructions go and the issue-rate model's estimates.
        #[arg(long)]
        report: bool,
        /// With `--report`: the model's rate from a device run (crates/lpmm-cuda/gpu/run.sh's
        /// calibration.json: `rate_warp_instructions_per_s`) instead of the H200's default.
        #[arg(long)]
        calibration: Option<PathBuf>,
        /// Also write the figures as JSON (what crates/lpmm-cuda/gpu/prepare.sh stages for the
        /// device run's calibration).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Builds the GPU test binaries and the GPU example, without a GPU or a CUDA toolkit, into
    /// target/gpu-bundle/bundle.tar.xz, run on a GPU machine by xtask/gpu-run.sh.
    GpuBundle,
    /// Writes (checks) the backends' kernel programs.
    Codegen {
        /// Check instead of writing.
        #[arg(long)]
        check: bool,
    },
}

fn main() -> ExitCode {
    let result = match <Task as clap::Parser>::parse() {
        Task::Bench {
            quick,
            peers,
            report_only,
            filter,
        } => bench(quick, peers, report_only, filter),
        Task::Kernels {
            check,
            report,
            calibration,
            json,
        } => kernels::kernels(check, report, calibration.as_deref(), json.as_deref()),
        Task::Codegen { check } => codegen(check),
        Task::GpuBundle => gpu_bundle::gpu_bundle(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `codegen [--check]`: writes (checks) each backend's kernel program, assembled from its
/// sources and the ABI and dispatch generated from lpmm-backend's abi.rs and lpmm-optim's
/// registries (`lpmm_backend::codegen::TARGETS`), and docs/REGISTRIES.md, the registries' lists
/// and counts (`lpmm_optim::testing::registries_doc`).
fn codegen(check: bool) -> Result<(), String> {
    let root = workspace_root();
    let read = |p: &Path| std::fs::read_to_string(p);
    let doc = lpmm_optim::testing::registries_doc();
    let path = root.join(lpmm_optim::testing::REGISTRIES_PATH);
    let fresh = read(&path).ok().as_deref() == Some(doc.as_str());
    if check && !fresh {
        return Err(format!(
            "{} is stale: it is not what lpmm-optim's registries generate; run `cargo xtask codegen` and commit the result",
            lpmm_optim::testing::REGISTRIES_PATH
        ));
    } else if !fresh {
        std::fs::write(&path, doc).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("{}: written", lpmm_optim::testing::REGISTRIES_PATH);
    } else {
        println!("{}: up to date", lpmm_optim::testing::REGISTRIES_PATH);
    }
    for target in lpmm_backend::codegen::TARGETS {
        if check {
            target.check(&root, &read)?;
            println!("{}: up to date", target.output);
        } else {
            let program = target.generate(&root, &read)?;
            let path = root.join(target.output);
            if std::fs::read_to_string(&path).ok().as_deref() != Some(program.as_str()) {
                std::fs::write(&path, program)
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                println!("{}: written", target.output);
            } else {
                println!("{}: up to date", target.output);
            }
        }
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn clear(dir: &Path) -> Result<(), String> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Cargo's target directory: `CARGO_TARGET_DIR` (relative to the workspace root, where the
/// benches run) or `target/`. Criterion writes its results there, so the report reads them there.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| root.join("target"), |d| root.join(d))
}

/// The bench targets of `benches/` (`cargo xtask bench` runs them all).
const BENCHES: [&str; 5] = ["formats", "quant", "optim", "wgpu", "act"];

fn bench(
    mut quick: bool,
    peers: bool,
    report_only: bool,
    filter: Option<String>,
) -> Result<(), String> {
    let root = workspace_root();
    let target = target_dir(&root);
    let report = target.join("lpmm-report");
    let cases_dir = report.join("cases");
    let mut cpu = cpu_name();
    if report_only {
        // The report describes the run it is rebuilt from (its kind and the CPU it ran on).
        let earlier = read_json(&report.join("bench.json"));
        quick = earlier
            .as_ref()
            .and_then(|j| j["quick"].as_bool())
            .unwrap_or(quick);
        if let Some(c) = earlier.as_ref().and_then(|j| j["cpu"].as_str()) {
            cpu = c.to_string();
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    if !report_only {
        // Results of earlier runs would be reported as if measured now.
        clear(&target.join("criterion"))?;
        clear(&cases_dir)?;
        std::fs::create_dir_all(&cases_dir).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(&root)
            // `--workspace` (only lpmm-benches has bench targets): features unify as in the
            // README's `cargo test --workspace --release`, so the bench profile (which inherits
            // release) reuses that build's dependencies instead of compiling candle and wgpu a
            // second time. burn's stack is the exception: the bench profile builds it at
            // opt-level 3 (the release profile leaves it unoptimised for the tests; see the
            // workspace's Cargo.toml) so that burn's peer is measured as burn users build it. The
            // smoke run measures nothing and benches with the release profile, reusing the test
            // build whole.
            .args(["bench", "--workspace", "--locked"])
            .args(
                quick
                    .then_some(["--profile", "release"])
                    .into_iter()
                    .flatten(),
            )
            .args(BENCHES.iter().flat_map(|b| ["--bench", b]))
            .args(["--features", "lpmm-benches/burn"])
            .arg("--")
            .arg("--noplot")
            .args(quick.then_some("--quick"))
            .env("LPMM_BENCH_CASES", &cases_dir)
            .env("LPMM_BENCH_QUICK", if quick { "1" } else { "0" });
        if let Some(f) = &filter {
            cmd.arg(f);
        }
        run(&mut cmd, "cargo bench")?;
    }
    let mut cases = read_cases(&target.join("criterion"), &cases_dir)?;
    if peers {
        if !report_only {
            run_python_peers(&root, &cases)?;
        }
        cases.extend(python_peers(&root)?);
    }
    let memory = peak_memory(&root, &cargo);
    finish(&mut cases);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let json = json!({
        "schema": 1,
        "quick": quick,
        "threads": threads,
        "cpu": cpu,
        "cases": cases,
        "memory": memory,
    });
    let table = markdown(&cpu, &cases, memory.as_ref());
    std::fs::write(
        report.join("bench.json"),
        serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(report.join("bench.md"), &table).map_err(|e| e.to_string())?;
    println!(
        "\n{table}\n(written to {} and bench.md)",
        report.join("bench.json").display()
    );
    Ok(())
}

fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed: {status}"))
    }
}

fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// Criterion's median time and fastest sample (ns per iteration) of every case, by full id.
fn criterion_times(dir: &Path, out: &mut BTreeMap<String, (f64, f64)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.ends_with("new") {
            if let (Some(est), Some(meta)) = (
                read_json(&path.join("estimates.json")),
                read_json(&path.join("benchmark.json")),
            ) && let (Some(ns), Some(id)) = (
                est["median"]["point_estimate"].as_f64(),
                meta["full_id"].as_str(),
            ) {
                let fastest = read_json(&path.join("sample.json"))
                    .and_then(|s| {
                        let (iters, times) = (s["iters"].as_array()?, s["times"].as_array()?);
                        iters
                            .iter()
                            .zip(times)
                            .filter_map(|(i, t)| Some(t.as_f64()? / i.as_f64()?))
                            .reduce(f64::min)
                    })
                    .unwrap_or(ns);
                out.insert(id.to_string(), (ns, fastest));
            }
        } else if path.is_dir() {
            criterion_times(&path, out);
        }
    }
}

/// Every case that has both a timing and a sidecar.
fn read_cases(criterion: &Path, sidecars: &Path) -> Result<Vec<Value>, String> {
    let mut times = BTreeMap::new();
    criterion_times(criterion, &mut times);
    let mut cases = Vec::new();
    let entries = std::fs::read_dir(sidecars).map_err(|e| e.to_string())?;
    for entry in entries.flatten() {
        let Some(side) = read_json(&entry.path()) else {
            continue;
        };
        let (Some(id), Some(params)) = (side["id"].as_str(), side["params"].as_f64()) else {
            continue;
        };
        let Some(&(median, fastest)) = times.get(id) else {
            continue; // filtered out of this run
        };
        // A ceiling is the fastest the machine moved those bytes: its fastest sample. Everything
        // else is its median.
        let ns = if side["kind"] == "ceiling" {
            fastest
        } else {
            median
        };
        let bytes = side["bytes_per_param"].as_f64().unwrap_or(0.0);
        cases.push(json!({
            "name": id,
            "kind": side["kind"],
            "preset": side["preset"],
            "params": params as u64,
            "ns_per_param": ns / params,
            "bytes_per_param": bytes,
            "gbps": bytes * params / ns,
            "ceiling": side["ceiling"],
        }));
    }
    if cases.is_empty() {
        return Err("no bench results with sidecars (did the benches run?)".into());
    }
    Ok(cases)
}

/// Fills `ceiling_gbps`, `ratio_to_ceiling` and `peer_ratios`, and sorts the cases.
fn finish(cases: &mut [Value]) {
    let gbps: BTreeMap<String, f64> = cases
        .iter()
        .filter_map(|c| Some((c["name"].as_str()?.to_string(), c["gbps"].as_f64()?)))
        .collect();
    // Optimizer peers (those with a preset); a per-layer twin (`act/*_f32`) has none.
    let peers: Vec<(String, u64, f64)> = cases
        .iter()
        .filter(|c| c["kind"] == "peer" && !c["preset"].is_null())
        .filter_map(|c| {
            let name = c["name"].as_str()?.split('/').nth(1)?.to_string();
            Some((name, c["params"].as_u64()?, c["ns_per_param"].as_f64()?))
        })
        .collect();
    for c in cases.iter_mut() {
        let ceiling = c["ceiling"].as_str().and_then(|n| gbps.get(n)).copied();
        if let (Some(ceil), Some(g)) = (ceiling, c["gbps"].as_f64()) {
            c["ceiling_gbps"] = json!(ceil);
            c["ratio_to_ceiling"] = json!(g / ceil);
        }
        // Peer ratios for optimizer steps (cases with a preset), not for per-layer kernels.
        if c["kind"] == "lpmm" && !c["preset"].is_null() {
            let (params, ns) = (c["params"].as_u64(), c["ns_per_param"].as_f64());
            let mut ratios = serde_json::Map::new();
            for (name, p, peer_ns) in &peers {
                if Some(*p) == params
                    && let Some(ns) = ns
                {
                    ratios.insert(name.clone(), json!(peer_ns / ns));
                }
            }
            c["peer_ratios"] = Value::Object(ratios);
        }
    }
    cases.sort_by_key(|c| {
        (
            c["name"]
                .as_str()
                .unwrap_or("")
                .split('/')
                .next()
                .unwrap_or("")
                .to_string(),
            c["params"].as_u64().unwrap_or(0),
            c["name"].as_str().unwrap_or("").to_string(),
        )
    });
}

/// Runs `xtask/peers.py` (torch's fused AdamW and bitsandbytes' AdamW8bit) at the sizes of the
/// step cases; it writes `target/lpmm-report/peers.json`.
fn run_python_peers(root: &Path, cases: &[Value]) -> Result<(), String> {
    let python = match std::env::var_os("LPMM_PEERS_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => {
            let venv = target_dir(root).join("peers-venv");
            let python = venv.join("bin/python");
            if !python.exists() {
                run(
                    Command::new("python3").args(["-m", "venv"]).arg(&venv),
                    "python3 -m venv",
                )?;
                run(
                    Command::new(&python).args([
                        "-m",
                        "pip",
                        "install",
                        "--quiet",
                        "--no-cache-dir",
                        "torch",
                        "bitsandbytes==0.50.2",
                        "numpy",
                    ]),
                    "pip install torch bitsandbytes",
                )?;
            }
            python
        }
    };
    let mut sizes: Vec<u64> = cases
        .iter()
        .filter(|c| {
            c["kind"] == "lpmm" && c["name"].as_str().is_some_and(|n| n.starts_with("step/"))
        })
        .filter_map(|c| c["params"].as_u64())
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let list: Vec<String> = sizes.iter().map(u64::to_string).collect();
    let out = target_dir(root).join("lpmm-report/peers.json");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    run(
        Command::new(&python)
            .arg(root.join("xtask/peers.py"))
            .args([
                "--sizes",
                &list.join(","),
                "--threads",
                &threads.to_string(),
                "--out",
            ])
            .arg(&out),
        "xtask/peers.py",
    )
}

/// The cases of `target/lpmm-report/peers.json`.
fn python_peers(root: &Path) -> Result<Vec<Value>, String> {
    let out = target_dir(root).join("lpmm-report/peers.json");
    let result = read_json(&out).ok_or(format!("no {}", out.display()))?;
    let mut peers = Vec::new();
    for c in result["cases"].as_array().into_iter().flatten() {
        let (Some(peer), Some(params), Some(ns)) = (
            c["peer"].as_str(),
            c["params"].as_u64(),
            c["ns_per_param"].as_f64(),
        ) else {
            eprintln!("peer case without a timing: {c}");
            continue;
        };
        // Bytes per parameter from the formats: torch f32 AdamW reads parameter, gradient and
        // both states and writes parameter and states (28); bitsandbytes reads bf16 parameter and
        // gradient and 8-bit states with f32 absmax per 256, and writes parameter and states.
        let (bytes, preset) = match peer {
            "torch_fused_adamw_f32" => (28.0, "adamw_f32"),
            _ => (
                2.0 + 2.0 + 2.0 + 2.0 * (2.0 + 8.0 / 256.0),
                "adamw_8bit_bf16",
            ),
        };
        peers.push(json!({
            "name": format!("step/{peer}/{}", label(params)),
            "kind": "peer",
            "preset": preset,
            "params": params,
            "ns_per_param": ns,
            "bytes_per_param": bytes,
            "gbps": bytes / ns,
            "ceiling": null,
        }));
    }
    Ok(peers)
}

fn label(n: u64) -> String {
    if n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else {
        n.to_string()
    }
}

/// The peak-memory test's line (`peak resident ... accounted ...`), if it ran and passed.
fn peak_memory(root: &Path, cargo: &str) -> Option<Value> {
    let out = Command::new(cargo)
        .current_dir(root)
        .args([
            "test",
            "--release",
            "-p",
            "lpmm-optim",
            "--test",
            "peak_memory",
            "--",
            "--nocapture",
        ])
        .output()
        .ok()?;
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("peak_memory "))?;
    let value: Value = serde_json::from_str(line.trim_start_matches("peak_memory ")).ok()?;
    Some(json!({ "passed": out.status.success(), "measurement": value }))
}

/// The CPU the run measured, as precisely as `/proc/cpuinfo` tells it: the model name, family and
/// model (a VM's model name often leaves the microarchitecture out: "AMD EPYC"), the
/// microarchitecture where the family and model are known, and the SIMD level lpmm detected.
fn cpu_name() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let level = lpmm_formats::simd::detected().name();
    describe_cpu(&info, level)
}

fn describe_cpu(cpuinfo: &str, level: &str) -> String {
    let field = |name: &str| {
        cpuinfo
            .lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let name = field("model name").unwrap_or_else(|| "unknown".into());
    let number = |k: &str| field(k).and_then(|v| v.parse::<u32>().ok());
    let (Some(family), Some(model)) = (number("cpu family"), number("model")) else {
        return format!("{name} (SIMD level {level})");
    };
    let arch = match (field("vendor_id").as_deref(), family, model) {
        (Some("AuthenticAMD"), 25, 0x10..=0x1F | 0x60..=0x7F | 0xA0..=0xAF) => "Zen 4, ",
        (Some("AuthenticAMD"), 25, _) => "Zen 3, ",
        (Some("AuthenticAMD"), 26, _) => "Zen 5, ",
        (Some("GenuineIntel"), 6, 85) => "Skylake-SP/Cascade Lake, ",
        (Some("GenuineIntel"), 6, 106 | 108) => "Ice Lake-SP, ",
        (Some("GenuineIntel"), 6, 143) => "Sapphire Rapids, ",
        (Some("GenuineIntel"), 6, 207) => "Emerald Rapids, ",
        (Some("GenuineIntel"), 6, 173 | 174) => "Granite Rapids, ",
        _ => "",
    };
    format!("{name} ({arch}family {family}, model {model}; SIMD level {level})")
}

fn fmt(v: &Value, digits: usize) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:.digits$}"))
}

fn markdown(cpu: &str, cases: &[Value], memory: Option<&Value>) -> String {
    let peer_names = [
        "torch_fused_adamw_f32",
        "bnb_adamw8bit_bf16",
        "candle_adamw_f32",
        "burn_adamw_f32",
    ];
    let mut t = format!(
        "CPU: {cpu}\n\n| case | params | ns/param | bytes/param | GB/s | ceiling GB/s | of ceiling | ÷ torch fused f32 | ÷ bnb 8-bit | ÷ candle | ÷ burn |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for c in cases {
        let ratio = c["ratio_to_ceiling"]
            .as_f64()
            .map_or("-".into(), |r| format!("{:.0}%", 100.0 * r));
        let peers: Vec<String> = peer_names
            .iter()
            .map(|p| {
                c["peer_ratios"][p]
                    .as_f64()
                    .map_or("-".into(), |r| format!("{r:.2}x"))
            })
            .collect();
        t += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            c["name"].as_str().unwrap_or(""),
            c["params"],
            fmt(&c["ns_per_param"], 3),
            fmt(&c["bytes_per_param"], 2),
            fmt(&c["gbps"], 2),
            fmt(&c["ceiling_gbps"], 2),
            ratio,
            peers.join(" | "),
        );
    }
    t += &steps_table(cases);
    t += &levels_table(cases);
    if let Some(m) = memory {
        t += &format!(
            "\nPeak resident memory of a 100M-parameter optimizer (test `peak_memory`): {}\n",
            m["measurement"]
        );
    }
    t += "\nPeer ratios: the peer's time per parameter ÷ this case's (above 1: lpmm is faster), same size, same run.\n";
    t
}

/// A table cell: ns/param and the ratio to torch's fused f32 AdamW, when the run has it.
type Cell = (f64, Option<f64>);

/// Every optimizer step case at its best SIMD level and the peers, one row each, one column per
/// size: ns/param and, in brackets, its time ÷ torch's fused f32 AdamW's at that size (above 1:
/// slower than torch). Empty when the run has no step case.
fn steps_table(cases: &[Value]) -> String {
    // name -> params -> (ns/param, ÷ torch)
    let mut rows: BTreeMap<(u8, String), BTreeMap<u64, Cell>> = BTreeMap::new();
    for c in cases {
        let (Some(name), Some(kind)) = (c["name"].as_str(), c["kind"].as_str()) else {
            continue;
        };
        let mut parts = name.split('/');
        let (Some("step"), Some(case)) = (parts.next(), parts.next()) else {
            continue;
        };
        if kind == "ceiling" || case.contains('@') {
            continue;
        }
        let (Some(params), Some(ns)) = (c["params"].as_u64(), c["ns_per_param"].as_f64()) else {
            continue;
        };
        // A peer's own ratio to torch comes from torch's case at the same size.
        let torch = if case == "torch_fused_adamw_f32" {
            Some(1.0)
        } else {
            c["peer_ratios"]["torch_fused_adamw_f32"]
                .as_f64()
                .map(|r| 1.0 / r)
                .or_else(|| {
                    let t = cases.iter().find(|t| {
                        t["name"]
                            .as_str()
                            .is_some_and(|n| n.starts_with("step/torch_fused_adamw_f32/"))
                            && t["params"].as_u64() == Some(params)
                    })?;
                    Some(ns / t["ns_per_param"].as_f64()?)
                })
        };
        let order = u8::from(kind != "lpmm");
        rows.entry((order, case.to_string()))
            .or_default()
            .insert(params, (ns, torch));
    }
    let mut sizes: Vec<u64> = rows.values().flat_map(|r| r.keys().copied()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    if rows.is_empty() {
        return String::new();
    }
    let mut t = format!(
        "\nOptimizer steps at the best SIMD level, ns/param (time ÷ torch's fused f32 AdamW's at \
         that size):\n\n| case | {} |\n|---|{}\n",
        sizes
            .iter()
            .map(|&n| size_label(n))
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(sizes.len())
    );
    for ((_, case), v) in &rows {
        let cells: Vec<String> = sizes
            .iter()
            .map(|n| match v.get(n) {
                Some((ns, Some(r))) => format!("{ns:.3} ({r:.2}x)"),
                Some((ns, None)) => format!("{ns:.3}"),
                None => "-".into(),
            })
            .collect();
        t += &format!("| {case} | {} |\n", cells.join(" | "));
    }
    t
}

/// `1M` for 2^20 parameters, `256M` for 2^28; other counts as they are.
fn size_label(n: u64) -> String {
    const M: u64 = 1 << 20;
    if n.is_multiple_of(M) {
        format!("{}M", n / M)
    } else {
        n.to_string()
    }
}

/// The step cases run at lower SIMD levels and on the generic path (`step/<preset>@<variant>/
/// <size>`) beside their best-level case: ns/param and, in brackets, torch's fused f32 AdamW's
/// time ÷ this one's. Empty when the run has none.
fn levels_table(cases: &[Value]) -> String {
    // (preset, params) -> variant -> (ns/param, ÷ torch)
    let mut rows: BTreeMap<(String, u64), BTreeMap<String, Cell>> = BTreeMap::new();
    let mut variants: Vec<String> = Vec::new();
    for c in cases.iter().filter(|c| c["kind"] == "lpmm") {
        let Some(name) = c["name"].as_str() else {
            continue;
        };
        let mut parts = name.split('/');
        let (Some("step"), Some(case)) = (parts.next(), parts.next()) else {
            continue;
        };
        let (preset, variant) = case.split_once('@').unwrap_or((case, "best"));
        let (Some(params), Some(ns)) = (c["params"].as_u64(), c["ns_per_param"].as_f64()) else {
            continue;
        };
        let torch = c["peer_ratios"]["torch_fused_adamw_f32"].as_f64();
        rows.entry((preset.to_string(), params))
            .or_default()
            .insert(variant.to_string(), (ns, torch));
        if !variants.iter().any(|v| v == variant) {
            variants.push(variant.to_string());
        }
    }
    rows.retain(|_, v| v.len() > 1);
    if rows.is_empty() {
        return String::new();
    }
    // The best level first, then the forced ones from the highest, the generic path last.
    let rank = |v: &str| match v {
        "best" => 0,
        "generic" => 9,
        other => 8 - lpmm_formats::simd::Level::from_name(other).map_or(0, |l| l as i32),
    };
    variants.sort_by_key(|v| rank(v));
    let mut t = format!(
        "\nSIMD levels (`step/<preset>@<level>`: the level forced; `@generic`: the generic \
         element-wise path at the best level; `@skip_elements`: `NonFinitePolicy::SkipElements`, \
         no read of the gradient before the step), ns/param (torch's fused f32 AdamW ÷ this):\n\n| \
         preset | params | {} |\n|---|---|{}\n",
        variants.join(" | "),
        "---|".repeat(variants.len())
    );
    for ((preset, params), v) in &rows {
        let cells: Vec<String> = variants
            .iter()
            .map(|name| match v.get(name) {
                Some((ns, Some(r))) => format!("{ns:.3} ({r:.2}x)"),
                Some((ns, None)) => format!("{ns:.3}"),
                None => "-".into(),
            })
            .collect();
        t += &format!("| {preset} | {params} | {} |\n", cells.join(" | "));
    }
    t
}

#[cfg(test)]
mod tests {
    /// The CPU line names the microarchitecture a VM's model name leaves out.
    #[test]
    fn the_cpu_is_named_with_its_family_and_model() {
        let zen4 =
            "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n";
        assert_eq!(
            super::describe_cpu(zen4, "avx512vbmi"),
            "AMD EPYC (Zen 4, family 25, model 17; SIMD level avx512vbmi)"
        );
        let emr = "vendor_id : GenuineIntel\ncpu family : 6\nmodel : 207\nmodel name : Intel(R) Xeon(R)\n";
        assert!(super::describe_cpu(emr, "avx2").contains("Emerald Rapids, family 6, model 207"));
        assert_eq!(
            super::describe_cpu("", "portable"),
            "unknown (SIMD level portable)"
        );
    }

    use super::*;

    /// The levels table joins a preset's best-level case with its forced-level and generic
    /// twins at the same size, and leaves out what has no twin.
    #[test]
    fn the_levels_table_joins_twins() {
        let case = |name: &str, ns: f64, torch: f64| {
            json!({"name": name, "kind": "lpmm", "params": 1024, "ns_per_param": ns,
                   "peer_ratios": {"torch_fused_adamw_f32": torch}})
        };
        let cases = [
            case("step/adamw_8bit/1K", 1.0, 0.5),
            case("step/adamw_8bit@avx2/1K", 2.0, 0.25),
            case("step/adamw_8bit@generic/1K", 3.0, 0.2),
            case("step/lion_8bit/1K", 1.5, 0.4),
        ];
        let t = levels_table(&cases);
        assert!(
            t.contains("| preset | params | best | avx2 | generic |"),
            "{t}"
        );
        assert!(
            t.contains("| adamw_8bit | 1024 | 1.000 (0.50x) | 2.000 (0.25x) | 3.000 (0.20x) |"),
            "{t}"
        );
        assert!(!t.contains("lion_8bit"), "{t}");
        assert!(levels_table(&cases[3..]).is_empty());
    }

    /// The steps table has one row per best-level step case and peer, a column per size, and
    /// each lpmm cell's time ÷ torch's (the inverse of its peer ratio); forced levels, generic
    /// twins and ceilings stay out.
    #[test]
    fn the_steps_table_rows_are_cases() {
        let case = |name: &str, kind: &str, params: u64, ns: f64, torch: Option<f64>| {
            json!({"name": name, "kind": kind, "params": params, "ns_per_param": ns,
                   "peer_ratios": torch.map_or(json!({}), |t| json!({"torch_fused_adamw_f32": t}))})
        };
        let m = 1 << 20;
        let cases = [
            case("step/adamw_8bit/1M", "lpmm", m, 1.0, Some(0.5)),
            case("step/adamw_8bit/16M", "lpmm", 16 * m, 0.8, Some(0.5)),
            case("step/adamw_8bit@avx2/1M", "lpmm", m, 2.0, Some(0.25)),
            case("step/ceiling_adamw_8bit/1M", "ceiling", m, 0.1, None),
            case("step/torch_fused_adamw_f32/1M", "peer", m, 0.5, None),
            case("step/bnb_adamw8bit_bf16/1M", "peer", m, 10.0, None),
        ];
        let t = steps_table(&cases);
        assert!(t.contains("| case | 1M | 16M |"), "{t}");
        assert!(
            t.contains("| adamw_8bit | 1.000 (2.00x) | 0.800 (2.00x) |"),
            "{t}"
        );
        assert!(
            t.contains("| bnb_adamw8bit_bf16 | 10.000 (20.00x) | - |"),
            "{t}"
        );
        assert!(
            t.contains("| torch_fused_adamw_f32 | 0.500 (1.00x) | - |"),
            "{t}"
        );
        assert!(!t.contains("avx2") && !t.contains("ceiling"), "{t}");
        assert!(steps_table(&cases[3..4]).is_empty());
    }

    /// Every crate the release profile optimises less for the tests' build time (burn's stack at
    /// opt-level 0, lpmm's burn integrations at 1), the bench profile optimises again, so that
    /// benches and measured examples run burn as burn users build it; and no other crate's
    /// optimisation is changed.
    #[test]
    fn burn_stack_is_optimised_for_benches() {
        let manifest =
            std::fs::read_to_string(workspace_root().join("Cargo.toml")).expect("Cargo.toml");
        let mut levels: BTreeMap<(String, String), String> = BTreeMap::new();
        let mut table: Option<(String, String)> = None;
        for line in manifest.lines().map(str::trim) {
            if let Some(header) = line.strip_prefix('[') {
                table = header
                    .trim_end_matches(']')
                    .strip_prefix("profile.")
                    .and_then(|rest| rest.split_once(".package."))
                    .map(|(profile, package)| (profile.to_string(), package.to_string()));
            } else if let (Some(t), Some(level)) = (&table, line.strip_prefix("opt-level = ")) {
                levels.insert(t.clone(), level.to_string());
            }
        }
        let of = |profile: &str, level: &str| -> Vec<String> {
            levels
                .iter()
                .filter(|((p, _), l)| p == profile && l.as_str() == level)
                .map(|((_, package), _)| package.clone())
                .collect()
        };
        let lowered = of("release", "0");
        assert!(
            lowered.iter().any(|p| p == "burn-ndarray"),
            "expected burn's stack at opt-level 0 in the release profile: {lowered:?}"
        );
        let glue = of("release", "1");
        assert_eq!(
            glue,
            ["lpmm-act-burn", "lpmm-burn"],
            "lpmm's burn integrations, and only they, at opt-level 1 in release"
        );
        let mut restored = lowered;
        restored.extend(glue);
        restored.sort();
        assert_eq!(
            restored,
            of("bench", "3"),
            "the bench profile must restore opt-level 3 for exactly the crates release lowers"
        );
        let others: Vec<_> = levels
            .iter()
            .filter(|((p, _), l)| {
                !matches!(
                    (p.as_str(), l.as_str()),
                    ("release", "0" | "1") | ("bench", "3")
                )
            })
            .collect();
        assert!(
            others.is_empty(),
            "only burn's stack and lpmm's burn integrations have a package opt-level: {others:?}"
        );
    }

    /// `cargo xtask bench` names every bench target of `benches/Cargo.toml`, and only those.
    #[test]
    fn every_bench_target_is_run() {
        let manifest = std::fs::read_to_string(workspace_root().join("benches/Cargo.toml"))
            .expect("benches/Cargo.toml");
        let mut declared = Vec::new();
        let mut in_bench = false;
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                in_bench = line == "[[bench]]";
            } else if in_bench && let Some(name) = line.strip_prefix("name = ") {
                declared.push(name.trim_matches('"').to_string());
            }
        }
        declared.sort();
        let mut run: Vec<String> = BENCHES.iter().map(|b| b.to_string()).collect();
        run.sort();
        assert_eq!(run, declared, "update BENCHES in xtask/src/main.rs");
    }
}
