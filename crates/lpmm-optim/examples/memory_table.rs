//! Model memory per parameter for the standard presets, as the optimizer allocates it.
//!
//! `cargo run -p lpmm-optim --example memory_table`
//!
//! The model is a stack of 12 transformer-like blocks (d = 512: four 512x512 attention matrices,
//! 512x2048 and 2048x512 MLP matrices, biases and norm gains) plus a 4096x512 embedding (the
//! example prints the exact count: 39,882,752). Every figure is `Optimizer::memory_report()`, the bytes the slots allocate
//! (tested equal to what the allocator hands out).

use lpmm_optim::{Hyper, Optimizer, OptimizerOptions, ParamConfig, presets};

fn model() -> Vec<(String, Vec<usize>)> {
    let d = 512;
    let mut shapes = vec![("embedding".to_string(), vec![4096, d])];
    for l in 0..12 {
        for (name, shape) in [
            ("q", vec![d, d]),
            ("k", vec![d, d]),
            ("v", vec![d, d]),
            ("o", vec![d, d]),
            ("mlp_in", vec![d, 4 * d]),
            ("mlp_out", vec![4 * d, d]),
            ("mlp_bias", vec![4 * d]),
            ("norm1", vec![d]),
            ("norm2", vec![d]),
        ] {
            shapes.push((format!("block{l}.{name}"), shape));
        }
    }
    shapes
}

fn bytes(config: ParamConfig) -> (usize, [usize; 5], usize) {
    let mut opt = Optimizer::new(OptimizerOptions::default()).expect("valid options");
    let group = opt.add_group(config).expect("valid preset");
    for (name, shape) in model() {
        let n: usize = shape.iter().product();
        opt.add_param(&name, &shape, &vec![0.0; n], group)
            .expect("valid parameter");
    }
    let report = opt.memory_report();
    (report.numel(), report.slot_totals(), report.total())
}

