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

/// Where `module` lets an f32 product reach anything that could fuse it, as `function: use` and
/// how many times. A driver may contract a product and the addition that takes it into one fma
/// (NVIDIA's Vulkan driver does), which skips the product's rounding; a product stored,
/// returned, passed on or negated may meet such an addition after inlining.
///
/// A product's value is followed through what keeps it a product for a compiler: `min`, `max`,
/// `abs`, a component of it, a bitcast or an f32 conversion. It may then only be compared,
/// converted to an integer, be an operand of `fmaf`, `divf` or `sqrtf`, or have its bits ORed
/// with `UNFUSED` (what `mulr` does, the one point where the rounding is forced).
fn unrounded_products(module: &naga::Module) -> std::collections::BTreeMap<String, usize> {
    use naga::{Block, Expression, Handle, MathFunction, ScalarKind, Statement};
    let mut sites = std::collections::BTreeMap::new();
    each_function(module, |f, fi| {
        let name = f.name.clone().unwrap_or_default();
        let unfused = |e: Handle<Expression>| match f.expressions[e] {
            Expression::Load { pointer } => matches!(
                f.expressions[pointer],
                Expression::GlobalVariable(g)
                    if module.global_variables[g].name.as_deref() == Some("UNFUSED")
            ),
            _ => false,
        };
        // Handles refer to earlier expressions, so one pass in arena order finds them all.
        let mut product = std::collections::HashSet::new();
        let mut flag = |what: &str| *sites.entry(format!("{name}: {what}")).or_insert(0) += 1;
        for (h, e) in f.expressions.iter() {
            let (what, operands): (&str, Vec<Handle<Expression>>) = match e {
                Expression::Binary {
                    op: naga::BinaryOperator::Multiply,
                    ..
                } if is_float(module, fi, h) => {
                    product.insert(h);
                    continue;
                }
                Expression::Binary {
                    op: naga::BinaryOperator::InclusiveOr,
                    left,
                    right,
                } if unfused(*left) || unfused(*right) => continue,
                Expression::Binary { op, .. } if op_compares(*op) => continue,
                Expression::Binary { left, right, .. } => ("arithmetic", vec![*left, *right]),
                Expression::Unary { expr, .. } => ("unary", vec![*expr]),
                Expression::Select { accept, reject, .. } => ("select", vec![*accept, *reject]),
                Expression::Math {
                    fun: MathFunction::Max | MathFunction::Min | MathFunction::Abs,
                    arg,
                    arg1,
                    ..
                } => {
                    if [Some(*arg), *arg1]
                        .into_iter()
                        .flatten()
                        .any(|a| product.contains(&a))
                    {
                        product.insert(h);
                    }
                    continue;
                }
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
                // A value conversion to an integer rounds it; a bitcast or an f32 conversion
                // keeps the product.
                Expression::As {
                    expr,
                    kind,
                    convert,
                } => {
                    if product.contains(expr) && (convert.is_none() || *kind == ScalarKind::Float) {
                        product.insert(h);
                    }
                    continue;
                }
                Expression::Access { base, .. }
                | Expression::AccessIndex { base, .. }
                | Expression::Swizzle { vector: base, .. } => {
                    if product.contains(base) {
                        product.insert(h);
                    }
                    continue;
                }
                Expression::Compose { components, .. } => ("compose", components.clone()),
                Expression::Splat { value, .. } => ("splat", vec![*value]),
                _ => continue,
            };
            for _ in operands.iter().filter(|o| product.contains(o)) {
                flag(what);
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
                Statement::Atomic { value, .. } => ("atomic", vec![*value]),
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
            for _ in operands.iter().filter(|o| product.contains(o)) {
                flag(what);
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
    // `fma_soft` adds one product, where a factor is Inf or NaN (the result is Inf or NaN
    // either way).
    let sites = unrounded_products(&module);
    let allowed = std::collections::BTreeMap::from([("fma_soft: arithmetic".to_string(), 1)]);
    assert_eq!(sites, allowed, "f32 products not rounded by mulr");
    // `mulr`'s zero is one the compiler cannot know: set from the dispatch where the kernels
    // begin (the host dispatches one workgroup in z).
    for line in ["    UNFUSED = wid.z;", "    UNFUSED = id.z;"] {
        assert!(program.contains(line), "{line:?} is in the program");
    }
    // The check sees them: Adafactor's `g * g + eps1` (which NVIDIA's driver fused), a product
    // returned by a format's decode, and `mulr` without its zero (a bitcast round trip, which
    // a compiler removes) are caught.
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
        (
            "bitcast<u32>(a * b) | UNFUSED)",
            "bitcast<u32>(a * b))",
            "mulr: return",
        ),
    ] {
        let edited = program.replace(from, to);
        assert_ne!(edited, program, "{from:?} is where the test expects it");
        let module = naga::front::wgsl::parse_str(&edited).expect("the edited program parses");
        let caught = unrounded_products(&module);
        assert!(caught.contains_key(site), "{site} is found: {caught:?}");
    }
}

/// Each specialized step's program (lpmm-backend's `PlanKernel::wgsl_program`: the dispatch cut
/// to the plan's rule and formats) validates, and its override constants
/// (`PlanKernel::pipeline_constants`) name the program's overrides with values of their type:
/// naga processes them as wgpu does when it builds the pipeline, keeping only what `lpmm_step`
/// reaches, which is less than the generic program's. Prints each plan's count of functions and
/// expressions beside the generic step's (`--nocapture`).
#[test]
fn every_plans_program_is_cut_to_the_plan() {
    let source = std::fs::read_to_string(root().join(wgsl().output)).unwrap();
    let step = |source: &str, constants: &naga::back::PipelineConstants| -> (usize, usize) {
        let module = naga::front::wgsl::parse_str(source).expect("the program parses");
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .expect("the program validates");
        for name in constants.keys() {
            assert!(
                module
                    .overrides
                    .iter()
                    .any(|(_, o)| o.name.as_deref() == Some(name.as_str())),
                "no override {name} in the program"
            );
        }
        let (module, _) = naga::back::pipeline_constants::process_overrides(
            &module,
            &info,
            Some((naga::ShaderStage::Compute, "lpmm_step")),
            constants,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let expressions = module
            .functions
            .iter()
            .map(|(_, f)| f.expressions.len())
            .chain(
                module
                    .entry_points
                    .iter()
                    .map(|e| e.function.expressions.len()),
            )
            .sum();
        (module.functions.len(), expressions)
    };
    let generic = step(&source, &Default::default());
    eprintln!(
        "lpmm_step, generic: {} functions, {} expressions",
        generic.0, generic.1
    );
    let plans = lpmm_backend::plans::plans();
    assert!(!plans.is_empty());
    for plan in plans {
        let constants: naga::back::PipelineConstants = plan
            .pipeline_constants()
            .into_iter()
            .map(|(k, v)| (k, f64::from(v)))
            .collect();
        let cut = step(&plan.wgsl_program(&source), &constants);
        eprintln!(
            "lpmm_step, {}: {} functions, {} expressions",
            plan.name, cut.0, cut.1
        );
        assert!(
            cut.0 < generic.0 && cut.1 < generic.1,
            "{}: {cut:?} against the generic {generic:?}",
            plan.name
        );
    }
}
