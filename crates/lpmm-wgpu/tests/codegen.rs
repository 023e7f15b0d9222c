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

/// Every function of `module` (entry points included) with its validation info, for `visit`.
fn each_function(
    module: &naga::Module,
    mut visit: impl FnMut(&naga::Function, &naga::valid::FunctionInfo),
) {
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(module)
    .expect("the program validates");
    for (h, f) in module.functions.iter() {
        visit(f, &info[h]);
    }
    for (k, e) in module.entry_points.iter().enumerate() {
        visit(&e.function, info.get_entry_point(k));
    }
}

/// Whether expression `e` of the function `fi` describes is an f32 scalar or vector.
fn is_float(
    module: &naga::Module,
    fi: &naga::valid::FunctionInfo,
    e: naga::Handle<naga::Expression>,
) -> bool {
    use naga::{ScalarKind, TypeInner};
    match fi[e].ty.inner_with(&module.types) {
        TypeInner::Scalar(s) | TypeInner::Vector { scalar: s, .. } => s.kind == ScalarKind::Float,
        _ => false,
    }
}

/// The functions of `module` that divide f32 values or take an f32 square root, by name.
fn float_div_and_sqrt_sites(module: &naga::Module) -> std::collections::BTreeSet<String> {
    use naga::{BinaryOperator, Expression, MathFunction};
    let mut sites = std::collections::BTreeSet::new();
    each_function(module, |f, fi| {
        for (_, e) in f.expressions.iter() {
            let hit = match *e {
                Expression::Binary {
                    op: BinaryOperator::Divide,
                    left,
                    ..
                } => is_float(module, fi, left),
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
    });
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

/// Where `module` uses an f32 product as anything but an operand of `fmaf`, `divf`, `sqrtf`, a
/// comparison, `min`/`max`/`abs` or a conversion (the f32 bits that `mulr` rounds it to, or an
/// integer), as `function: use`. An addition or
/// subtraction that takes a product may be contracted into one fma by the driver (NVIDIA's
/// Vulkan driver does), which skips the product's rounding; a product stored, returned or
/// passed on may meet such an addition after inlining.
fn unrounded_products(module: &naga::Module) -> std::collections::BTreeSet<String> {
    use naga::{Block, Expression, Handle, MathFunction, Statement};
    let mut sites = std::collections::BTreeSet::new();
    each_function(module, |f, fi| {
        let name = f.name.clone().unwrap_or_default();
        let product = |e: Handle<Expression>| {
            is_float(module, fi, e)
                && matches!(
                    f.expressions[e],
                    Expression::Binary {
                        op: naga::BinaryOperator::Multiply,
                        ..
                    }
                )
        };
        for (_, e) in f.expressions.iter() {
            let (what, operands): (&str, Vec<Handle<Expression>>) = match e {
                // Comparisons and conversions (the product's bits or an integer) round it.
                Expression::Binary { op, left, right } if !op_compares(*op) => {
                    ("arithmetic", vec![*left, *right])
                }
                Expression::Unary { expr, .. } => ("unary", vec![*expr]),
                Expression::Select { accept, reject, .. } => ("select", vec![*accept, *reject]),
                // Exact functions of their operand.
                Expression::Math {
                    fun: MathFunction::Max | MathFunction::Min | MathFunction::Abs,
                    ..
                } => continue,
                Expression::Math {
                    arg,
                    arg1,
                    arg2,
                    arg3,
                    ..
                } => (
                    "math",
                    [Some(*arg), *arg1, *arg2, *arg3]
                        .into_iter()
                        .flatten()
                        .collect(),
                ),
                Expression::Compose { components, .. } => ("compose", components.clone()),
                Expression::Splat { value, .. } => ("splat", vec![*value]),
                _ => continue,
            };
            if operands.into_iter().any(product) {
                sites.insert(format!("{name}: {what}"));
            }
        }
        fn statements<'a>(b: &'a Block, out: &mut Vec<&'a Statement>) {
            for s in b.iter() {
                out.push(s);
                match s {
                    Statement::Block(b) => statements(b, out),
                    Statement::If { accept, reject, .. } => {
                        statements(accept, out);
                        statements(reject, out);
                    }
                    Statement::Loop {
                        body, continuing, ..
                    } => {
                        statements(body, out);
                        statements(continuing, out);
                    }
                    Statement::Switch { cases, .. } => {
                        cases.iter().for_each(|c| statements(&c.body, out))
                    }
                    _ => {}
                }
            }
        }
        let mut all = Vec::new();
        statements(&f.body, &mut all);
        for s in all {
            let (what, operands) = match s {
                Statement::Store { value, .. } => ("store", vec![*value]),
                Statement::Return { value: Some(v) } => ("return", vec![*v]),
                Statement::Call {
                    function,
                    arguments,
                    ..
                } if !matches!(
                    module.functions[*function].name.as_deref(),
                    Some("fmaf" | "divf" | "sqrtf")
                ) =>
                {
                    ("call", arguments.clone())
                }
                _ => continue,
            };
            if operands.into_iter().any(product) {
                sites.insert(format!("{name}: {what}"));
            }
        }
    });
    sites
}

fn op_compares(op: naga::BinaryOperator) -> bool {
    use naga::BinaryOperator::*;
    matches!(
        op,
        Equal | NotEqual | Less | LessEqual | Greater | GreaterEqual
    )
}

#[test]
fn every_float_product_is_rounded_before_anything_adds_it() {
    let program = std::fs::read_to_string(root().join("crates/lpmm-wgpu/src/lpmm.wgsl")).unwrap();
    let module = naga::front::wgsl::parse_str(&program).expect("the program parses");
    // `fma_soft` adds a product only where a factor is Inf or NaN (the result is Inf or NaN
    // either way); the probe measures the driver's own `a * b + c`.
    let allowed = ["fma_soft: arithmetic", "arith_main: arithmetic"];
    let sites = unrounded_products(&module);
    let stray: Vec<&String> = sites
        .iter()
        .filter(|s| !allowed.contains(&s.as_str()))
        .collect();
    assert!(
        stray.is_empty(),
        "f32 products not rounded by mulr: {stray:?}"
    );
    // The check sees them: Adafactor's `g * g + eps1` (which NVIDIA's driver fused) and a
    // product returned by a format's decode are caught.
    for (from, to, site) in [
        (
            "fmaf(mulr(g, g) + c.eps1, c.one_minus_beta2t",
            "fmaf(g * g + c.eps1, c.one_minus_beta2t",
            "adafactor_unscaled: arithmetic",
        ),
        (
            "return mulr(map_value(map, code), absmax);",
            "return map_value(map, code) * absmax;",
            "fmt_blockwise_load: return",
        ),
    ] {
        let edited = program.replace(from, to);
        assert_ne!(edited, program, "{from:?} is where the test expects it");
        let module = naga::front::wgsl::parse_str(&edited).expect("the edited program parses");
        let caught = unrounded_products(&module);
        assert!(caught.contains(site), "{site} is found: {caught:?}");
    }
}
