//! The specialized fused steps: one kernel per *hot plan* — a preset's update rule, each slot's
//! format (storage, code map, block size, rounding) and where the gradient comes from — compiled
//! with all of that fixed, beside the generic step that reads every slot's format from its
//! descriptor ([`crate::abi::Entry::Step`]).
//!
//! [`plans`] is the registry: `cargo xtask codegen` writes one kernel entry per plan into each
//! backend's program ([`crate::codegen`]), and [`crate::Device`] groups a step's items by plan,
//! launching each group's kernel once (many tensors in one launch) and the generic step for the
//! items no plan covers. A plan's kernel computes what the generic step computes, with the same
//! functions in the same order: the bits are the CPU's either way (the conformance suite runs
//! with the plans on, and a test steps every plan against the generic step).

use std::sync::OnceLock;

use lpmm_optim::backend::{FieldType, Format, ParamLayout, RuleConsts, RuleState, SLOTS, SlotKind};
use lpmm_optim::{ParamConfig, Storage, presets};

/// Where a plan's gradient comes from besides its accumulator (the step's io values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GradInput {
    /// The accumulator only (`Optimizer::step`).
    None,
    /// A released f32 gradient (added to the accumulator, if the parameter has one).
    F32,
    /// A released bf16 gradient.
    Bf16,
}

impl GradInput {
    /// The suffix of a plan's name.
    fn suffix(self) -> &'static str {
        match self {
            GradInput::None => "",
            GradInput::F32 => "f32",
            GradInput::Bf16 => "bf16",
        }
    }
}

/// One specialized step: what its kernel is compiled for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanKernel {
    /// The kernel's entry name (`lpmm_plan_<preset>_<gradient>`).
    pub name: String,
    /// The preset (or configuration) the plan was taken from.
    pub preset: &'static str,
    /// That configuration (a tensor of at least its minimum quantized size resolves to the
    /// plan's formats).
    pub config: ParamConfig,
    /// The rule's kernel id ([`RuleConsts::kernel_id`]).
    pub rule: u32,
    /// The rule's options the kernel is compiled for: each `u32` field of its constants (Adam's
    /// `decoupled`, SGD's `options`) as `(word, name, value)`; a step whose constants differ
    /// there takes the generic step.
    pub options: Vec<(usize, &'static str, u32)>,
    /// Each slot's format: parameter, gradient accumulator, states 1-3 (`None`: no slot).
    pub formats: [Option<Format>; SLOTS],
    /// The io gradient.
    pub input: GradInput,
}

