//! The committed kernel program and PTX: the program is what `cargo xtask codegen` assembles from
//! the kernel sources and the ABI, NVRTC builds exactly the committed PTX from it, and ptxas
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
            .unwrap_or_else(|e| panic!("compiling kernels/lpmm.generated.cu for {arch}: {e}"));
        if built != committed {
            differ.push(format!("{arch} ({})", first_difference(committed, &built)));
        }
    }
    assert!(
        differ.is_empty(),
        "the committed PTX differs from what NVRTC builds from kernels/lpmm.generated.cu for {}: run \
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

/// The program's functions (a definition line starts with `__device__` or `extern "C"`; its body
/// ends at a line `}`): each one's name, its own `__fmaf_rn` calls, and the program's functions it
/// calls (one entry per call site).
fn functions(program: &str) -> Vec<(String, usize, Vec<String>)> {
    let mut out: Vec<(String, usize, String)> = Vec::new();
    for line in program.lines() {
        if line.starts_with("__device__") || line.starts_with("extern \"C\"") {
            let line = line.replace("__launch_bounds__(THREADS)", "");
            let head = line.split('(').next().unwrap_or("");
            let name = head.split_whitespace().last().unwrap_or("").to_string();
            out.push((name, 0, String::new()));
        } else if let Some(f) = out.last_mut() {
            if f.2.ends_with("\n}\n") {
                continue;
            }
            f.1 += line.matches("__fmaf_rn(").count();
            f.2 += line;
            f.2 += "\n";
        }
    }
    let names: Vec<String> = out.iter().map(|f| f.0.clone()).collect();
    out.into_iter()
        .map(|(name, fmas, body)| {
            let calls = names
                .iter()
                .flat_map(|n| {
                    let needle = format!("{n}(");
                    body.match_indices(&needle)
                        .filter(|&(at, _)| {
                            let before = body[..at].chars().last().unwrap_or(' ');
                            !(before.is_alphanumeric() || before == '_')
                        })
                        .map(|_| n.clone())
                        .collect::<Vec<_>>()
                })
                .collect();
            (name, fmas, calls)
        })
        .collect()
}

/// The `__fmaf_rn` instances of function `name` once every call in it is inlined.
fn inlined_fmas(fns: &[(String, usize, Vec<String>)], name: &str) -> usize {
    let Some((_, own, calls)) = fns.iter().find(|f| f.0 == name) else {
        return 0;
    };
    own + calls.iter().map(|c| inlined_fmas(fns, c)).sum::<usize>()
}

/// The float instructions of the committed PTX are the IEEE ones the CPU reference computes:
/// division, reciprocal and square root correctly rounded (`.rn`, not `.approx` / `.full`), no
/// flush to zero,
/// and every f32 multiply and add with an explicit `.rn`, which ptxas never contracts into an fma
/// (so the only fmas are the kernels' own `__fmaf_rn`, all in the rules' files and in
/// kernels/exact.cuh's exact shortcuts (`exact_*`: a division's correction step, argued in
/// docs/FORMATS.md and tested bit for bit by tests/exact.rs), and an entry has
/// fmas exactly where it inlines a `__fmaf_rn`: the compiler may duplicate or merge the inlined
/// code, so the counts need not match; a specialized step has fmas exactly where its rule's apply
/// has a `__fmaf_rn`; `no_fma_but_the_kernels_own` proves with NVRTC that none is a contraction).
/// Needs no NVRTC.
#[test]
fn committed_ptx_uses_only_ieee_float_operations() {
    let fns = functions(kernels::SOURCE);
    let rules: Vec<&str> = lpmm_optim::backend::RuleConsts::KERNELS
        .iter()
        .map(|(r, _, _)| *r)
        .collect();
    for (name, fmas, _) in &fns {
        let in_rule = rules
            .iter()
            .any(|r| name.starts_with(&format!("rule_{r}_")) || name.starts_with(&format!("{r}_")));
        let exact = name.starts_with("exact_");
        assert!(
            *fmas == 0 || in_rule || exact,
            "__fmaf_rn outside the rules and exact.cuh: {name}"
        );
    }
    assert_eq!(
        fns.iter().map(|f| f.1).sum::<usize>(),
        kernels::SOURCE.matches("__fmaf_rn(").count(),
        "every __fmaf_rn is inside a function"
    );
    let (step, fold) = (
        inlined_fmas(&fns, "lpmm_step"),
        inlined_fmas(&fns, "lpmm_fold"),
    );
    assert!(
        step > 0 && fold > step,
        "fmas found: step {step}, fold {fold}"
    );
    for (arch, ptx) in ARCHS {
        let mut fmas: std::collections::BTreeMap<&str, usize> = Default::default();
        let mut entry = "";
        for line in ptx.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix(".visible .entry ") {
                entry = rest.split('(').next().unwrap_or(rest);
                fmas.insert(entry, 0);
            }
            assert!(
                !line.starts_with(".func") && !line.contains(" .func"),
                "{arch}: a call: `{line}`"
            );
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
                // `rcp.rn.f32` is the IEEE reciprocal (NVVM's form of `1.0f / x`, which the
                // exact shortcuts take once per divisor); `rsqrt` has no IEEE form.
                assert!(!op.starts_with("rsqrt."), "{arch}: approximate `{line}`");
                if op.starts_with("fma.") {
                    *fmas.get_mut(entry).expect("an fma inside an entry") += 1;
                }
            }
        }
        // The specialized steps (lpmm-backend's plans) inline their rule's apply.
        let plans = lpmm_backend::plans::plans().iter().map(|p| {
            let apply = format!("rule_{}_apply", p.rule_name());
            (p.name.as_str(), inlined_fmas(&fns, &apply))
        });
        let want: std::collections::BTreeMap<&str, usize> = lpmm_backend::abi::Entry::ALL
            .iter()
            .map(|e| (e.name(), inlined_fmas(&fns, e.name())))
            .chain(plans)
            .collect();
        let has = |m: &std::collections::BTreeMap<&str, usize>| {
            m.iter()
                .map(|(e, n)| (e.to_string(), *n > 0))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            has(&fmas),
            has(&want),
            "{arch}: entries with fma instructions vs entries that inline __fmaf_rn \
             (instructions {fmas:?}, calls {want:?})"
        );
    }
}