fn main() {
    let lr = 1e-3;
    let rows: [(&str, ParamConfig, &str); 30] = [
        ("f32 SGDM", presets::sgdm_f32(lr, 0.9).build(), "f32 SGDM"),
        (
            "LPMM-SGDM (8-bit param, grad, momentum; SR)",
            presets::lpmm_sgdm(lr, 0.9).build(),
            "f32 SGDM",
        ),
        (
            "bf16 SGDM, round to nearest",
            presets::bf16_nearest(Hyper::sgd(lr, 0.9)).build(),
            "f32 SGDM",
        ),
        ("f32 AdamW", presets::adamw_f32(lr).build(), "f32 AdamW"),
        (
            "8-bit AdamW, f32 param+grad (bitsandbytes AdamW8bit)",
            presets::adamw_8bit(lr).build(),
            "f32 AdamW",
        ),
        (
            "4-bit AdamW, f32 param+grad",
            presets::adamw_4bit(lr).build(),
            "f32 AdamW",
        ),
        (
            "8-bit AdamW, bf16 param+grad",
            presets::adamw_8bit_bf16(lr).build(),
            "f32 AdamW",
        ),
        (
            "8-bit AdamW, bf16 SR param+grad",
            presets::adamw_8bit_bf16_sr(lr).build(),
            "f32 AdamW",
        ),
        (
            "8-bit AdamW, bf16+8 (24-bit) param, bf16 grad",
            presets::adamw_8bit_bf16_plus8(lr).build(),
            "f32 AdamW",
        ),
        (
            "4-bit AdamW, split-f32 param, bf16 grad",
            presets::adamw_4bit_split(lr).build(),
            "f32 AdamW",
        ),
        (
            "bf16 AdamW, round to nearest",
            presets::bf16_nearest(Hyper::adamw(lr)).build(),
            "f32 AdamW",
        ),
        (
            "4-bit AdamW, bf16 SR param, gradients released",
            presets::adamw_4bit_bf16_sr_released(lr).build(),
            "f32 AdamW",
        ),
        ("f32 Lion", presets::lion_f32(lr).build(), "f32 Lion"),
        (
            "8-bit Lion, f32 param+grad (bitsandbytes Lion8bit)",
            presets::lion_8bit(lr).build(),
            "f32 Lion",
        ),
        (
            "f32 Adafactor (factorized second moment, no first moment)",
            presets::adafactor_f32().build(),
            "f32 AdamW",
        ),
        (
            "Adafactor, 8-bit first moment, f32 param+grad",
            presets::adafactor_8bit().build(),
            "f32 AdamW",
        ),
        (
            "Adafactor LPMM (8-bit param, grad, first moment; SR)",
            presets::adafactor_lpmm().build(),
            "f32 AdamW",
        ),
        (
            "f32 CAME (factorized second moment and instability)",
            presets::came_f32(lr).build(),
            "f32 AdamW",
        ),
        (
            "CAME, 8-bit first moment, f32 param+grad",
            presets::came_8bit(lr).build(),
            "f32 AdamW",
        ),
        (
            "CAME LPMM (8-bit param, grad, first moment; SR)",
            presets::came_lpmm(lr).build(),
            "f32 AdamW",
        ),
        (
            "f32 AdEMAMix",
            presets::ademamix_f32(lr).build(),
            "f32 AdEMAMix",
        ),
        (
            "8-bit AdEMAMix, f32 param+grad (bitsandbytes AdEMAMix8bit)",
            presets::ademamix_8bit(lr).build(),
            "f32 AdEMAMix",
        ),
        (
            "f32 schedule-free AdamW",
            presets::schedule_free_adamw_f32(lr).build(),
            "f32 schedule-free AdamW",
        ),
        (
            "schedule-free AdamW, 8-bit second moment, bf16 SR z",
            presets::schedule_free_adamw_8bit(lr).build(),
            "f32 schedule-free AdamW",
        ),
        (
            "f32 RMSprop",
            presets::rmsprop_f32(lr).build(),
            "f32 RMSprop",
        ),
        (
            "8-bit RMSprop, f32 param+grad (bitsandbytes RMSprop8bit layout)",
            presets::rmsprop_8bit(lr).build(),
            "f32 RMSprop",
        ),
        (
            "f32 Adagrad",
            presets::adagrad_f32(lr).build(),
            "f32 Adagrad",
        ),
        (
            "8-bit Adagrad, f32 param+grad (bitsandbytes Adagrad8bit layout)",
            presets::adagrad_8bit(lr).build(),
            "f32 Adagrad",
        ),
        ("f32 LAMB", presets::lamb_f32(lr).build(), "f32 LAMB"),
        (
            "8-bit LAMB, f32 param+grad (bitsandbytes LAMB8bit layout)",
            presets::lamb_8bit(lr).build(),
            "f32 LAMB",
        ),
    ];
    let reference = |name: &str| {
        let config = rows
            .iter()
            .find(|r| r.0 == name)
            .map(|r| r.1)
            .expect("reference row");
        bytes(config).2
    };
    let (numel, _, _) = bytes(presets::sgdm_f32(lr, 0.9).build());
    println!("model: {} tensors, {numel} parameters\n", model().len());
    println!("| preset | param B/p | grad B/p | states B/p | total B/p | vs its f32 reference |");
    println!("|---|---|---|---|---|---|");
    for (name, config, against) in rows {
        let (n, slots, total) = bytes(config);
        let per = |b: usize| b as f64 / n as f64;
        let reduction = 100.0 * (1.0 - total as f64 / reference(against) as f64);
        println!(
            "| {name} | {:.4} | {:.4} | {:.4} | {:.4} | {} |",
            per(slots[0]),
            per(slots[1]),
            per(slots[2] + slots[3] + slots[4]),
            per(total),
            if name == against {
                "reference".to_string()
            } else {
                format!("-{reduction:.1}% vs {against}")
            }
        );
    }
}
