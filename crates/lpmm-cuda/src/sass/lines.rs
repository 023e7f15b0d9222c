//! Where a fast path's instructions go, and what its count is worth in time.
//!
//! The kernel sources mark their regions with `// sass: <category>` comments (kernels/*.cuh): a
//! marker names the category of the lines after it, up to the next marker at the same or an
//! outer brace depth, or the end of the block it is in. A SASS instruction's category is that of
//! the innermost line of its inlining chain (`nvdisasm -gi` of a cubin built with line
//! information: `cargo xtask kernels --report` builds one beside the committed PTX) that lies in
//! a marked region; one in none is `control` (the tile loop, descriptors, addresses, branches).

use std::collections::BTreeMap;

use super::{FastPath, Figures, Function, PER};

/// The categories, in the report's column order.
pub const CATEGORIES: [&str; 11] = [
    "loads", "decode", "rule", "checks", "absmax", "quotient", "search", "round", "pack", "stores",
    "random",
];

/// The category of instructions in no marked region.
pub const CONTROL: &str = "control";

/// Each line's category (index: line number - 1), from the program's `// sass:` markers; `None`
/// outside every marked region. Fails on a marker naming no category of [`CATEGORIES`].
pub fn line_categories(source: &str) -> Result<Vec<Option<&'static str>>, String> {
    let mut out = Vec::new();
    // (brace depth at the marker, category), innermost last.
    let mut stack: Vec<(usize, &'static str)> = Vec::new();
    let mut depth = 0usize;
    for (n, line) in source.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        if let Some(name) = line.trim().strip_prefix("// sass:") {
            let name = name.trim();
            let cat = CATEGORIES
                .iter()
                .find(|&&c| c == name)
                .ok_or_else(|| format!("line {}: unknown `// sass:` category {name:?}", n + 1))?;
            stack.retain(|&(d, _)| d < depth);
            stack.push((depth, cat));
        }
        out.push(stack.last().map(|&(_, c)| c));
        for ch in code.chars() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    stack.retain(|&(d, _)| d <= depth);
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

/// The fast path's instructions by category ([`CATEGORIES`] and [`CONTROL`]), from `f`'s line
/// information and the program's [`line_categories`].
pub fn breakdown(
    f: &Function,
    path: &FastPath,
    categories: &[Option<&'static str>],
) -> BTreeMap<&'static str, usize> {
    let mut out = BTreeMap::new();
    for &i in &path.path {
        let cat = f.code[i]
            .lines
            .iter()
            .find_map(|&l| {
                categories
                    .get((l as usize).wrapping_sub(1))
                    .copied()
                    .flatten()
            })
            .unwrap_or(CONTROL);
        *out.entry(cat).or_default() += 1;
    }
    out
}

/// One kernel's breakdown, per element: (kernel, arch, fast path per element, instructions by
/// category).
pub type Breakdown = (String, String, f64, BTreeMap<&'static str, usize>);

/// The breakdowns as a markdown table (instructions per element in each category).
pub fn breakdown_table(rows: &[Breakdown]) -> String {
    let cols: Vec<&str> = CATEGORIES.iter().copied().chain([CONTROL]).collect();
    let mut o = format!(
        "| kernel | arch | per element | {} |\n|---|---|---|{}\n",
        cols.join(" | "),
        "---|".repeat(cols.len())
    );
    for (name, arch, per, by) in rows {
        let cells: Vec<String> = cols
            .iter()
            .map(|c| {
                let n = by.get(c).copied().unwrap_or(0);
                format!("{:.1}", n as f64 / PER as f64)
            })
            .collect();
        o += &format!(
            "| {} | {arch} | {per:.1} | {} |\n",
            name.trim_start_matches("lpmm_plan_"),
            cells.join(" | ")
        );
    }
    o
}

/// The issue-rate model of an H200's step time (docs/BENCHMARKS.md; ../shared/spec): warp
/// instructions / (132 SMs x 4 schedulers x 0.53 issued per scheduler-cycle x 1.98 GHz), the
/// rate ncu measured for the generic kernel (29.5 ms for 1e9 parameters at about 16.3 warp
/// instructions per parameter). Warp instructions per second.
pub const H200_RATE: f64 = 132.0 * 4.0 * 0.53 * 1.98e9;

/// torch's fused f32 AdamW on the H200 at 1e9 parameters, ms (docs/BENCHMARKS.md).
pub const TORCH_F32_MS: f64 = 8.05;

/// The H200's device-to-device copy, bytes moved per second (read and write counted; docs/
/// BENCHMARKS.md: 8-bit AdamW's 12.06 B/param at 1e9 took 29.481 ms, 0.096 of the copy's
/// bandwidth in the same run): a step cannot be faster than its bytes at this rate.
pub const H200_COPY_BYTES_PER_S: f64 = 12.06e9 / 29.481e-3 / 0.096;

/// The model's time in ms of one step of `params` elements at `per_element` SASS instructions
/// per element (one warp instruction per 32 of them), at `rate` warp instructions per second.
pub fn model_ms(per_element: f64, params: f64, rate: f64) -> f64 {
    per_element * params / 32.0 / rate * 1e3
}

/// The figures docs/BACKENDS.md shows, one row per kernel: its fast path per element on sm_90 and
/// sm_80 against its budget, with the cold paths taken (sm_90), and the estimate of one step at
/// 1e9 parameters on an H200: the issue-rate model's time (`rate`: warp instructions per second,
/// [`H200_RATE`] until a device run measures it), the device copy's time for the step's bytes
/// ([`H200_COPY_BYTES_PER_S`]), the larger of the two, and its ratio to torch's fused f32
/// AdamW; labelled as an estimate.
pub fn summary(figures: &[Figures], rate: f64) -> String {
    let mut o = format!(
        "| kernel | preset | fast path per element, sm_90 / sm_80 | budget | with cold paths, sm_90 | B/param | estimate at 1e9 on an H200: issue rate / copy of its bytes, ms | estimate vs torch fused f32 AdamW ({TORCH_F32_MS} ms) |\n|---|---|---|---|---|---|---|---|\n"
    );
    let plans = lpmm_backend::plans::plans();
    for f in figures.iter().filter(|f| f.arch == "sm_90") {
        let Some(plan) = plans.iter().find(|p| p.name == f.name) else {
            continue;
        };
        let sm80 = figures
            .iter()
            .find(|g| g.arch == "sm_80" && g.name == f.name)
            .map_or(f64::NAN, |g| g.per_element());
        let bytes = super::bytes_per_element(plan);
        let issue = model_ms(f.per_element(), 1e9, rate);
        let copy = bytes * 1e9 / H200_COPY_BYTES_PER_S * 1e3;
        let ratio = TORCH_F32_MS / issue.max(copy);
        let verdict = if ratio >= 1.0 {
            format!("{ratio:.2}x faster")
        } else {
            format!("{:.2}x slower", 1.0 / ratio)
        };
        o += &format!(
            "| {} | {} | {:.1} / {sm80:.1} | {} | {:.1} | {bytes:.2} | {issue:.2} / {copy:.2} | {verdict} |\n",
            f.name.trim_start_matches("lpmm_plan_"),
            plan.preset,
            f.per_element(),
            f.budget,
            f.cold_per_element(),
        );
    }
    o + &format!(
        "\nEstimates, not measurements: issue rate = warp instructions (SASS per element x 1e9 / 32) / {:.4e} per second ({}); copy = the step's bytes / {:.3e} B/s (the H200's device copy); the ratio takes the larger.\n",
        rate,
        if rate == H200_RATE {
            "132 SMs x 4 schedulers x 0.53 issued per scheduler-cycle x 1.98 GHz"
        } else {
            "measured by crates/lpmm-cuda/gpu/run.sh"
        },
        H200_COPY_BYTES_PER_S,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_scope_to_their_block() {
        let src = "void f() {\n    // sass: rule\n    a;\n    if (x) {\n        // sass: pack\n        b;\n    }\n    c;\n}\nd;\n";
        let c = line_categories(src).unwrap();
        assert_eq!(c[2], Some("rule"));
        assert_eq!(c[5], Some("pack"));
        assert_eq!(c[7], Some("rule"));
        assert_eq!(c[9], None);
        assert!(line_categories("// sass: nonsense\n").is_err());
    }

    #[test]
    fn the_model_reproduces_the_issues_table() {
        // The issue's table, to its rounding: 165 instructions per element 9.3 ms, 140 7.9,
        // 100 5.6, 70 4.0.
        for (per, ms) in [(165.0, 9.3), (140.0, 7.9), (100.0, 5.6), (70.0, 4.0)] {
            let got = model_ms(per, 1e9, H200_RATE);
            assert!((got - ms).abs() < 0.06, "{per}: {got}");
        }
    }
}
