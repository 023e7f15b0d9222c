//! `cargo xtask gpu-bundle`: builds, on a machine without a GPU or a CUDA toolkit, every GPU test
//! binary and the GPU example, and packs them with the script that runs them
//! (`xtask/gpu-run.sh`) into `target/gpu-bundle/bundle.tar.xz`, for a GPU machine that has no
//! Rust toolchain (it has a CUDA driver and PyTorch's CUDA 13 libraries).
//!
//! What it builds (release profile, its own target directory `target/gpu-bundle/cargo`; two cargo
//! invocations, see below):
//!
//! | binary | crate, target | features |
//! |---|---|---|
//! | `lpmm-cuda-parity` | lpmm-cuda, `tests/parity.rs` | |
//! | `lpmm-candle-cuda` | lpmm-candle, `tests/cuda.rs` | `cuda` |
//! | `lpmm-burn-burn` | lpmm-burn, `tests/burn` (its `cuda` module) | `cuda-nvrtc` |
//! | `lpmm-dist-nccl` | lpmm-dist, `tests/nccl.rs` | `nccl` |
//! | `lpmm-candle-examples-gpt` | lpmm-candle-examples, `examples/gpt.rs` | `cuda` |
//!
//! **Two builds.** candle's `cuda` asks cudarc for `dynamic-linking`, and cubecl-cuda 0.11.3
//! calls cudarc's `is_culib_present`, which exists only where cudarc loads the libraries at run
//! time (`dynamic-loading`, the workspace's `fallback-dynamic-loading`): candle's and burn's CUDA
//! backends do not compile in one build; nor does lpmm-cuda's feature `nvrtc` (its tests turn it
//! on) beside candle's, nor lpmm-dist's `nccl` (it asks cudarc whether NCCL and the driver load).
//! So lpmm-burn's, lpmm-cuda's and lpmm-dist's tests are built by a cargo invocation of their own
//! (`Build::Burn`: nothing CUDA is linked, cudarc loads it at run time), candle's and the example
//! by the first (`Build::Candle`).
//!
//! How it builds them without a GPU or a toolkit:
//!
//! - **nvcc** (candle-kernels compiles candle's kernels at build time): NVIDIA's CUDA 13.0 split
//!   pip wheels ([`WHEELS`]) in a venv at `target/gpu-venv`, whose `nvidia/cu13` prefix is a
//!   toolkit for nvcc (`NVCC`, `CUDA_HOME`; `CUDA_COMPUTE_CAP=90`, the H100/H200's sm_90). CUDA
//!   13.0, not newer: the PTX must load on the GPU machine's driver (R580: CUDA 13.0).
//! - **Link-time libraries** (`target/gpu-bundle/link`, on the linker's path through
//!   `RUSTFLAGS`): candle asks cudarc for `dynamic-linking`, so the binaries link libcuda,
//!   libcudart, libcublas, libcublasLt, libcurand, libnvrtc.
//!   No wheel ships libcuda (the driver does): a stub library defining every driver function
//!   cudarc declares, under the driver's soname `libcuda.so.1`, is generated from cudarc's
//!   bindings; the others are the wheels' own libraries (sonames `libcublas.so.13` and so on,
//!   PyTorch's CUDA 13 libraries on the GPU machine). Nothing is linked statically from them.
//! - **burn's CUDA backend without cubecl's LLVM.** cubecl-cuda 0.11.3 always compiles its LLVM
//!   backend (its dependency on cubecl-llvm is not optional); cubecl-llvm's build script, through
//!   tracel-llvm-bundler, downloads a prebuilt LLVM from GitHub and links it. Both skip that under
//!   `DOCS_RS=1` (their docs.rs path), which this build sets; the LLVM functions the LLVM backend
//!   calls (llvm-sys's declarations and cubecl-llvm's C++ shims) are then defined by a stub
//!   object (each aborts with a message), generated from those crates' sources and linked into
//!   every binary. lpmm-burn's feature `cuda-nvrtc` turns on cubecl-cuda's `cpp`, which makes
//!   the CUDA C++ backend (NVRTC at run time) the one that runs, so the stubs are never called.
//!   cubecl's NVRTC compiles include the CUDA headers (`CUDA_PATH/include`): the bundle carries
//!   the runtime wheel's headers for a GPU machine without them.
//!
//! The bundle: `bin/` (the binaries, debug info stripped), `include/` (the CUDA headers),
//! `run.sh` (`xtask/gpu-run.sh`) and `manifest.txt` (the commit and what was built). On the
//! GPU machine: `bash xtask/gpu-run.sh target/gpu-bundle/bundle.tar.xz` writes every log and
//! result under `$OUT`.

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The pinned CUDA 13.0 wheels: nvcc and what it needs (candle-kernels), and the libraries the
/// binaries link.
pub const WHEELS: [&str; 9] = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-runtime==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cuda-nvrtc==13.0.88",
    "nvidia-cublas==13.0.0.19",
    "nvidia-curand==10.4.0.35",
    "nvidia-nccl-cu13==2.27.7",
];

