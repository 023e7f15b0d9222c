//! The kernel program, the committed PTX built from it, and (feature `nvrtc`) the compilation
//! `cargo xtask kernels` runs and the PTX check repeats.
//!
//! The program (`kernels/lpmm.generated.cu`) is assembled by `cargo xtask codegen` from the
//! sources in `kernels/` (one file per concern, format and rule) and the ABI and dispatch that
//! lpmm-backend generates. NVRTC compiles it for each architecture in [`ARCHS`] with
//! [`nvrtc_options`]; the PTX is committed under `ptx/` and embedded here, so building this
//! crate needs no CUDA toolkit. The NVRTC version is pinned (the `nvidia-cuda-nvrtc-cu12` wheel,
//! see [`NVRTC_WHEEL`]) because it fixes the PTX ISA version, which a driver must support.

/// The CUDA C program of every kernel (self-contained: it includes nothing).
pub const SOURCE: &str = include_str!("../kernels/lpmm.generated.cu");

/// The architectures the PTX is built for, with their committed PTX.
pub const ARCHS: [(&str, &str); 2] = [
    ("sm_80", include_str!("../ptx/lpmm.sm_80.ptx")),
    ("sm_90", include_str!("../ptx/lpmm.sm_90.ptx")),
];

/// The pinned NVRTC wheel, the compiler of the committed PTX. Its version fixes the PTX ISA
/// version (12.4: `.version 8.4`), which the driver that loads the PTX must support.
pub const NVRTC_WHEEL: &str = "nvidia-cuda-nvrtc-cu12==12.4.127";

/// The pinned wheel of the CUDA runtime's headers (`nvidia/cuda_runtime/include`, passed to
/// NVRTC with `-I`).
pub const RUNTIME_WHEEL: &str = "nvidia-cuda-runtime-cu12==12.4.127";

/// The pinned wheel of nvcc's tools, for `ptxas` (`nvidia/cuda_nvcc/bin/ptxas`): the check that
/// the committed PTX assembles. (12.4.131: nvcc's last 12.4 release; there is no 12.4.127.)
pub const NVCC_WHEEL: &str = "nvidia-cuda-nvcc-cu12==12.4.131";

/// The pinned wheel of `nvdisasm` (`nvidia/cu13/bin/nvdisasm`), which prints the SASS of the
/// cubins ptxas assembles for the static gates of the specialized steps ([`crate::sass`]). NVIDIA
/// ships it only for CUDA 13 (it disassembles the 12.4 ptxas's sm_80 and sm_90 cubins).
pub const NVDISASM_WHEEL: &str = "nvidia-cuda-nvdisasm==13.4.92";

/// Every pinned wheel, as pip requirements (`.ci/run` installs these, read from this file).
pub const WHEELS: [&str; 4] = [NVRTC_WHEEL, RUNTIME_WHEEL, NVCC_WHEEL, NVDISASM_WHEEL];

/// The NVRTC version (major, minor) of [`NVRTC_WHEEL`]; `compile` (feature `nvrtc`) refuses any
/// other.
pub const NVRTC_VERSION: (i32, i32) = (12, 4);

/// The committed PTX for a device of compute capability `(major, minor)`: the newest built
/// architecture not above it (PTX is JIT-compiled forward), or `None` below sm_80.
pub fn ptx_for(major: i32, minor: i32) -> Option<(&'static str, &'static str)> {
    let cc = major * 10 + minor;
    ARCHS
        .iter()
        .rev()
        .find(|(arch, _)| arch[3..].parse::<i32>().is_ok_and(|a| a <= cc))
        .copied()
}

/// NVRTC's options for `arch` ("sm_80"). Floating point as the CPU reference computes it: no
/// contraction of `a * b + c` into fma (`--fmad=false`), IEEE division and square root, no
/// flush of subnormals.
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture=compute_{}", &arch[3..]),
        "--fmad=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--ftz=false".into(),
        "--std=c++17".into(),
    ]
}

/// The `pip install` line of the pinned wheels.
pub fn pip_install_line() -> String {
    format!("python3 -m pip install {}", WHEELS.join(" "))
}

/// Where the pinned wheels' files lie in a Python `site-packages` directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WheelPaths {
    /// The `site-packages` directory holding `nvidia/`.
    pub site_packages: std::path::PathBuf,
    /// `nvidia/cuda_nvrtc/lib`, holding `libnvrtc.so.12`: must be on `LD_LIBRARY_PATH` when the
    /// process starts (the dynamic loader reads it once), for `compile` (feature `nvrtc`) to
    /// find NVRTC.
    pub nvrtc_lib: std::path::PathBuf,
    /// `nvidia/cuda_runtime/include`: the CUDA headers.
    pub include: std::path::PathBuf,
    /// `nvidia/cuda_nvcc/bin/ptxas`.
    pub ptxas: std::path::PathBuf,
    /// `nvidia/cu13/bin/nvdisasm` ([`NVDISASM_WHEEL`]).
    pub nvdisasm: std::path::PathBuf,
}

