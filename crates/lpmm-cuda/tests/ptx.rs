//! The committed PTX: NVRTC builds exactly it from the current kernel sources, and ptxas
//! assembles it, for every architecture of `ARCHS`.
//!
//! Both need the pinned wheels (`lpmm_cuda::kernels::WHEELS`): found through
//! `LPMM_CUDA_WHEELS` or `python3`, with `nvidia/cuda_nvrtc/lib` on `LD_LIBRARY_PATH` when the
//! test process starts. Without them the tests print why and pass, unless
//! `LPMM_REQUIRE_NVRTC=1` (CI), which makes their absence a failure.

use lpmm_cuda::kernels::{self, ARCHS, WheelPaths};
use std::path::{Path, PathBuf};

/// The pinned wheels, or `None` after printing why the test is skipped (a panic under
/// `LPMM_REQUIRE_NVRTC=1`). With `nvrtc`, NVRTC must also load.
fn wheels(nvrtc: bool) -> Option<WheelPaths> {
    let missing = match kernels::wheel_paths() {
        Err(e) => Some(e.to_string()),
        Ok(_) if nvrtc && !kernels::nvrtc_available() => {
            Some(kernels::NvrtcError::NotFound.to_string())
        }
        Ok(w) => return Some(w),
    };
    let why = missing.unwrap_or_default();
    if std::env::var("LPMM_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
        panic!("LPMM_REQUIRE_NVRTC=1, but: {why}");
    }
    eprintln!("skipping: NVRTC not found or the CUDA wheels missing ({why})");
    None
}

/// The first line where `a` and `b` differ (1-based), with both versions of it.
fn first_difference(a: &str, b: &str) -> String {
    let (mut la, mut lb) = (a.lines(), b.lines());
    for n in 1.. {
        match (la.next(), lb.next()) {
            (None, None) => break,
            (x, y) if x == y => continue,
            (x, y) => {
                return format!(
                    "line {n}: committed {:?}, built {:?}",
                    x.unwrap_or("<end>"),
                    y.unwrap_or("<end>")
                );
            }
        }
    }
    "no line differs (line endings or a final newline)".into()
}

#[test]
fn committed_ptx_is_what_nvrtc_builds() {
    let Some(wheels) = wheels(true) else {
        return;
    };
    let mut differ = Vec::new();
    for (arch, committed) in ARCHS {
        let built = kernels::compile(arch, &wheels.include_dirs())
            .unwrap_or_else(|e| panic!("compiling kernels/lpmm.cu for {arch}: {e}"));
        if built != committed {
            differ.push(format!("{arch} ({})", first_difference(committed, &built)));
        }
    }
    assert!(
        differ.is_empty(),
        "the committed PTX differs from what NVRTC builds from kernels/lpmm.cu for {}: run \
         `cargo xtask kernels` and commit crates/lpmm-cuda/ptx/",
        differ.join("; ")
    );
}

#[test]
fn committed_ptx_assembles() {
    let Some(wheels) = wheels(false) else {
        return;
    };
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for (arch, _) in ARCHS {
        let ptx = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("ptx/lpmm.{arch}.ptx"));
        let cubin = tmp.join(format!("lpmm.{arch}.cubin"));
        if let Err(e) = kernels::assemble(&wheels.ptxas, arch, &ptx, &cubin) {
            panic!("{e}");
        }
        assert!(
            cubin.metadata().is_ok_and(|m| m.len() > 0),
            "ptxas wrote no cubin for {arch}"
        );
    }
}

/// The float instructions of the committed PTX are the IEEE ones the CPU reference computes:
/// division and square root correctly rounded (`.rn`, not `.approx` / `.full`), no flush to zero,
/// and every f32 multiply and add with an explicit `.rn`, which ptxas never contracts into an fma
/// (so the only fmas are the kernels' own `__fmaf_rn`). Needs no NVRTC.
#[test]
fn committed_ptx_uses_only_ieee_float_operations() {
    for (arch, ptx) in ARCHS {
        let mut fmas = 0;
        for line in ptx.lines().map(str::trim) {
            let op = line.split_whitespace().next().unwrap_or("");
            let is_f32_arith = op.ends_with(".f32")
                && [
                    "add.", "sub.", "mul.", "div.", "sqrt.", "fma.", "rcp.", "rsqrt.",
                ]
                .iter()
                .any(|p| op.starts_with(p));
            assert!(!op.contains(".ftz"), "{arch}: flush to zero in `{line}`");
            if is_f32_arith {
                assert!(
                    op.contains(".rn."),
                    "{arch}: `{line}` is not an IEEE round-to-nearest operation"
                );
                assert!(
                    !op.starts_with("rcp.") && !op.starts_with("rsqrt."),
                    "{arch}: approximate `{line}`"
                );
                fmas += usize::from(op.starts_with("fma."));
            }
        }
        // The explicit __fmaf_rn sites of kernels/lpmm.cu (SGD 4, Adam 4, Lion 3), each inlined
        // into the one step kernel.
        let sites = kernels::SOURCE.matches("__fmaf_rn(").count();
        assert_eq!(fmas, sites, "{arch}: fma instructions vs __fmaf_rn calls");
    }
}
