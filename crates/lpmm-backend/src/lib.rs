//! What lpmm's device backends are built from, so that lpmm-wgpu and lpmm-cuda are thin adapters:
//!
//! - [`abi`]: the kernel ABI — the descriptor every launch carries, flags, entry points and the
//!   code-map layout — defined once in Rust;
//! - [`codegen`]: that ABI and the dispatch over lpmm-optim's format and rule registries written
//!   in WGSL and CUDA C, and each backend's kernel program assembled from its hand-written
//!   sources (`cargo xtask codegen` writes them; the backends' tests fail, naming the command,
//!   when the committed files are stale);
//! - [`Runtime`]: the little a device must offer (memory, copies, launching an entry point over
//!   descriptors);
//! - [`Device`]: lpmm-optim's `Backend` on any runtime — the one host side of every operation on
//!   device memory: allocation, descriptors and launch batching, gradient statistics, the step
//!   primitives (folds, their read-back, the fused pass), export and import, lent parameters and
//!   device-resident inputs and outputs. The step's schedule, its lent-buffer checks and its
//!   host combines are lpmm-optim's executor's, the same for every backend.
//!
//! This crate touches no GPU API: runtimes do. Its only kernel code is what [`codegen`] writes
//! from the ABI and the registries; the hand-written kernels are the backends'.

pub mod abi;
mod arena;
pub mod codegen;
mod device;
#[cfg(test)]
mod fake;
mod launch;
pub mod plans;
mod runtime;
mod step;
mod views;

pub use arena::DeviceParam;
pub use device::{Device, DeviceOptions};
pub use runtime::{Io, Launch, Limits, Runtime, Specialized};
pub use views::{DeviceInput, DeviceOutput};

/// What [`device_backend!`] expands to refers to.
#[doc(hidden)]
pub mod reexport {
    pub use lpmm_optim::backend::ExactSum;
    pub use lpmm_optim::backend::{
        Backend, BackendError, Dtype, Folded, HostSlot, HostValues, HostValuesMut, Init,
        ParamLayout, Phase, SLOTS, SlotKind, StepWork,
    };
}

/// A backend newtype's [`StepWork`](lpmm_optim::backend::StepWork) as its [`Device`]'s (the same
/// buffers; [`device_backend!`]'s forwarding).
#[doc(hidden)]
#[macro_export]
macro_rules! forward_work {
    ($w:expr) => {
        $crate::reexport::StepWork {
            params: &mut *$w.params,
            layouts: $w.layouts,
            plans: $w.plans,
            released: $w.released,
            lent: &mut *$w.lent,
            seed: $w.seed,
        }
    };
}