/// The GPU machine's architecture (H100, H200).
const COMPUTE_CAP: &str = "90";

/// One cargo invocation of the bundle.
#[derive(Debug, Clone, Copy)]
enum Build {
    /// candle's CUDA backend (cudarc `dynamic-linking`).
    Candle,
    /// burn's CUDA backend, lpmm-cuda's and lpmm-dist's NCCL tests (cudarc loads CUDA at run
    /// time).
    Burn,
}

impl Build {
    /// Its features.
    fn features(self) -> &'static str {
        match self {
            Build::Candle => "lpmm-candle/cuda,lpmm-candle-examples/cuda",
            Build::Burn => "lpmm-burn/cuda-nvrtc,lpmm-dist/nccl",
        }
    }

    /// Its test targets (package, test).
    fn tests(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Build::Candle => &[("lpmm-candle", "cuda")],
            Build::Burn => &[
                ("lpmm-cuda", "parity"),
                ("lpmm-burn", "burn"),
                ("lpmm-dist", "nccl"),
            ],
        }
    }

    /// Its examples (package, example).
    fn examples(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Build::Candle => &[("lpmm-candle-examples", "gpt")],
            Build::Burn => &[],
        }
    }
}

/// The bundle's size limit: what one device call carries (64 MiB), with room for the script.
const MAX_BUNDLE: u64 = 60 << 20;

fn sh(cmd: &mut Command, what: &str) -> Result<(), String> {
    super::run(cmd, what)
}

/// `cargo xtask gpu-bundle`.
pub fn gpu_bundle() -> Result<(), String> {
    let root = super::workspace_root();
    let dir = root.join("target/gpu-bundle");
    let site = venv(&root.join("target/gpu-venv"))?;
    let cu13 = site.join("nvidia/cu13");
    let link = dir.join("link");
    std::fs::create_dir_all(&link).map_err(|e| format!("cannot create {}: {e}", link.display()))?;
    let sources = crate_sources(&root)?;
    stubs(&link, &sources)?;
    libraries(&link, &site)?;
    let mut built = build(&root, &dir, &cu13, &link, Build::Candle)?;
    built.extend(build(&root, &dir, &cu13, &link, Build::Burn)?);
    pack(&root, &dir, &cu13, &built)
}

/// The venv with [`WHEELS`], created or completed; its site-packages directory.
fn venv(venv: &Path) -> Result<PathBuf, String> {
    let python = venv.join("bin/python");
    if !python.exists() {
        sh(
            Command::new("python3").args(["-m", "venv"]).arg(venv),
            "python3 -m venv",
        )?;
    }
    let stamp = venv.join("lpmm-wheels.txt");
    let want = WHEELS.join("\n");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(want.as_str()) {
        sh(
            Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(WHEELS),
            "pip install (the CUDA 13.0 wheels)",
        )?;
        std::fs::write(&stamp, want)
            .map_err(|e| format!("cannot write {}: {e}", stamp.display()))?;
    }
    let out = Command::new(&python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .map_err(|e| format!("cannot run the venv's python: {e}"))?;
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The source directories of the locked dependencies, by package name (every version).
fn crate_sources(root: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--all-features",
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err("cargo metadata failed".into());
    }
    let meta: Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata: {e}"))?;
    let mut v = Vec::new();
    for p in meta["packages"].as_array().into_iter().flatten() {
        if let (Some(name), Some(manifest)) = (p["name"].as_str(), p["manifest_path"].as_str())
            && let Some(dir) = Path::new(manifest).parent()
        {
            v.push((name.to_string(), dir.to_path_buf()));
        }
    }
    Ok(v)
}

/// Every `fn NAME(` in the `.rs` files under `dir` whose name starts with `prefix`, where the
/// line (indented) declares a foreign function (`fn`, not `pub fn` or `pub unsafe fn`).
fn declared(dir: &Path, prefix: &str, foreign_only: bool, out: &mut BTreeSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            declared(&p, prefix, foreign_only, out);
        } else if p.extension().is_some_and(|x| x == "rs")
            && let Ok(text) = std::fs::read_to_string(&p)
        {
            for line in text.lines() {
                let t = line.trim_start();
                let rest = if foreign_only {
                    t.strip_prefix("fn ").or_else(|| t.strip_prefix("pub fn "))
                } else {
                    t.strip_prefix("pub fn ")
                        .or_else(|| t.strip_prefix("fn "))
                        .or_else(|| t.strip_prefix("pub unsafe fn "))
                };
                let Some(rest) = rest else { continue };
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if name.starts_with(prefix) && rest[name.len()..].starts_with('(') {
                    out.insert(name);
                }
            }
        }
    }
}

