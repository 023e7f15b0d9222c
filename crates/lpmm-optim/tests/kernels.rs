//! Every specialized step kernel gives its generic twin's bits: each plan the CPU specializes,
//! stepped from the same inputs by an optimizer on the specialized kernels and one on the generic
//! element-wise path (`Optimizer::set_specialized_kernels(false)`), at every SIMD level this CPU
//! has, compared bit for bit in every region of every slot and in the step reports — with
//! non-finite gradients, results that overflow their slot, subnormals, and lengths that are not
//! multiples of 16, 256 or 4096 (and one over several pieces of 2^16 elements). Then the same bits on 1,
//! 2 and 8 threads.

use lpmm_formats::simd::{self, Level};
use lpmm_optim::{
    Adam, HostSlot, Hyper, NonFinitePolicy, Optimizer, OptimizerOptions, ParamConfig, ParamId,
    SlotKind, Storage, StoreRounding, presets,
};
use lpmm_optim::{Checkpoint, Parts};

/// How a case feeds its gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Feed {
    /// `Step::param` with an f32 gradient (read where it is held).
    Released,
    /// `Step::param` with a bf16 gradient.
    ReleasedBf16,
    /// `accumulate` twice, then `step()` from the accumulator.
    Accumulated,
    /// `accumulate` once, then `Step::param` (accumulator plus released gradient).
    Both,
    /// `Step::states_only` (optimizer accumulation: the parameter does not move) then a
    /// `Step::param`.
    States,
}

/// The plans the CPU specializes, with the feeds that reach them.
fn cases() -> Vec<(&'static str, ParamConfig, Vec<Feed>)> {
    use Feed::*;
    let acc = vec![Released, Accumulated, Both, States];
    let released = vec![Released, ReleasedBf16, States];
    vec![
        ("adamw_f32", presets::adamw_f32(1e-3).build(), acc.clone()),
        (
            "sgdm_f32",
            presets::sgdm_f32(1e-2, 0.9).build(),
            acc.clone(),
        ),
        (
            "sgdm_f32_nesterov_l2",
            presets::sgdm_f32(1e-2, 0.9)
                .nesterov(true)
                .weight_decay(1e-4)
                .build(),
            vec![Released],
        ),
        ("adamw_8bit", presets::adamw_8bit(1e-3).build(), acc.clone()),
        (
            "adam_l2_8bit",
            presets::adamw_8bit(1e-3)
                .build()
                .with_hyper(Hyper::Adam(Adam::new(1e-3).weight_decay(1e-2))),
            vec![Released, States],
        ),
        (
            "adamw_8bit_bf16",
            presets::adamw_8bit_bf16(1e-3).build(),
            acc.clone(),
        ),
        (
            "adamw_8bit_bf16_sr",
            presets::adamw_8bit_bf16_sr(1e-3).build(),
            acc.clone(),
        ),
        ("adamw_4bit", presets::adamw_4bit(1e-3).build(), acc.clone()),
        (
            "adamw_4bit_split",
            presets::adamw_4bit_split(1e-3).build(),
            acc.clone(),
        ),
        (
            "adamw_4bit_bf16_sr_released",
            presets::adamw_4bit_bf16_sr_released(1e-3).build(),
            released,
        ),
        (
            "lpmm_sgdm",
            presets::lpmm_sgdm(1e-2, 0.9).build(),
            acc.clone(),
        ),
        ("lion_f32", presets::lion_f32(1e-4).build(), vec![Released]),
        ("lion_8bit", presets::lion_8bit(1e-4).build(), acc.clone()),
        (
            "bf16_nearest_adamw",
            presets::bf16_nearest(Hyper::adamw(1e-3)).build(),
            acc.clone(),
        ),
        (
            "ademamix_8bit",
            presets::ademamix_8bit(1e-3).build(),
            vec![Released],
        ),
        (
            "schedule_free_adamw_8bit",
            presets::schedule_free_adamw_8bit(2.5e-3).build(),
            vec![Released, Accumulated],
        ),
        (
            "rmsprop_f32",
            presets::rmsprop_f32(1e-3).build(),
            acc.clone(),
        ),
        (
            "rmsprop_8bit",
            presets::rmsprop_8bit(1e-3).build(),
            acc.clone(),
        ),
        (
            "rmsprop_8bit_momentum_centered_l2",
            presets::rmsprop_8bit(1e-3)
                .momentum(0.9)
                .centered(true)
                .weight_decay(1e-2)
                .build(),
            vec![Released, States],
        ),
        (
            "adagrad_f32",
            presets::adagrad_f32(1e-2).build(),
            vec![Released],
        ),
        (
            "adagrad_8bit_init_decay",
            presets::adagrad_8bit(1e-2)
                .initial_accumulator_value(0.1)
                .lr_decay(1e-2)
                .build(),
            acc.clone(),
        ),
        (
            "adamw_8bit_f32_acc_sr_param",
            presets::adamw_8bit(1e-3)
                .build()
                .with_param(Storage::Bf16(StoreRounding::Stochastic))
                .with_grad(Storage::F32),
            vec![Accumulated],
        ),
        (
            "adamw_8bit_acc",
            presets::adamw_8bit(1e-3)
                .build()
                .with_grad(Storage::LINEAR8_GROUP64_SR),
            vec![Accumulated, Both],
        ),
    ]
}

