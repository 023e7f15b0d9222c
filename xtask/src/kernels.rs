//! `cargo xtask kernels`: the committed PTX built by the pinned NVRTC from the CUDA program,
//! checked against it (`--check`), and the specialized steps' static gates and report.

use std::path::Path;
use std::process::Command;

use super::*;

/// Set in the environment of the re-run with `LD_LIBRARY_PATH` (so it happens once).
const REEXEC_GUARD: &str = "LPMM_XTASK_NVRTC_REEXEC";

pub(crate) fn kernels(
    check: bool,
    report: bool,
    calibration: Option<&Path>,
    json: Option<&Path>,
) -> Result<(), String> {
    use lpmm_cuda::kernels;
    let wheels = kernels::wheel_paths().map_err(|e| e.to_string())?;
    // NVRTC is loaded by name, through LD_LIBRARY_PATH as it was when the process started.
    let ld_path = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    if !std::env::split_paths(&ld_path).any(|p| p == wheels.nvrtc_lib) {
        if std::env::var_os(REEXEC_GUARD).is_some() {
            return Err(format!(
                "{} is still not on LD_LIBRARY_PATH after re-running xtask",
                wheels.nvrtc_lib.display()
            ));
        }
        let paths =
            std::iter::once(wheels.nvrtc_lib.clone()).chain(std::env::split_paths(&ld_path));
        let ld_path = std::env::join_paths(paths).map_err(|e| e.to_string())?;
        let exe =
            std::env::current_exe().map_err(|e| format!("cannot find xtask's binary: {e}"))?;
        let status = Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env("LD_LIBRARY_PATH", ld_path)
            .env(REEXEC_GUARD, "1")
            .status()
            .map_err(|e| format!("cannot re-run xtask: {e}"))?;
        std::process::exit(status.code().unwrap_or(1));
    }
    let (major, minor) = kernels::nvrtc_version().map_err(|e| e.to_string())?;
    println!(
        "NVRTC {major}.{minor} from {}, headers from {}",
        wheels.nvrtc_lib.display(),
        wheels.include.display()
    );
    let root = workspace_root();
    let ptx_dir = root.join("crates/lpmm-cuda/ptx");
    let tmp = root.join("target/tmp/xtask-kernels");
    std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let mut differ = Vec::new();
    for (arch, committed) in kernels::ARCHS {
        let ptx = kernels::compile(arch, &wheels.include_dirs()).map_err(|e| e.to_string())?;
        let path = ptx_dir.join(format!("lpmm.{arch}.ptx"));
        // The committed file as it is now (`ARCHS` holds it as xtask was built).
        let current = std::fs::read_to_string(&path).unwrap_or_else(|_| committed.to_string());
        if check {
            let verdict = if current == ptx {
                "up to date"
            } else {
                "DIFFERS"
            };
            println!("{arch}: {verdict}");
            if current != ptx {
                differ.push(arch);
            }
            continue;
        }
        // The PTX must assemble before it is committed.
        let built = tmp.join(format!("lpmm.{arch}.ptx"));
        std::fs::write(&built, &ptx).map_err(|e| e.to_string())?;
        kernels::assemble(
            &wheels.ptxas,
            arch,
            &built,
            &tmp.join(format!("lpmm.{arch}.cubin")),
        )?;
        if current == ptx {
            println!("{arch}: up to date");
        } else {
            std::fs::write(&path, &ptx)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            println!("{arch}: wrote {}", path.display());
        }
    }
    // The gates run on the committed PTX, also with `--check` (CI): a kernel over its
    // instruction budget fails the build.
    let gates = static_report(&wheels, &ptx_dir, &tmp, report, calibration, json);
    if differ.is_empty() {
        gates?;
        Ok(())
    } else {
        Err(format!(
            "the committed PTX of {} differs from what NVRTC builds from kernels/lpmm.generated.cu: run \
             `cargo xtask kernels` and commit crates/lpmm-cuda/ptx/",
            differ.join(", ")
        ))
    }
}

