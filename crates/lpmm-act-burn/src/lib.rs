//! burn integration for lpmm-act: custom autodiff operators whose saved state is only lpmm-act's
//! compact residual, so that the memory a training step holds for its backward pass really
//! shrinks.
//!
//! burn-autodiff lets a custom backward op choose its state: `Backward::prepare` /
//! `compute_bound` / `stateful` / `finish(state, output)`, and nothing else of the op is kept by
//! the graph. [`ops`] implements the operators on burn-autodiff's primitives for any inner backend
//! `B`; the functions here apply them to burn's high-level [`Tensor`] on the backend of its device
//! (with or without `.autodiff()`, either checkpointing strategy): burn-flex, burn 0.22's CPU
//! backend (`Device::flex()`, lpmm-act's host kernels), and with feature `wgpu` burn's cubecl
//! backend (`Device::wgpu(..)` and every cubecl runtime: the operators' CubeCL kernels,
//! [`cube`], on the device's buffers, no host read; [`kernels`] says what each backend keeps):
//!
//! - [`few_bit`] ([`gelu_few_bit`]): an activation ([`FewBit`]: GELU, SiLU, tanh, sigmoid, ReLU)
//!   saving the packed `b`-bit codes of its input ([`Table`]).
//! - [`gelu_from_output`]: exact GELU saving a 1-bit branch mask beside its output, which the next
//!   layer saves anyway (the op holds a handle to the same buffer).
//! - [`layer_norm_from_output`]: LayerNorm saving one rstd per row beside its output (shared
//!   likewise); γ and β are parameters.
//! - [`softmax_dropout`]: softmax and dropout saving the softmax output and a 1-bit keep mask.
//! - [`matmul_compressed`]: a matmul keeping its input compressed to 2, 4 or 8 bits per element
//!   (stochastic rounding: the weight gradient is unbiased) instead of the input.
//! - [`softmax_dropout_matmul`]: the same followed by `· v`, fused so that the dropout output
//!   (which the matmul would save) is recomputed from the softmax output and the mask instead.
//!
//! Inputs without autodiff are lifted as constants with the default strategy (so under
//! `gradient_checkpointing()` every input must already be on the autodiff device); tensors of
//! another backend (burn's deprecated ndarray, libtorch) make these functions panic (use [`ops`]
//! with that backend instead).
//!
//! [`block`] builds a pre-LN transformer block with burn's own operators and with these, for the
//! memory and time comparison of `examples/block_memory.rs`.

pub mod block;
#[cfg(feature = "wgpu")]
pub mod cube;
pub mod kernels;
pub mod ops;

use std::sync::Arc;

use burn_autodiff::{
    Autodiff,
    checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing},
};
use burn_dispatch::DispatchDevice;
use burn_tensor::{GradientCheckpointingStrategy, Tensor};
pub use kernels::host_reads;
pub use lpmm_act::{Activation, Grid, Table, Weight};
pub use lpmm_quant::{BlockSize, RandomStream};
pub use ops::FewBit;

/// The CPU backend the high-level functions run on: burn-flex (burn 0.22's CPU backend; burn's
/// ndarray backend is deprecated).
pub type Cpu = burn_flex::Flex;

/// burn's cubecl backend (wgpu, and every cubecl runtime), as burn's dispatch holds it.
#[cfg(feature = "wgpu")]
pub type Cube = burn_cubecl::Cube;

/// The `bits`-bit few-bit GELU table for N(0, 1)-distributed pre-activations (lpmm-act's optimal
/// piecewise-constant derivative on the default grid, N(0, 1)-weighted). Panics outside 1..=8.
pub fn gelu_table(bits: u32) -> Arc<Table> {
    Arc::new(
        Table::solve(Activation::Gelu, bits, Weight::STANDARD, Grid::default())
            .unwrap_or_else(|e| panic!("few-bit GELU table: {e}")),
    )
}

/// Runs `$body` with `$B` bound to the inner backend of tensor `$x`'s device and `$C` to its
/// checkpointing strategy (an autodiff device).
macro_rules! with_backend {
    ($x:expr, $B:ident, $C:ident => $body:expr) => {{
        let device = $x.device();
        match device.clone().inner().as_dispatch() {
            DispatchDevice::Flex(_) => {
                type $B = Cpu;
                with_strategy!(device, $C => $body)
            }
            #[cfg(feature = "wgpu")]
            DispatchDevice::Cube(_) => {
                type $B = Cube;
                with_strategy!(device, $C => $body)
            }
            #[allow(unreachable_patterns)]
            other => panic!(
                "lpmm-act-burn's operators run on burn-flex (Device::flex()) and, with feature `wgpu`, burn's cubecl devices; not {other:?}"
            ),
        }
    }};
}

/// Runs `$body` with `$C` bound to the checkpointing strategy of `$device` (an autodiff device).
macro_rules! with_strategy {
    ($device:expr, $C:ident => $body:expr) => {
        match $device.gradient_checkpointing_strategy() {
            Some(GradientCheckpointingStrategy::Balanced) => {
                type $C = BalancedCheckpointing;
                $body
            }
            _ => {
                type $C = NoCheckpointing;
                $body
            }
        }
    };
}