/// Element counts: a tail of 5 lanes, not a multiple of 256, of 4096, several tiles and one
/// over four pieces (of 2^16 elements) and part of a fifth.
const SHAPES: [&[usize]; 5] = [&[37], &[5000], &[3, 4101], &[64, 70], &[(1 << 18) + 300]];

fn gradient(k: usize, step: usize, n: usize, bounded: bool) -> Vec<f32> {
    let mut g: Vec<f32> = (0..n)
        .map(|i| {
            let x = ((i * 7919 + k * 31 + step * 17) % 2003) as f32 - 1001.0;
            x * 1e-4 * (1.0 + (i % 13) as f32)
        })
        .collect();
    // A subnormal and, step by step, one element that must be left unchanged: a non-finite
    // gradient (where the accumulator can hold it) or one whose update overflows, in the last
    // lanes of the tensor (its tail), in the middle (a whole group) or none.
    g[3] = 1e-41;
    let special = match step {
        0 => Some(n - 1),
        1 => Some(n / 2),
        _ => None,
    };
    if let Some(at) = special {
        g[at] = match (bounded, k % 2) {
            (false, 0) => f32::NAN,
            (false, _) => f32::INFINITY,
            (true, _) => 1e38,
        };
    }
    g
}

/// Every slot's regions and every step's report after a few steps of `config` fed by `feed`.
fn run(config: ParamConfig, feed: Feed, specialized: bool) -> (Vec<HostSlot>, Vec<String>) {
    let mut opt = Optimizer::new(
        OptimizerOptions::default()
            .with_seed(5)
            .with_non_finite(NonFinitePolicy::SkipElements),
    )
    .unwrap();
    opt.settings_mut().specialized_kernels = specialized;
    // A quantized accumulator refuses a non-finite micro-batch: those runs keep gradients finite.
    let bounded = matches!(config.grad, Storage::Quantized { .. })
        && matches!(feed, Feed::Accumulated | Feed::Both);
    let g = opt.add_group(config).unwrap();
    let mut ids: Vec<(ParamId, usize)> = Vec::new();
    for (k, shape) in SHAPES.iter().enumerate() {
        let n: usize = shape.iter().product();
        let init: Vec<f32> = (0..n)
            .map(|i| match i % 97 {
                0 => 1e-40,
                1 => 3.0e38,
                _ => ((i * 7919 + k) % 1000) as f32 * 1e-3 - 0.5,
            })
            .collect();
        ids.push((opt.add_param(&format!("p{k}"), shape, &init, g).unwrap(), n));
    }
    let mut reports = Vec::new();
    for step in 0..3 {
        for (k, &(id, n)) in ids.iter().enumerate() {
            let grad = gradient(k, step, n, bounded);
            let report = match feed {
                Feed::Released => opt.step(lpmm_optim::Step::param(id, &grad)).unwrap(),
                Feed::ReleasedBf16 => {
                    let b: Vec<half::bf16> =
                        grad.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    opt.step(lpmm_optim::Step::param(
                        id,
                        lpmm_optim::Grad::Input(lpmm_optim::backend::HostValues::Bf16(&b)),
                    ))
                    .unwrap()
                }
                Feed::Accumulated => {
                    opt.accumulate(id, &grad).unwrap();
                    let again: Vec<f32> = grad.iter().map(|x| x * 0.5).collect();
                    opt.accumulate(id, &again).unwrap();
                    continue;
                }
                Feed::Both => {
                    opt.accumulate(id, &grad).unwrap();
                    let again: Vec<f32> = grad.iter().map(|x| -x * 0.25).collect();
                    opt.step(lpmm_optim::Step::param(id, &again)).unwrap()
                }
                Feed::States => {
                    opt.step(lpmm_optim::Step::states_only(id, &grad)).unwrap();
                    opt.step(lpmm_optim::Step::param(id, &grad)).unwrap()
                }
            };
            reports.push(format!("{report:?}"));
        }
        if feed == Feed::Accumulated {
            reports.push(format!("{:?}", opt.step(lpmm_optim::Accumulated).unwrap()));
        }
    }
    let mut slots = Vec::new();
    for &(id, _) in &ids {
        for slot in SlotKind::ALL {
            slots.push(Parts::of(&opt).export_slot(id, slot, None).unwrap());
        }
    }
    (slots, reports)
}