/// Defines a backend type that is a [`Device`] on one runtime: a newtype that dereferences to the
/// device and implements lpmm-optim's `Backend` by delegating to it (what lpmm-wgpu's `Wgpu` and
/// lpmm-cuda's `Cuda` are).
#[macro_export]
macro_rules! device_backend {
    ($(#[$meta:meta])* $vis:vis struct $name:ident($rt:ty);) => {
        $(#[$meta])*
        #[derive(Clone, Debug)]
        $vis struct $name($crate::Device<$rt>);

        impl $name {
            /// The backend on `runtime`.
            pub fn from_runtime(
                runtime: $rt,
                options: $crate::DeviceOptions,
            ) -> Result<Self, $crate::reexport::BackendError> {
                Ok(Self($crate::Device::new(runtime, options)?))
            }
        }

        impl ::std::ops::Deref for $name {
            type Target = $crate::Device<$rt>;
            fn deref(&self) -> &$crate::Device<$rt> {
                &self.0
            }
        }

        impl $crate::reexport::Backend for $name {
            type Param = $crate::DeviceParam<$rt>;
            type Input<'a> = $crate::DeviceInput<'a, $rt>;
            type Output<'a> = $crate::DeviceOutput<'a, $rt>;
            // No matrix phase on a device (the trait's defaults refuse it: docs/BACKENDS.md).
            type Matrices = ();

            fn name(&self) -> &'static str {
                self.0.name()
            }
            fn host_input<'a>(&self, v: $crate::reexport::HostValues<'a>) -> Self::Input<'a> {
                self.0.host_input(v)
            }
            fn host_output<'a>(&self, v: $crate::reexport::HostValuesMut<'a>) -> Self::Output<'a> {
                self.0.host_output(v)
            }
            fn input_info(&self, i: &Self::Input<'_>) -> ($crate::reexport::Dtype, usize) {
                self.0.input_info(i)
            }
            fn output_info(&self, o: &Self::Output<'_>) -> ($crate::reexport::Dtype, usize) {
                self.0.output_info(o)
            }
            fn allocate(
                &self,
                layout: &$crate::reexport::ParamLayout,
                init: $crate::reexport::Init<'_, Self>,
                seed: u64,
            ) -> Result<Self::Param, $crate::reexport::BackendError> {
                let init = match init {
                    $crate::reexport::Init::Values(v) => $crate::reexport::Init::Values(v),
                    $crate::reexport::Init::Lent => $crate::reexport::Init::Lent,
                    $crate::reexport::Init::Fresh => $crate::reexport::Init::Fresh,
                };
                self.0.allocate(layout, init, seed)
            }
            fn accumulate(
                &self,
                param: &mut Self::Param,
                layout: &$crate::reexport::ParamLayout,
                counter: u64,
                grad: Self::Input<'_>,
                seed: u64,
            ) -> Result<(), $crate::reexport::BackendError> {
                self.0.accumulate(param, layout, counter, grad, seed)
            }
            fn fits(
                &self,
                values: Self::Input<'_>,
                limit: f32,
            ) -> Result<bool, $crate::reexport::BackendError> {
                self.0.fits(values, limit)
            }
            fn accumulate_fits(
                &self,
                param: &Self::Param,
                layout: &$crate::reexport::ParamLayout,
                grad: Self::Input<'_>,
            ) -> Result<bool, $crate::reexport::BackendError> {
                self.0.accumulate_fits(param, layout, grad)
            }
            fn input_stats(
                &self,
                values: Self::Input<'_>,
            ) -> Result<($crate::reexport::ExactSum, bool), $crate::reexport::BackendError> {
                self.0.input_stats(values)
            }
            fn gradient_stats(
                &self,
                params: &mut [Self::Param],
                layouts: &[$crate::reexport::ParamLayout],
                select: &[bool],
                out: &mut [($crate::reexport::ExactSum, bool)],
            ) -> Result<(), $crate::reexport::BackendError> {
                self.0.gradient_stats(params, layouts, select, out)
            }
            fn prepare(
                &self,
                w: &mut $crate::reexport::StepWork<'_, '_, '_, Self>,
            ) -> Result<(), $crate::reexport::BackendError> {
                $crate::reexport::Backend::prepare(&self.0, &mut $crate::forward_work!(w))
            }
            fn begin_phase(
                &self,
                w: &mut $crate::reexport::StepWork<'_, '_, '_, Self>,
                phase: $crate::reexport::Phase,
            ) -> Result<(), $crate::reexport::BackendError> {
                $crate::reexport::Backend::begin_phase(&self.0, &mut $crate::forward_work!(w), phase)
            }
            fn fold(
                &self,
                w: &mut $crate::reexport::StepWork<'_, '_, '_, Self>,
                phase: $crate::reexport::Phase,
                pass: usize,
            ) -> Result<(), $crate::reexport::BackendError> {
                $crate::reexport::Backend::fold(&self.0, &mut $crate::forward_work!(w), phase, pass)
            }
            fn folded(
                &self,
                params: &mut [Self::Param],
                _layouts: &[$crate::reexport::ParamLayout],
                ran: &[bool],
                phase: $crate::reexport::Phase,
                combine: &mut dyn FnMut(usize, $crate::reexport::Folded<'_>),
            ) -> Result<(), $crate::reexport::BackendError> {
                $crate::reexport::Backend::folded(&self.0, params, _layouts, ran, phase, combine)
            }
            fn fused(
                &self,
                w: &mut $crate::reexport::StepWork<'_, '_, '_, Self>,
                non_finite: &mut [bool],
            ) -> Result<(), $crate::reexport::BackendError> {
                $crate::reexport::Backend::fused(&self.0, &mut $crate::forward_work!(w), non_finite)
            }
            fn swap_wide(
                &self,
                param: &mut Self::Param,
                slot: $crate::reexport::SlotKind,
                a: usize,
                b: usize,
            ) {
                $crate::reexport::Backend::swap_wide(&self.0, param, slot, a, b)
            }
            fn clear_gradients(
                &self,
                params: &mut [Self::Param],
                layouts: &[$crate::reexport::ParamLayout],
                only: Option<usize>,
            ) -> Result<(), $crate::reexport::BackendError> {
                self.0.clear_gradients(params, layouts, only)
            }
            fn read(
                &self,
                param: &Self::Param,
                layout: &$crate::reexport::ParamLayout,
                slot: $crate::reexport::SlotKind,
                out: Self::Output<'_>,
            ) -> Result<(), $crate::reexport::BackendError> {
                self.0.read(param, layout, slot, out)
            }
            fn export(
                &self,
                param: &Self::Param,
                layout: &$crate::reexport::ParamLayout,
                slot: $crate::reexport::SlotKind,
                lent: Option<Self::Input<'_>>,
            ) -> Result<$crate::reexport::HostSlot, $crate::reexport::BackendError> {
                self.0.export(param, layout, slot, lent)
            }
            fn import(
                &self,
                param: &mut Self::Param,
                layout: &$crate::reexport::ParamLayout,
                slot: $crate::reexport::SlotKind,
                host: &$crate::reexport::HostSlot,
                lent: Option<Self::Output<'_>>,
            ) -> Result<(), $crate::reexport::BackendError> {
                self.0.import(param, layout, slot, host, lent)
            }
            fn bytes(&self, param: &Self::Param, layout: &$crate::reexport::ParamLayout) -> [usize; $crate::reexport::SLOTS] {
                self.0.bytes(param, layout)
            }
        }
    };
}