/// Every fma of the PTX is one of the kernels' own `__fmaf_rn`: the program built with the
/// committed options, but with each `__fmaf_rn` behind a function that is never inlined, has no
/// fma in any entry and exactly one, that function's, in the whole PTX. (An option that lets the
/// compiler contract `a * b + c` puts fmas back into the entries; so would a contraction in a
/// later compiler.) With `committed_ptx_is_what_nvrtc_builds`, the committed PTX's fmas are the
/// kernels' own. Needs NVRTC.
#[test]
fn no_fma_but_the_kernels_own() {
    let Some(wheels) = wheels(true) else {
        return;
    };
    let opaque = "__device__ __noinline__ float lpmm_test_fma(float a, float b, float c) {\n    \
                  return __fmaf_rn(a, b, c);\n}\n";
    let source = format!(
        "{opaque}{}",
        kernels::SOURCE.replace("__fmaf_rn(", "lpmm_test_fma(")
    );
    for (arch, _) in ARCHS {
        let ptx = kernels::compile_source(&source, arch, &wheels.include_dirs())
            .unwrap_or_else(|e| panic!("compiling the opaque-fma program for {arch}: {e}"));
        let mut entry = None;
        let mut in_entries = Vec::new();
        let mut total = 0;
        for line in ptx.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix(".visible .entry ") {
                entry = Some(rest.split('(').next().unwrap_or(rest).to_string());
            } else if line.starts_with(".visible .func") || line.starts_with(".func") {
                entry = None;
            }
            if line.starts_with("fma.") {
                total += 1;
                if let Some(e) = &entry {
                    in_entries.push(format!("{e}: `{line}`"));
                }
            }
        }
        assert!(
            in_entries.is_empty(),
            "{arch}: fmas the kernels did not write: {in_entries:?}"
        );
        assert_eq!(total, 1, "{arch}: the opaque function's fma, and no other");
    }
}

/// The committed program is what the kernel sources and the ABI generate, and an edit of a
/// source without `cargo xtask codegen` is caught, naming the command.
#[test]
fn the_generated_program_is_up_to_date() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = lpmm_backend::codegen::TARGETS[1];
    assert_eq!(target.output, "crates/lpmm-cuda/kernels/lpmm.generated.cu");
    let read = |p: &Path| std::fs::read_to_string(p);
    if let Err(e) = target.check(&root, &read) {
        panic!("{e}");
    }
    assert_eq!(
        std::fs::read_to_string(root.join(target.output)).unwrap(),
        kernels::SOURCE,
        "the embedded program is the committed one"
    );
    // A source edited after the program was generated.
    let edited = |p: &Path| {
        let text = std::fs::read_to_string(p)?;
        Ok(if p.ends_with("rules/adam.cuh") {
            text.replace("c.eps", "(c.eps * 2.0f)")
        } else {
            text
        })
    };
    let err = target.check(&root, &edited).unwrap_err();
    assert!(err.contains("cargo xtask codegen"), "{err}");
    assert!(err.contains(target.output), "{err}");
}

/// The specialized steps' static gates (`lpmm_cuda::sass`), for every architecture: `ptxas -v`
/// reports a 0-byte stack frame and no spills; their SASS has no `LDL`/`STL`, moves every
/// element in 128-bit accesses (64-bit for a thread's 4-bit codes), has at most one barrier per
/// quantization block, and its fast path stays within the kernel's instruction budget per
/// element. A failure names the command that prints the table. Needs ptxas and nvdisasm.
#[test]
fn specialized_steps_meet_their_static_gates() {
    let Some(wheels) = wheels(false) else {
        return;
    };
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sass");
    std::fs::create_dir_all(&tmp).unwrap();
    let mut broken = Vec::new();
    for (arch, _) in ARCHS {
        let ptx = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("ptx/lpmm.{arch}.ptx"));
        let figures = lpmm_cuda::sass::figures(&wheels.ptxas, &wheels.nvdisasm, arch, &ptx, &tmp)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(figures.len(), lpmm_backend::plans::plans().len());
        for f in &figures {
            broken.extend(
                f.violations()
                    .into_iter()
                    .map(|v| format!("{} ({arch}): {v}", f.name)),
            );
        }
    }
    assert!(
        broken.is_empty(),
        "specialized steps over their static gates (`{}` prints the table):\n{}",
        lpmm_cuda::sass::COMMAND,
        broken.join("\n")
    );
}
