//! The wgpu backend against the CPU reference, bit for bit (lpmm-optim's conformance suite):
//! every optimizer with every storage of every slot, over several steps, with parameters that
//! span pieces and segments, thousands of elements in tensors of a few dozen, micro-batches,
//! gradient release, clipping and non-finite gradients. On lavapipe (IEEE f32 division and square
//! root) every bit must agree.

mod common;

use common::{backend, small};
use lpmm_optim::testing;

#[test]
fn presets_are_bit_exact() {
    let Some(gpu) = backend(small()) else { return };
    testing::presets_are_bit_exact(&gpu);
    assert!(
        gpu.segments() > 1,
        "the parameters must span several segments"
    );
}

#[test]
fn every_optimizer_with_every_storage_is_bit_exact() {
    let Some(gpu) = backend(small()) else { return };
    testing::every_optimizer_with_every_storage_is_bit_exact(&gpu);
}

#[test]
fn clipping_and_non_finite_gradients_are_bit_exact() {
    let Some(gpu) = backend(small()) else { return };
    testing::clipping_and_non_finite_gradients_are_bit_exact(&gpu);
}

#[test]
fn reads_decode_as_the_cpu_does() {
    let Some(gpu) = backend(small()) else { return };
    testing::reads_decode_as_the_cpu_does(&gpu);
}