fn kernel_of(config: ParamConfig) -> String {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(config).unwrap();
    let id = opt.add_param("w", &[50, 100], &vec![0.0; 5000], g).unwrap();
    lpmm_optim::Cpu::kernel_name(&opt.param(id).map(|p| p.plan).unwrap())
}

#[test]
fn every_specialized_plan_gives_its_generic_twins_bits_at_every_level() {
    let levels: Vec<Level> = Level::ALL
        .into_iter()
        .filter(|&l| l <= simd::detected())
        .collect();
    eprintln!(
        "this CPU: {:?}; levels compared: {levels:?}",
        simd::detected()
    );
    for (name, config, feeds) in cases() {
        let kernel = kernel_of(config);
        assert_ne!(kernel, "generic", "{name} has no specialized kernel");
        for &feed in &feeds {
            simd::force(Some(Level::Portable));
            let reference = run(config, feed, false);
            for &level in &levels {
                assert_eq!(simd::force(Some(level)), level);
                let got = run(config, feed, true);
                for (k, (a, b)) in got.0.iter().zip(&reference.0).enumerate() {
                    assert!(
                        a == b,
                        "{name} ({kernel}), {feed:?}, {level:?}: parameter {} slot {:?} differs",
                        k / 5,
                        SlotKind::ALL[k % 5]
                    );
                }
                assert_eq!(got.1, reference.1, "{name}, {feed:?}, {level:?}: reports");
            }
        }
    }
    simd::force(None);
}

#[test]
fn the_generic_path_stays_for_what_no_kernel_covers() {
    // Kahan parameters, factorized and rank-1 second moments, blocks above the tile (512).
    let generic = [
        ParamConfig::f32(Hyper::adamw(1e-3)).with_param(Storage::Bf16Kahan),
        presets::adafactor_lpmm().build(),
        presets::came_lpmm(1e-3).build(),
        presets::adamw_8bit(1e-3)
            .build()
            .with_state2(Storage::Rank1 {
                map: lpmm_optim::MapKind::DynamicUnsigned8,
                fallback: lpmm_quant::BlockSize::B256,
            }),
        presets::adamw_8bit(1e-3)
            .build()
            .with_state1(Storage::Quantized {
                map: lpmm_optim::MapKind::DynamicSigned8,
                block: lpmm_quant::BlockSize::new(2048).unwrap(),
                rounding: StoreRounding::Nearest,
            }),
    ];
    for config in generic {
        assert_eq!(kernel_of(config), "generic", "{config:?}");
    }
}

#[test]
fn the_same_bits_on_one_two_and_eight_threads() {
    let on = |threads: usize, config: ParamConfig, feed: Feed| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| run(config, feed, true))
    };
    for (name, config, feeds) in cases() {
        let feed = feeds[0];
        let one = on(1, config, feed);
        for threads in [2, 8] {
            assert!(
                on(threads, config, feed) == one,
                "{name}: {threads} threads"
            );
        }
    }
}

#[test]
fn load_state_keeps_the_generic_path_when_it_was_chosen() {
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_8bit(1e-3)).unwrap();
    let id = opt.add_param("w", &[5000], &vec![0.1; 5000], g).unwrap();
    opt.step(lpmm_optim::Step::param(id, &vec![1e-3; 5000]))
        .unwrap();
    opt.settings_mut().specialized_kernels = false;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    opt.save(&path, Checkpoint::new()).unwrap();
    opt.load(&path, Checkpoint::new()).unwrap();
    assert_eq!(
        lpmm_optim::Cpu::kernel_name(&opt.param(id).map(|p| p.plan).unwrap()),
        "generic"
    );
    opt.settings_mut().specialized_kernels = true;
    opt.load(&path, Checkpoint::new()).unwrap();
    assert_ne!(
        lpmm_optim::Cpu::kernel_name(&opt.param(id).map(|p| p.plan).unwrap()),
        "generic"
    );
}