impl WheelPaths {
    /// The paths under `site_packages`, if all of them exist; else what is missing.
    pub fn in_site_packages(site_packages: &std::path::Path) -> Result<Self, String> {
        let nvidia = site_packages.join("nvidia");
        let paths = Self {
            site_packages: site_packages.to_path_buf(),
            nvrtc_lib: nvidia.join("cuda_nvrtc/lib"),
            include: nvidia.join("cuda_runtime/include"),
            ptxas: nvidia.join("cuda_nvcc/bin/ptxas"),
            nvdisasm: nvidia.join("cu13/bin/nvdisasm"),
        };
        let missing: Vec<String> = [
            &paths.nvrtc_lib,
            &paths.include,
            &paths.ptxas,
            &paths.nvdisasm,
        ]
        .into_iter()
        .filter(|p| !p.exists())
        .map(|p| p.display().to_string())
        .collect();
        if missing.is_empty() {
            Ok(paths)
        } else {
            Err(format!("missing {}", missing.join(", ")))
        }
    }

    /// The include directories `compile` (feature `nvrtc`) is given: the runtime's headers.
    pub fn include_dirs(&self) -> Vec<std::path::PathBuf> {
        vec![self.include.clone()]
    }
}

/// The pinned wheels could not be located (see [`wheel_paths`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "the pinned CUDA wheels were not found ({searched}); install them with `{pip}` and point \
     LPMM_CUDA_WHEELS at that site-packages directory (or run with that python3 first on PATH)",
    pip = pip_install_line()
)]
pub struct WheelsNotFound {
    /// Where they were looked for, and what was missing there.
    pub searched: String,
}

/// Locates the pinned wheels' files: in the `site-packages` directory named by the environment
/// variable `LPMM_CUDA_WHEELS` if it is set, else wherever `python3` (the first on `PATH`)
/// imports the `nvidia` package from (the first of its paths that holds every pinned wheel).
/// Checks that the files exist, not the wheels' versions (`compile`, feature `nvrtc`, checks
/// NVRTC's).
pub fn wheel_paths() -> Result<WheelPaths, WheelsNotFound> {
    use std::path::{Path, PathBuf};
    if let Some(dir) = std::env::var_os("LPMM_CUDA_WHEELS").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        return WheelPaths::in_site_packages(&dir).map_err(|why| WheelsNotFound {
            searched: format!("LPMM_CUDA_WHEELS={}: {why}", dir.display()),
        });
    }
    const FIND: &str = "import nvidia, os\nfor p in nvidia.__path__: print(os.path.dirname(p))";
    let out = std::process::Command::new("python3")
        .args(["-c", FIND])
        .stderr(std::process::Stdio::null())
        .output();
    let dirs: Vec<PathBuf> = match &out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| PathBuf::from(l.trim()))
            .collect(),
        _ => Vec::new(),
    };
    let mut searched = Vec::new();
    for dir in &dirs {
        match WheelPaths::in_site_packages(Path::new(dir)) {
            Ok(paths) => return Ok(paths),
            Err(why) => searched.push(format!("{}: {why}", dir.display())),
        }
    }
    if searched.is_empty() {
        searched.push("LPMM_CUDA_WHEELS is not set and python3 cannot import `nvidia`".into());
    }
    Err(WheelsNotFound {
        searched: searched.join("; "),
    })
}

