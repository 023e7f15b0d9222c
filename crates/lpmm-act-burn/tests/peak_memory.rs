//! The lpmm-act block's training step holds less and peaks lower than the baseline's, measured
//! with a counting global allocator (one test in this binary, so no other test's allocations are
//! counted). Speed is never asserted.

mod common;

use burn_tensor::Device;
use common::counting::{self, Counting};
use lpmm_act_burn::block::{Block, BlockConfig, Rng, Variant};

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn lpmm_act_block_peaks_lower_than_the_baseline() {
    let device = Device::flex().autodiff();
    let cfg = BlockConfig::small();
    let block = Block::new(cfg, &device, 1);
    let mut rng = Rng::new(2);
    let shape = [cfg.batch, cfg.seq, cfg.d_model];
    let x = rng.tensor(shape, 1.0, &device);
    let target = rng.tensor(shape, 1.0, &device);
    let base = counting::measure(&block, &x, &target, Variant::Baseline, 3);
    eprintln!("{:?}: {base:?}", Variant::Baseline);
    let mut held = Vec::new();
    for v in Variant::ALL.into_iter().skip(1) {
        let m = counting::measure(&block, &x, &target, v, 3);
        held.push(m.held_after_forward);
        eprintln!("{v:?}: {m:?}");
        assert!(m.loss.is_finite() && m.median_ms >= 0.0);
        assert!(
            m.peak < base.peak,
            "{v:?}: peak {} >= baseline {}",
            m.peak,
            base.peak
        );
        assert!(
            m.held_after_forward < base.held_after_forward,
            "{v:?}: held {} >= baseline {}",
            m.held_after_forward,
            base.held_after_forward
        );
    }
    // The 8-bit projection inputs hold less than the same block keeping them in f32.
    let (few_bit, compressed) = (held[2], held[3]);
    assert!(
        compressed < few_bit,
        "compressed {compressed} >= few-bit {few_bit}"
    );
}