/// The specialized steps' static gates for every architecture (the committed PTX assembled by
/// ptxas, its SASS read with nvdisasm); with `report`, their figures as tables: the gates', where
/// the fast paths' instructions go (a build with line information, checked to count the same),
/// and the issue-rate model's estimates (`calibration`: a device run's rate). `json`: the figures
/// as JSON.
fn static_report(
    wheels: &lpmm_cuda::kernels::WheelPaths,
    ptx_dir: &Path,
    tmp: &Path,
    report: bool,
    calibration: Option<&Path>,
    json: Option<&Path>,
) -> Result<(), String> {
    use lpmm_cuda::sass;
    let mut all = Vec::new();
    for (arch, _) in lpmm_cuda::kernels::ARCHS.iter().rev() {
        let ptx = ptx_dir.join(format!("lpmm.{arch}.ptx"));
        all.extend(sass::figures(
            &wheels.ptxas,
            &wheels.nvdisasm,
            arch,
            &ptx,
            tmp,
        )?);
    }
    if let Some(path) = json {
        let rows: Vec<Value> = all
            .iter()
            .map(|f| {
                json!({
                    "kernel": f.name,
                    "arch": f.arch,
                    "per_element": f.per_element(),
                    "budget": f.budget,
                    "with_cold_paths": f.cold_per_element(),
                    "registers": f.resources.registers,
                })
            })
            .collect();
        let doc = json!({
            "command": sass::COMMAND,
            "model_rate_warp_instructions_per_s": sass::lines::H200_RATE,
            "torch_f32_ms_1e9": sass::lines::TORCH_F32_MS,
            "kernels": rows,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if report {
        println!("{}", sass::table(&all));
        let mut rows = Vec::new();
        for (arch, _) in lpmm_cuda::kernels::ARCHS.iter().rev() {
            let ptx = lpmm_cuda::kernels::compile_with_lines(arch, &wheels.include_dirs())
                .map_err(|e| e.to_string())?;
            let path = tmp.join(format!("lpmm.{arch}.lineinfo.ptx"));
            std::fs::write(&path, ptx).map_err(|e| e.to_string())?;
            rows.extend(sass::breakdowns(
                &wheels.ptxas,
                &wheels.nvdisasm,
                arch,
                &path,
                tmp,
                lpmm_cuda::kernels::SOURCE,
            )?);
        }
        for (name, arch, per, _) in &rows {
            let committed = all
                .iter()
                .find(|f| &f.name == name && &f.arch == arch)
                .map_or(f64::NAN, |f| f.per_element());
            if (committed - per).abs() > 1e-9 {
                println!(
                    "note: {name} ({arch}): the line-information build's fast path has {per:.2} \
                     instructions per element, the committed build's {committed:.2}"
                );
            }
        }
        println!(
            "Where the fast path's instructions go, per element (`// sass:` regions of the \
             kernel sources; a build with line information):\n"
        );
        println!("{}", sass::lines::breakdown_table(&rows));
        let rate = match calibration {
            None => sass::lines::H200_RATE,
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                let v: Value =
                    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
                v["rate_warp_instructions_per_s"].as_f64().ok_or_else(|| {
                    format!(
                        "{}: no rate_warp_instructions_per_s (a dry run measures none)",
                        path.display()
                    )
                })?
            }
        };
        println!("{}", sass::lines::summary(&all, rate));
    }
    let broken: Vec<String> = all
        .iter()
        .flat_map(|f| {
            f.violations()
                .into_iter()
                .map(move |v| format!("{} ({}): {v}", f.name, f.arch))
        })
        .collect();
    if broken.is_empty() {
        println!(
            "every specialized step meets its static gates ({} kernels, {} architectures)",
            all.len() / lpmm_cuda::kernels::ARCHS.len(),
            lpmm_cuda::kernels::ARCHS.len()
        );
        Ok(())
    } else {
        Err(format!(
            "static gates broken (`{}` prints the figures):\n{}",
            sass::COMMAND,
            broken.join("\n")
        ))
    }
}