impl PlanKernel {
    /// The rule's name in the kernels (`rules/<name>`).
    pub fn rule_name(&self) -> &'static str {
        RuleConsts::KERNELS[self.rule as usize].0
    }

    /// The rule's constants' struct in the kernels.
    pub fn consts_name(&self) -> &'static str {
        RuleConsts::KERNELS[self.rule as usize].1
    }

    /// What the kernel is for, in words: the rule, each slot's format and the gradient's source.
    pub fn describe(&self) -> String {
        let slot = |f: Option<Format>| match f {
            None => "-".to_string(),
            Some(f) if f.name() == "blockwise" => {
                let aux = f.kernel_aux();
                format!(
                    "{}-bit {:?}/{}{}",
                    aux >> 24,
                    f.map().unwrap_or(lpmm_optim::MapKind::DynamicSigned8),
                    block_of(f).unwrap_or(0),
                    if f.stochastic() { " sr" } else { "" }
                )
            }
            Some(f) if f.stochastic() => format!("{} sr", f.name()),
            Some(f) => f.name().to_string(),
        };
        let [p, g, s1, s2, s3] = self.formats.map(slot);
        let input = match self.input {
            GradInput::None => "",
            GradInput::F32 => " + f32 io",
            GradInput::Bf16 => " + bf16 io",
        };
        format!(
            "{} (param {p}, grad {g}{input}, states {s1} / {s2} / {s3})",
            self.rule_name()
        )
    }

    /// The override constants of the WGSL step's pipeline for this plan (`PLAN_RULE`, and each
    /// slot's `PLAN_FORMAT_<s>` and `PLAN_AUX_<s>`: the format's kernel id and aux word, 0 for no
    /// slot), which fix what the generic `lpmm_step` reads from each item's descriptor, so that
    /// the driver's compiler folds away what is left of the dispatch in
    /// [`PlanKernel::wgsl_program`]. The CUDA program compiles one kernel per plan instead
    /// ([`crate::codegen::plan_entries`]).
    pub fn pipeline_constants(&self) -> Vec<(String, u32)> {
        let mut out = vec![("PLAN_RULE".to_string(), self.rule)];
        for (s, f) in self.formats.iter().enumerate() {
            out.push((format!("PLAN_FORMAT_{s}"), f.map_or(0, |f| f.kernel_id())));
            out.push((format!("PLAN_AUX_{s}"), f.map_or(0, |f| f.kernel_aux())));
        }
        out
    }

    /// The WGSL program `program` (lpmm-wgpu's generated `lpmm.wgsl`) cut to this plan: the
    /// generated dispatch keeps only the cases of the plan's rule and slot formats (a `case
    /// RULE_<rule>` or `case FMT_<format>` line that calls a rule's or format's function), so the
    /// program reaches no other rule's or format's code and wgpu (naga's compaction for the entry
    /// point) hands the driver only this plan's. The plan's items never take a removed case: the
    /// result is the full program's, bit for bit. Built with [`PlanKernel::pipeline_constants`].
    pub fn wgsl_program(&self, program: &str) -> String {
        let formats: Vec<String> = self
            .formats
            .iter()
            .flatten()
            .map(|f| format!("FMT_{}", f.name().to_uppercase()))
            .collect();
        let rule = format!("RULE_{}", self.rule_name().to_uppercase());
        let keep = |line: &str| {
            let t = line.trim_start();
            let Some(case) = t.strip_prefix("case ") else {
                return true;
            };
            let id = case.split(':').next().unwrap_or("");
            if id.starts_with("FMT_") && t.contains("fmt_") {
                formats.iter().any(|f| f == id)
            } else if id.starts_with("RULE_") && t.contains("rule_") {
                id == rule
            } else {
                true
            }
        };
        let mut out = String::with_capacity(program.len());
        for line in program.lines().filter(|l| keep(l)) {
            out.push_str(line);
            out.push('\n');
        }
        out
    }

    /// Whether the kernel steps an item of `layout` with `rule`'s constants and this gradient
    /// input.
    pub fn matches(&self, layout: &ParamLayout, rule: &RuleConsts, input: GradInput) -> bool {
        let words = rule.words();
        self.rule == rule.kernel_id()
            && self.input == input
            && self.formats == layout.formats
            && self
                .options
                .iter()
                .all(|&(w, _, v)| words.get(w) == Some(&v))
    }
}

/// The configurations the plans are taken from: the presets a GPU user steps most (AdamW in f32,
/// 8-bit, 8-bit on bf16 parameters with nearest or stochastic rounding, 4-bit; LPMM-SGDM; 8-bit
/// Lion) and `bandwidth`'s 4-bit AdamW on bf16 parameters, each as registered for a tensor large
/// enough to be quantized.
fn configs() -> Vec<(&'static str, ParamConfig)> {
    vec![
        ("adamw_f32", presets::adamw_f32(1e-3).build()),
        ("adamw_8bit", presets::adamw_8bit(1e-3).build()),
        ("adamw_8bit_bf16", presets::adamw_8bit_bf16(1e-3).build()),
        (
            "adamw_8bit_bf16_sr",
            presets::adamw_8bit_bf16_sr(1e-3).build(),
        ),
        ("adamw_4bit", presets::adamw_4bit(1e-3).build()),
        (
            "adamw_4bit_bf16",
            presets::adamw_8bit_bf16(1e-3)
                .with_state1(Storage::FOUR_BIT_SIGNED)
                .with_state2(Storage::FOUR_BIT_UNSIGNED)
                .build(),
        ),
        (
            "adamw_4bit_bf16_sr_released",
            presets::adamw_4bit_bf16_sr_released(1e-3).build(),
        ),
        ("lpmm_sgdm", presets::lpmm_sgdm(0.05, 0.9).build()),
        ("lion_8bit", presets::lion_8bit(1e-4).build()),
    ]
}

/// The block of a block-wise format (its `kernel_aux`'s log2 of the block size).
fn block_of(format: Format) -> Option<usize> {
    (format.name() == "blockwise").then(|| 1 << ((format.kernel_aux() >> 8) & 0xFF))
}