fn source_of<'a>(sources: &'a [(String, PathBuf)], name: &str) -> Result<Vec<&'a Path>, String> {
    let dirs: Vec<&Path> = sources
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, d)| d.as_path())
        .collect();
    if dirs.is_empty() {
        return Err(format!("{name} is not in the locked dependency graph"));
    }
    Ok(dirs)
}

/// The generated stubs: `libcuda.so` (soname `libcuda.so.1`: cudarc's driver functions, each
/// returning an error) and `llvm_stub.o` (llvm-sys's functions and cubecl-llvm's shims, each
/// aborting).
fn stubs(link: &Path, sources: &[(String, PathBuf)]) -> Result<(), String> {
    let mut cuda = BTreeSet::new();
    for d in source_of(sources, "cudarc")? {
        declared(&d.join("src/driver/sys"), "cu", true, &mut cuda);
    }
    let mut c = String::from(
        "/* Generated by `cargo xtask gpu-bundle`: the CUDA driver functions cudarc declares, for\n   linking without a driver; the real libcuda.so.1 is loaded at run time. */\n",
    );
    for f in &cuda {
        c += &format!("int {f}(void) {{ return 999; }}\n");
    }
    write(&link.join("cuda_stub.c"), &c)?;
    sh(
        Command::new("cc")
            .args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"])
            .arg(link.join("libcuda.so"))
            .arg(link.join("cuda_stub.c")),
        "cc (the libcuda stub)",
    )?;

    let mut llvm = BTreeSet::new();
    for d in source_of(sources, "llvm-sys")? {
        declared(&d.join("src"), "LLVM", false, &mut llvm);
    }
    for d in source_of(sources, "cubecl-llvm")? {
        declared(&d.join("src"), "cubecl_", true, &mut llvm);
    }
    let mut c = String::from(
        "/* Generated by `cargo xtask gpu-bundle`: the LLVM functions of cubecl's LLVM backend,\n   which the bundle never runs (cubecl-cuda's `cpp` backend runs). */\n#include <stdio.h>\n#include <stdlib.h>\nstatic void stub(const char *n) { fprintf(stderr, \"lpmm gpu bundle: %s is a stub (cubecl's LLVM backend is not linked)\\n\", n); abort(); }\n",
    );
    for f in &llvm {
        c += &format!("void {f}(void) {{ stub(\"{f}\"); }}\n");
    }
    write(&link.join("llvm_stub.c"), &c)?;
    sh(
        Command::new("cc")
            .args(["-c", "-fPIC", "-O1", "-o"])
            .arg(link.join("llvm_stub.o"))
            .arg(link.join("llvm_stub.c")),
        "cc (the LLVM stub)",
    )?;
    println!(
        "gpu-bundle: stubs for {} driver and {} LLVM functions",
        cuda.len(),
        llvm.len()
    );
    Ok(())
}

