//! The engine: the lpmm optimizer of the `Var`s' device, and the macros that run code on it
//! whatever its backend.

#[cfg(feature = "cuda")]
use candle_core::Error;
use candle_core::Result;
use lpmm_optim::{Cpu, Optimizer};

#[cfg(feature = "cuda")]
use crate::cuda;

/// The lpmm optimizer on the backend of the `Var`s' device: the CPU, or (feature `cuda`) lpmm-cuda
/// on the candle CUDA device's own stream.
#[derive(Debug)]
pub(crate) enum Engine {
    Cpu(Optimizer<Cpu>),
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaEngine),
}

/// Runs `$body` with `$o` bound to the engine's optimizer (`&mut`), whatever its backend.
macro_rules! on_engine {
    ($engine:expr, $o:ident => $body:expr) => {
        match $engine {
            $crate::engine::Engine::Cpu($o) => $body,
            #[cfg(feature = "cuda")]
            $crate::engine::Engine::Cuda(e) => {
                let $o = &mut e.opt;
                $body
            }
        }
    };
}

pub(crate) use on_engine;

/// `on_engine!` for a shared borrow.
macro_rules! on_engine_ref {
    ($engine:expr, $o:ident => $body:expr) => {
        match $engine {
            $crate::engine::Engine::Cpu($o) => $body,
            #[cfg(feature = "cuda")]
            $crate::engine::Engine::Cuda(e) => {
                let $o = &e.opt;
                $body
            }
        }
    };
}

pub(crate) use on_engine_ref;

impl Engine {
    /// The CPU optimizer.
    pub(crate) fn cpu(&self) -> Result<&Optimizer<Cpu>> {
        match self {
            Engine::Cpu(o) => Ok(o),
            #[cfg(feature = "cuda")]
            Engine::Cuda(_) => Err(Error::Msg(
                "this optimizer steps CUDA parameters: its lpmm optimizer is lpmm-cuda's \
                 (LpmmOptimizer::with_cuda_optimizer)"
                    .into(),
            )),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        on_engine_ref!(self, o => o.params().next().is_none())
    }

    /// A short name of the device ("cpu", "cuda:0").
    pub(crate) fn device_name(&self) -> String {
        match self {
            Engine::Cpu(_) => "cpu".into(),
            #[cfg(feature = "cuda")]
            Engine::Cuda(e) => e.name(),
        }
    }

    /// Whether `device` is this engine's device.
    pub(crate) fn owns(&self, device: &candle_core::Device) -> bool {
        match self {
            Engine::Cpu(_) => device.is_cpu(),
            #[cfg(feature = "cuda")]
            Engine::Cuda(e) => e.owns(device),
        }
    }
}