/// Runs `ptxas -arch=<arch> <ptx> -o <cubin>`: whether the PTX assembles for `arch`. The error
/// carries ptxas's output.
pub fn assemble(
    ptxas: &std::path::Path,
    arch: &str,
    ptx: &std::path::Path,
    cubin: &std::path::Path,
) -> Result<(), String> {
    let out = std::process::Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg(ptx)
        .arg("-o")
        .arg(cubin)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ptxas -arch={arch} {} failed ({}):\n{}{}",
            ptx.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Why [`compile`] produced no PTX.
#[cfg(feature = "nvrtc")]
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// The dynamic loader finds no NVRTC library.
    #[error(
        "NVRTC (libnvrtc.so.12) not found: install the pinned wheel ({NVRTC_WHEEL}; all of them: \
         `{pip}`) and put its nvidia/cuda_nvrtc/lib directory on LD_LIBRARY_PATH before the \
         process starts (`cargo xtask kernels` does so itself)",
        pip = pip_install_line()
    )]
    NotFound,
    /// The NVRTC found is not the pinned version, so its PTX would differ from the committed.
    #[error(
        "NVRTC {}.{} was loaded, but the PTX is built with {}.{} ({NVRTC_WHEEL}): put the pinned \
         wheel's nvidia/cuda_nvrtc/lib first on LD_LIBRARY_PATH",
        found.0, found.1, NVRTC_VERSION.0, NVRTC_VERSION.1
    )]
    Version {
        /// The version loaded (major, minor).
        found: (i32, i32),
    },
    /// NVRTC rejected the source (or the options); `log` is its compilation log.
    #[error("NVRTC failed to compile kernels/lpmm.generated.cu for {arch} ({status}):\n{log}")]
    Compile {
        /// The architecture compiled for.
        arch: String,
        /// NVRTC's result code.
        status: String,
        /// NVRTC's log.
        log: String,
    },
    /// Any other NVRTC call failed.
    #[error("NVRTC: {0}")]
    Other(String),
}

/// Whether the dynamic loader finds an NVRTC library (checked without loading any of its
/// functions, so without cudarc's panic when there is none).
#[cfg(feature = "nvrtc")]
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library by its candidate names (libloading); no symbol of
    // it is used.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The version (major, minor) of the NVRTC the dynamic loader finds.
#[cfg(feature = "nvrtc")]
pub fn nvrtc_version() -> Result<(i32, i32), NvrtcError> {
    if !nvrtc_available() {
        return Err(NvrtcError::NotFound);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); nvrtcVersion writes two ints through
    // pointers to live locals.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| NvrtcError::Other(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// Compiles [`SOURCE`] for `arch` ("sm_80") with NVRTC, with [`nvrtc_options`] and `-I` for
/// `include_dirs` (see [`WheelPaths::include_dirs`]); returns the PTX text, as committed under
/// `ptx/`.
///
/// Fails with [`NvrtcError::NotFound`] (before any other NVRTC call) if the library is not
/// found, and with [`NvrtcError::Version`] if it is not the pinned [`NVRTC_VERSION`].
#[cfg(feature = "nvrtc")]
pub fn compile(arch: &str, include_dirs: &[std::path::PathBuf]) -> Result<String, NvrtcError> {
    compile_source(SOURCE, arch, include_dirs)
}

/// [`compile`] of another program (a variant of [`SOURCE`], as the tests build to check what
/// the compiler does with it), with the same options and checks.
#[cfg(feature = "nvrtc")]
pub fn compile_source(
    source: &str,
    arch: &str,
    include_dirs: &[std::path::PathBuf],
) -> Result<String, NvrtcError> {
    compile_source_with(source, arch, include_dirs, &[])
}

/// [`compile`] with line information (`-lineinfo`: `.loc` directives, which ptxas turns into
/// the line table `nvdisasm -gi` prints): the build `cargo xtask kernels --report` reads where
/// the instructions go from ([`crate::sass::breakdowns`]). Not the committed PTX.
#[cfg(feature = "nvrtc")]
pub fn compile_with_lines(
    arch: &str,
    include_dirs: &[std::path::PathBuf],
) -> Result<String, NvrtcError> {
    compile_source_with(SOURCE, arch, include_dirs, &["-lineinfo"])
}

/// [`compile_source`] with `extra` options after [`nvrtc_options`].
#[cfg(feature = "nvrtc")]
pub fn compile_source_with(
    source: &str,
    arch: &str,
    include_dirs: &[std::path::PathBuf],
    extra: &[&str],
) -> Result<String, NvrtcError> {
    use cudarc::nvrtc::{CompileError, CompileOptions, compile_ptx_with_opts};
    let found = nvrtc_version()?;
    if found != NVRTC_VERSION {
        return Err(NvrtcError::Version { found });
    }
    let mut options = nvrtc_options(arch);
    options.extend(extra.iter().map(|o| o.to_string()));
    options.extend(include_dirs.iter().map(|d| format!("-I{}", d.display())));
    let opts = CompileOptions {
        options,
        name: Some("lpmm.generated.cu".into()),
        ..Default::default()
    };
    match compile_ptx_with_opts(source, opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(CompileError::CompileError { nvrtc, log, .. }) => Err(NvrtcError::Compile {
            arch: arch.to_string(),
            status: format!("{:?}", nvrtc.0),
            log: log.to_string_lossy().into_owned(),
        }),
        Err(e) => Err(NvrtcError::Other(format!("{e:?}"))),
    }
}