/// Whether the kernels have a lane for `format`: f32, bf16, split f32, block-wise codes of blocks
/// up to 512 elements (a warp's 32 threads of 16 elements) whose map the specialized steps can
/// search exactly ([`buckets`]).
fn has_lane(format: Format) -> bool {
    match format.name() {
        "f32" | "bf16" | "split_f32" => true,
        "blockwise" => block_of(format).is_some_and(|b| b <= 512) && buckets(format).is_some(),
        _ => false,
    }
}

/// The bucket of `y` (`|y| <= 1`) among the logarithmic buckets of kernels/exact.cuh's
/// `exact_bucket`: the sign, exponent and top 7 mantissa bits of `max(|y|, 2^-31)`.
pub fn log_bucket(y: f32) -> u32 {
    let a = y.abs().max(f32::from_bits(0x3000_0000));
    ((a.to_bits() | (y.to_bits() & 0x8000_0000)) >> 16).wrapping_sub(0x3000)
}

/// The bucket of `y` (`|y| <= 1`) among the 257 linear buckets of kernels/exact.cuh's
/// `exact_linear_bucket`: `RN(128 y + 128)`.
pub fn linear_bucket(y: f32) -> u32 {
    y.mul_add(128.0, 12_583_040.0).to_bits() & 0x1FF
}

/// How a specialized step finds the code of a block-wise slot's value `y` (the quotient by its
/// block's absmax), if it can exactly (kernels/plan_lanes.cuh `plan_nearest`,
/// `plan_stochastic`): `Some(1)` with [`linear_bucket`]s, `Some(0)` with [`log_bucket`]s, each
/// holding at most one of the map's keys (its thresholds for nearest rounding, its values for
/// stochastic rounding), so a code is a count from a table plus one comparison (linear where
/// every key is a bucket apart: one instruction fewer). Also what the kernels' exact quotients
/// assume of the map (docs/FORMATS.md, "Exact shortcuts of the CUDA specialized steps"):
/// nearest rounding, that no threshold lies within 2^-28 of 0 (every quotient below 2^-30 in
/// magnitude, exact or not, has 0's code); stochastic rounding, distinct values whose steps are
/// within [2^-40, 2^40], and one code for every quotient within 2^-58 of 0 whatever its draw.
pub fn buckets(format: Format) -> Option<u32> {
    let map = format.map()?.shared();
    let keys: Vec<f32> = if format.stochastic() {
        let v = map.values();
        let steps_ok = v.windows(2).all(|w| {
            let step = w[1] - w[0];
            w[0] < w[1] && (2f32.powi(-40)..=2f32.powi(40)).contains(&step)
        });
        let tiny = 2f32.powi(-58);
        let one_code = map.stochastic(-tiny, 0xFFFF_0000) == map.stochastic(tiny, 0) && steps_ok;
        if !one_code {
            return None;
        }
        v.to_vec()
    } else {
        let t = map.thresholds();
        if t.iter().any(|x| x.abs() <= 2f32.powi(-28)) {
            return None;
        }
        t.to_vec()
    };
    if keys.iter().any(|k| !(-1.0..=1.0).contains(k)) {
        return None;
    }
    // Buckets are intervals: at most one key in each iff no two neighbouring keys share one.
    let apart = |f: fn(f32) -> u32| keys.windows(2).all(|w| f(w[0]) != f(w[1]));
    if apart(linear_bucket) {
        Some(1)
    } else if apart(log_bucket) {
        Some(0)
    } else {
        None
    }
}

