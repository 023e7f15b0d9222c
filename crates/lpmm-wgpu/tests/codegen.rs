//! The committed kernel program (`src/lpmm.wgsl`) is what `cargo xtask codegen` generates from
//! `kernels/` and the ABI in lpmm-backend; a stale one fails naming the command.

use std::path::{Path, PathBuf};

use lpmm_backend::codegen::{COMMAND, Lang, TARGETS};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn wgsl() -> lpmm_backend::codegen::Target {
    TARGETS
        .into_iter()
        .find(|t| t.lang == Lang::Wgsl)
        .expect("a WGSL target")
}

#[test]
fn the_generated_program_is_up_to_date() {
    let read = |p: &Path| std::fs::read_to_string(p);
    if let Err(e) = wgsl().check(&root(), &read) {
        panic!("{e}");
    }
}

#[test]
fn a_stale_program_fails_naming_the_command() {
    // A format's kernel edited without regenerating the program.
    let read = |p: &Path| {
        let s = std::fs::read_to_string(p)?;
        Ok(if p.ends_with("formats/bf16.wgsl") {
            s.replace("(aux & 1u) == 1u", "(aux & 1u) == 0u")
        } else {
            s
        })
    };
    let err = wgsl().check(&root(), &read).unwrap_err();
    assert!(err.contains(COMMAND) && err.contains("stale"), "{err}");
}

/// The functions of `module` that divide f32 values or take an f32 square root, by name.
fn float_div_and_sqrt_sites(module: &naga::Module) -> std::collections::BTreeSet<String> {
    use naga::{BinaryOperator, Expression, MathFunction, ScalarKind, TypeInner};
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(module)
    .expect("the program validates");
    let functions = module.functions.iter().map(|(h, f)| (f, &info[h])).chain(
        module
            .entry_points
            .iter()
            .enumerate()
            .map(|(k, e)| (&e.function, info.get_entry_point(k))),
    );
    let mut sites = std::collections::BTreeSet::new();
    for (f, fi) in functions {
        let float = |e: naga::Handle<Expression>| {
            let scalar = match fi[e].ty.inner_with(&module.types) {
                TypeInner::Scalar(s) | TypeInner::Vector { scalar: s, .. } => Some(*s),
                _ => None,
            };
            scalar.is_some_and(|s| s.kind == ScalarKind::Float)
        };
        for (_, e) in f.expressions.iter() {
            let hit = match *e {
                Expression::Binary {
                    op: BinaryOperator::Divide,
                    left,
                    ..
                } => float(left),
                Expression::Math {
                    fun: MathFunction::Sqrt | MathFunction::InverseSqrt,
                    ..
                } => true,
                _ => false,
            };
            if hit {
                sites.insert(f.name.clone().unwrap_or_default());
            }
        }
    }
    sites
}

#[test]
fn every_float_division_and_square_root_goes_through_the_exact_helpers() {
    // `divf` and `sqrtf` use the driver's operation only where the probe found it correctly
    // rounded (kernels/float.wgsl); the probe's entry point measures the driver's directly.
    let program = std::fs::read_to_string(root().join("crates/lpmm-wgpu/src/lpmm.wgsl")).unwrap();
    let module = naga::front::wgsl::parse_str(&program).expect("the program parses");
    let sites = float_div_and_sqrt_sites(&module);
    let allowed = ["arith_main", "divf", "sqrtf"];
    let stray: Vec<&String> = sites
        .iter()
        .filter(|s| !allowed.contains(&s.as_str()))
        .collect();
    assert!(
        stray.is_empty(),
        "f32 division or sqrt outside divf/sqrtf in: {stray:?}"
    );
    // The check sees them: a rule that divided directly would be caught.
    let edited = program.replace(
        "divf(c.neg_step_size * u.m, denom)",
        "c.neg_step_size * u.m / denom",
    );
    assert_ne!(
        edited, program,
        "the Adam rule's step is where the test expects it"
    );
    let module = naga::front::wgsl::parse_str(&edited).expect("the edited program parses");
    let caught = float_div_and_sqrt_sites(&module);
    assert!(
        caught.iter().any(|s| s.contains("adam")),
        "a direct division in the Adam rule is found: {caught:?}"
    );
}
