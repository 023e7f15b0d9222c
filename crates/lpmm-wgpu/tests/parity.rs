//! The wgpu backend against the CPU reference, bit for bit: lpmm-optim's conformance suite
//! (every optimizer with every storage of every slot, rank-1 and factorized second moments,
//! over several steps, with parameters that span pieces and segments, thousands of elements in
//! tensors of a few dozen, micro-batches, gradient release, clipping and non-finite gradients,
//! reads, checkpoints between backends). On lavapipe (IEEE f32 division and square root) every
//! bit must agree.

mod common;

lpmm_optim::conformance_tests!(common::backend(common::small()));