fn build() -> Vec<PlanKernel> {
    let n = 1 << 20;
    let mut out = Vec::new();
    for (preset, config) in configs() {
        let resolved = config.resolve(n, &[n]);
        let formats = resolved.formats();
        if !formats.iter().flatten().all(|&f| has_lane(f)) {
            continue;
        }
        let consts = resolved.hyper.consts(1, &RuleState::default());
        let rule = consts.kernel_id();
        let words = consts.words();
        let options: Vec<(usize, &'static str, u32)> = RuleConsts::KERNELS[rule as usize]
            .2
            .iter()
            .enumerate()
            .filter(|(_, (_, t))| *t == FieldType::U32)
            .map(|(w, &(name, _))| (w, name, words[w]))
            .collect();
        let inputs: &[GradInput] = if formats[SlotKind::Grad as usize].is_some() {
            &[GradInput::None, GradInput::F32, GradInput::Bf16]
        } else {
            &[GradInput::F32, GradInput::Bf16]
        };
        for &input in inputs {
            let acc = formats[SlotKind::Grad as usize].is_some();
            let source = match (acc, input) {
                (true, GradInput::None) => "acc".to_string(),
                (true, i) => format!("acc_{}", i.suffix()),
                (false, i) => i.suffix().to_string(),
            };
            out.push(PlanKernel {
                name: format!("lpmm_plan_{preset}_{source}"),
                preset,
                config,
                rule,
                options: options.clone(),
                formats,
                input,
            });
        }
    }
    out
}

/// Every plan with a specialized kernel, in the order of the generated programs.
pub fn plans() -> &'static [PlanKernel] {
    static PLANS: OnceLock<Vec<PlanKernel>> = OnceLock::new();
    PLANS.get_or_init(build)
}

/// The plan (index into [`plans`]) that steps an item of `layout` with `rule`'s constants and
/// this gradient input, if one does.
pub fn find(layout: &ParamLayout, rule: &RuleConsts, input: GradInput) -> Option<usize> {
    plans().iter().position(|p| p.matches(layout, rule, input))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_hot_preset_has_its_plans_and_names_are_unique() {
        let plans = plans();
        for preset in [
            "adamw_f32",
            "adamw_8bit",
            "adamw_8bit_bf16",
            "adamw_8bit_bf16_sr",
            "adamw_4bit",
            "lpmm_sgdm",
            "lion_8bit",
        ] {
            assert!(
                plans.iter().filter(|p| p.preset == preset).count() == 3,
                "{preset}: acc, acc + f32, acc + bf16"
            );
        }
        let mut names: Vec<&str> = plans.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), plans.len());
        let adam = plans
            .iter()
            .find(|p| p.name == "lpmm_plan_adamw_8bit_bf16_acc")
            .unwrap();
        assert_eq!(adam.rule_name(), "adam");
    }

    #[test]
    fn every_shipped_map_has_buckets_and_the_linear_ones_are_linear() {
        use lpmm_optim::Storage;
        let kinds: Vec<(&str, Option<u32>)> = [
            ("8-bit signed", Storage::DYNAMIC8_SIGNED),
            ("8-bit unsigned", Storage::DYNAMIC8_UNSIGNED),
            ("4-bit signed", Storage::FOUR_BIT_SIGNED),
            ("4-bit unsigned", Storage::FOUR_BIT_UNSIGNED),
        ]
        .into_iter()
        .map(|(n, s)| (n, s.format().and_then(buckets)))
        .collect();
        assert_eq!(
            kinds,
            [
                ("8-bit signed", Some(0)),
                ("8-bit unsigned", Some(0)),
                ("4-bit signed", Some(0)),
                ("4-bit unsigned", Some(1)),
            ]
        );
        // LPMM-SGDM's stochastically rounded linear map.
        let sgdm = plans().iter().find(|p| p.preset == "lpmm_sgdm").unwrap();
        let f = sgdm.formats[0].unwrap();
        assert!(f.stochastic());
        assert_eq!(buckets(f), Some(1));
    }

    #[test]
    fn the_buckets_match_the_kernels() {
        // exact.cuh: the lowest positive bucket holds every magnitude below 2^-31 (1 + 2^-7);
        // the negative ones are 0x8000 above; 1.0 is the last.
        assert_eq!(log_bucket(0.0), 0);
        assert_eq!(log_bucket(1e-30), 0);
        assert_eq!(log_bucket(-0.0), 0x8000);
        assert_eq!(log_bucket(1.0), 0xF80);
        assert_eq!(log_bucket(-1.0), 0x8F80);
        assert_eq!(linear_bucket(-1.0), 0);
        assert_eq!(linear_bucket(0.0), 128);
        assert_eq!(linear_bucket(1.0), 256);
        // Monotone: neighbours never step back.
        let mut last = 0;
        for k in -1000..=1000 {
            let b = linear_bucket(k as f32 / 1000.0);
            assert!(b >= last);
            last = b;
        }
    }
}