/// `lib<name>.so` in `link` for each library the binaries link, pointing at the wheel's.
fn libraries(link: &Path, site: &Path) -> Result<(), String> {
    let libs = [
        ("cudart", "nvidia/cu13/lib"),
        ("cublas", "nvidia/cu13/lib"),
        ("cublasLt", "nvidia/cu13/lib"),
        ("curand", "nvidia/cu13/lib"),
        ("nvrtc", "nvidia/cu13/lib"),
        ("nccl", "nvidia/nccl/lib"),
    ];
    for (name, sub) in libs {
        let dir = site.join(sub);
        let prefix = format!("lib{name}.so.");
        let found = std::fs::read_dir(&dir)
            .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|f| f.starts_with(&prefix))
            .min_by_key(String::len)
            .ok_or_else(|| format!("no {prefix}* in {}", dir.display()))?;
        let to = link.join(format!("lib{name}.so"));
        let _ = std::fs::remove_file(&to);
        std::os::unix::fs::symlink(dir.join(&found), &to)
            .map_err(|e| format!("cannot link {}: {e}", to.display()))?;
    }
    Ok(())
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// One cargo build; the executables by bundle name.
fn build(
    root: &Path,
    dir: &Path,
    cu13: &Path,
    link: &Path,
    which: Build,
) -> Result<Vec<(String, PathBuf)>, String> {
    println!("gpu-bundle: building {which:?} ({})", which.features());
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root)
        .env("CARGO_TARGET_DIR", dir.join("cargo"))
        .env("DOCS_RS", "1")
        .env("CUDA_HOME", cu13)
        .env("NVCC", cu13.join("bin/nvcc"))
        .env("CUDA_COMPUTE_CAP", COMPUTE_CAP)
        .env(
            "RUSTFLAGS",
            format!(
                "-L native={} -C link-arg={}",
                link.display(),
                link.join("llvm_stub.o").display()
            ),
        )
        .args([
            "build",
            "--release",
            "--locked",
            "--message-format=json-render-diagnostics",
        ])
        .args(["--features", which.features()]);
    let mut packages = BTreeSet::new();
    for (p, t) in which.tests() {
        packages.insert(p);
        cmd.args(["--test", t]);
    }
    for (p, e) in which.examples() {
        packages.insert(p);
        cmd.args(["--example", e]);
    }
    for p in packages {
        cmd.args(["-p", p]);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo build: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo build (the GPU bundle) failed: {}",
            out.status
        ));
    }
    let mut built = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let (Some(exe), Some(target)) = (v["executable"].as_str(), v["target"]["name"].as_str())
        else {
            continue;
        };
        let package = v["package_id"].as_str().unwrap_or_default();
        for (p, t) in which.tests().iter().chain(which.examples()) {
            // A package id names the package's path (`path+file:///…/crates/<name>#…`).
            if *t == target && package.contains(&format!("/{p}#")) {
                built.push((format!("{p}-{t}"), PathBuf::from(exe)));
            }
        }
    }
    if built.len() != which.tests().len() + which.examples().len() {
        let names: Vec<&str> = built.iter().map(|(n, _)| n.as_str()).collect();
        return Err(format!("cargo built {names:?}, not every bundle target"));
    }
    Ok(built)
}

/// `target/gpu-bundle/out` and `bundle.tar.xz` from it.
fn pack(root: &Path, dir: &Path, cu13: &Path, built: &[(String, PathBuf)]) -> Result<(), String> {
    let out = dir.join("out");
    super::clear(&out)?;
    let bin = out.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| format!("cannot create {}: {e}", bin.display()))?;
    let mut manifest = String::new();
    let commit = Command::new("git")
        .current_dir(root)
        .args(["describe", "--always", "--dirty"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    manifest += &format!(
        "commit {commit}\nfeatures {} | {}\nCUDA_COMPUTE_CAP {COMPUTE_CAP}\nwheels {}\n",
        Build::Candle.features(),
        Build::Burn.features(),
        WHEELS.join(" ")
    );
    for (name, exe) in built {
        sh(
            Command::new("objcopy")
                .arg("--strip-debug")
                .arg(exe)
                .arg(bin.join(name)),
            "objcopy --strip-debug",
        )?;
        manifest += &format!("bin/{name} {}\n", exe.display());
    }
    write(&out.join("manifest.txt"), &manifest)?;
    std::fs::copy(root.join("xtask/gpu-run.sh"), out.join("run.sh"))
        .map_err(|e| format!("cannot copy xtask/gpu-run.sh: {e}"))?;
    sh(
        Command::new("cp")
            .arg("-r")
            .arg(cu13.join("include"))
            .arg(&out),
        "cp (the CUDA headers)",
    )?;
    let tar = dir.join("bundle.tar.xz");
    sh(
        Command::new("tar")
            .env("XZ_OPT", "-6 -T0")
            .arg("-cJf")
            .arg(&tar)
            .arg("-C")
            .arg(&out)
            .arg("."),
        "tar (the bundle)",
    )?;
    let size = std::fs::metadata(&tar)
        .map_err(|e| format!("cannot read {}: {e}", tar.display()))?
        .len();
    println!(
        "gpu-bundle: {} ({:.1} MiB): {}",
        tar.display(),
        size as f64 / (1 << 20) as f64,
        built
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "gpu-bundle: on the GPU machine (the repository's root, carrying target/gpu-bundle/bundle.tar.xz): bash xtask/gpu-run.sh target/gpu-bundle/bundle.tar.xz"
    );
    if size > MAX_BUNDLE {
        return Err(format!(
            "the bundle is {size} bytes, more than one device call carries ({MAX_BUNDLE})"
        ));
    }
    Ok(())
}