/// The autodiff primitive of `$t` on backend `$B` with strategy `$C`.
macro_rules! primitive {
    ($t:expr, $B:ty, $C:ty) => {
        $t.try_into_primitive::<Autodiff<$B, $C>>()
            .unwrap_or_else(|e| {
                panic!("lpmm-act-burn's operators need all their tensors on one device: {e:?}")
            })
    };
}

/// The high-level tensor of an autodiff primitive of backend `$B` with strategy `$C`.
macro_rules! wrap {
    ($t:expr, $B:ty, $C:ty) => {
        Tensor::from_primitive::<Autodiff<$B, $C>>($t)
    };
}

/// Runs an operator on autodiff primitives: inputs without autodiff are lifted (as constants) and
/// the output is lowered back when the first input had none.
fn lifted<const D: usize>(x: Tensor<D>, op: impl FnOnce(Tensor<D>) -> Tensor<D>) -> Tensor<D> {
    if x.is_autodiff() {
        op(x)
    } else {
        op(x.autodiff()).without_autodiff()
    }
}

/// GELU (exact forward) whose backward multiplies by `table`'s piecewise-constant derivative; the
/// graph keeps `table.bits` bits per element. See [`ops::gelu_few_bit`].
pub fn gelu_few_bit<const D: usize>(x: Tensor<D>, table: &Arc<Table>) -> Tensor<D> {
    few_bit(x, FewBit::Gelu, table)
}

/// `act` (the backend's exact forward) whose backward multiplies by `table`'s piecewise-constant
/// derivative; the graph keeps `table.bits` bits per element. See [`ops::few_bit`].
pub fn few_bit<const D: usize>(x: Tensor<D>, act: FewBit, table: &Arc<Table>) -> Tensor<D> {
    lifted(x, |x| {
        with_backend!(x, B, C => {
            let y = ops::few_bit::<B, C>(primitive!(x, B, C), act, table.clone());
            wrap!(y, B, C)
        })
    })
}

/// Exact GELU whose backward works from its output and a 1-bit branch mask. See
/// [`ops::gelu_from_output`].
pub fn gelu_from_output<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    lifted(x, |x| {
        with_backend!(x, B, C => {
            let y = ops::gelu_from_output::<B, C>(primitive!(x, B, C));
            wrap!(y, B, C)
        })
    })
}

/// LayerNorm over the last dimension whose backward works from its output and one rstd per row.
/// See [`ops::layer_norm_from_output`].
pub fn layer_norm_from_output<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    eps: f32,
) -> Tensor<D> {
    lifted(x, |x| {
        let (gamma, beta) = (gamma.autodiff(), beta.autodiff());
        with_backend!(x, B, C => {
            let y = ops::layer_norm_from_output::<B, C>(
                primitive!(x, B, C),
                primitive!(gamma, B, C),
                primitive!(beta, B, C),
                eps,
            );
            wrap!(y, B, C)
        })
    })
}

/// softmax over the last dimension then dropout (drop probability `p`, keep mask from `stream`),
/// keeping the softmax output and a 1-bit mask. See [`ops::softmax_dropout`].
pub fn softmax_dropout<const D: usize>(x: Tensor<D>, p: f32, stream: &RandomStream) -> Tensor<D> {
    lifted(x, |x| {
        with_backend!(x, B, C => {
            let y = ops::softmax_dropout::<B, C>(primitive!(x, B, C), p, stream);
            wrap!(y, B, C)
        })
    })
}

/// `x · w` (`x` `[.., k]`, `w` `[k, m]`) keeping `x` compressed to `bits` (2, 4 or 8) per element
/// in blocks of 256 (stochastic rounding from `stream`) for `dw`. See [`ops::matmul_compressed`].
pub fn matmul_compressed<const D: usize>(
    x: Tensor<D>,
    w: Tensor<2>,
    bits: u32,
    stream: &RandomStream,
) -> Tensor<D> {
    lifted(x, |x| {
        let w = w.autodiff();
        with_backend!(x, B, C => {
            let y = ops::matmul_compressed::<B, C>(
                primitive!(x, B, C),
                primitive!(w, B, C),
                bits,
                BlockSize::new(256).expect("256 is a block size"),
                stream,
            );
            wrap!(y, B, C)
        })
    })
}

/// `dropout(softmax(scores)) · v`, keeping the softmax output, a 1-bit mask and `v` (not the
/// dropout output). See [`ops::softmax_dropout_matmul`].
pub fn softmax_dropout_matmul<const D: usize>(
    scores: Tensor<D>,
    v: Tensor<D>,
    p: f32,
    stream: &RandomStream,
) -> Tensor<D> {
    lifted(scores, |scores| {
        let v = v.autodiff();
        with_backend!(scores, B, C => {
            let y = ops::softmax_dropout_matmul::<B, C>(
                primitive!(scores, B, C),
                primitive!(v, B, C),
                p,
                stream,
            );
            wrap!(y, B, C)
        })
    })
}
