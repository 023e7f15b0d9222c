//! Values in a caller's device buffers: [`DeviceInput`] and [`DeviceOutput`] (host values or a
//! caller's buffer) and the checks of their dtype and length, and of a lent parameter's buffer.

use lpmm_optim::backend::{BackendError, Dtype, HostValues, HostValuesMut, ParamLayout, SlotKind};

use crate::device::Device;
use crate::runtime::Runtime;

/// A buffer of values in the backend's memory or on the host.
#[derive(Debug)]
pub enum DeviceInput<'a, R: Runtime> {
    /// Host values (uploaded through the staging buffer).
    Host(HostValues<'a>),
    /// A caller's device buffer (read where it is).
    Device(R::View<'a>),
}

impl<R: Runtime> Clone for DeviceInput<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for DeviceInput<'_, R> {}

/// A writable buffer in the backend's memory or on the host.
#[derive(Debug)]
pub enum DeviceOutput<'a, R: Runtime> {
    /// Host values (read back through the staging buffer).
    Host(HostValuesMut<'a>),
    /// A caller's device buffer (written where it is).
    Device(R::View<'a>),
}

impl<R: Runtime> Device<R> {
    pub(crate) fn check_view(
        &self,
        view: &R::View<'_>,
        dtypes: &[Dtype],
        n: usize,
    ) -> Result<(), BackendError> {
        let (dtype, len) = self.inner.rt.view_info(view);
        if !dtypes.contains(&dtype) || len != n {
            return Err(BackendError::Buffer {
                what: format!(
                    "a {} buffer of {len} values where {n} values of {} are needed",
                    dtype.name(),
                    dtypes
                        .iter()
                        .map(|d| d.name())
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            });
        }
        Ok(())
    }

    pub(crate) fn check_input(
        &self,
        input: &DeviceInput<'_, R>,
        n: usize,
    ) -> Result<(), BackendError> {
        match input {
            DeviceInput::Host(v) if v.info().1 != n => Err(BackendError::Buffer {
                what: format!("{} host values where {n} are needed", v.info().1),
            }),
            DeviceInput::Host(_) => Ok(()),
            DeviceInput::Device(v) => self.check_view(v, &[Dtype::F32, Dtype::Bf16], n),
        }
    }

    /// The lent buffer of a lent parameter slot, checked.
    pub(crate) fn lent_view<'a>(
        &self,
        layout: &ParamLayout,
        view: Option<R::View<'a>>,
    ) -> Result<Option<R::View<'a>>, BackendError> {
        if !layout.lent {
            return Ok(None);
        }
        let want = layout
            .format(SlotKind::Param)
            .and_then(|f| f.lendable())
            .ok_or_else(|| self.unsupported("lending a parameter of this storage"))?;
        let view = view.ok_or_else(|| BackendError::Buffer {
            what: "a lent parameter needs its buffer".into(),
        })?;
        self.check_view(&view, &[want], layout.numel)?;
        Ok(Some(view))
    }
}

#[cfg(test)]
mod tests {
    use lpmm_optim::presets;

    use super::*;
    use crate::fake::{self, Host, View};

    /// The message of a [`BackendError::Buffer`].
    fn buffer_error<T: std::fmt::Debug>(r: Result<T, BackendError>) -> String {
        match r {
            Err(BackendError::Buffer { what }) => what,
            other => panic!("not a buffer error: {other:?}"),
        }
    }

    #[test]
    fn a_caller_s_buffer_must_have_a_dtype_and_the_length_needed() {
        let d = fake::device(Host::bindless(), 4096, 4096);
        let floats = [Dtype::F32, Dtype::Bf16];
        for dtype in floats {
            d.check_view(&View::new(1, dtype, 10), &floats, 10).unwrap();
        }
        assert_eq!(
            buffer_error(d.check_view(&View::new(1, Dtype::U8, 10), &floats, 10)),
            "a u8 buffer of 10 values where 10 values of f32 or bf16 are needed"
        );
        assert_eq!(
            buffer_error(d.check_view(&View::new(1, Dtype::F32, 9), &floats, 10)),
            "a f32 buffer of 9 values where 10 values of f32 or bf16 are needed"
        );
    }

    #[test]
    fn an_input_must_have_the_length_needed() {
        let d = fake::device(Host::bindless(), 4096, 4096);
        let host = DeviceInput::Host(HostValues::F32(&[0.0; 3]));
        d.check_input(&host, 3).unwrap();
        assert_eq!(
            buffer_error(d.check_input(&host, 4)),
            "3 host values where 4 are needed"
        );
        d.check_input(&DeviceInput::Device(View::new(1, Dtype::Bf16, 4)), 4)
            .unwrap();
        assert_eq!(
            buffer_error(d.check_input(&DeviceInput::Device(View::new(1, Dtype::U16, 4)), 4)),
            "a u16 buffer of 4 values where 4 values of f32 or bf16 are needed"
        );
    }

    #[test]
    fn a_lent_parameter_s_buffer_is_checked_against_its_storage() {
        let d = fake::device(Host::bindless(), 4096, 4096);
        let config = presets::adamw_8bit_bf16(1e-3).build();
        let own = fake::layout(config, &[10], false);
        let lent = fake::layout(config, &[10], true);
        let good = View::new(1, Dtype::Bf16, 10);
        // A parameter that is not lent has no lent buffer, whatever is given.
        assert_eq!(d.lent_view(&own, Some(good)).unwrap(), None);
        assert_eq!(d.lent_view(&lent, Some(good)).unwrap(), Some(good));
        assert_eq!(
            buffer_error(d.lent_view(&lent, None)),
            "a lent parameter needs its buffer"
        );
        assert_eq!(
            buffer_error(d.lent_view(&lent, Some(View::new(1, Dtype::F32, 10)))),
            "a f32 buffer of 10 values where 10 values of bf16 are needed"
        );
        assert_eq!(
            buffer_error(d.lent_view(&lent, Some(View::new(1, Dtype::Bf16, 11)))),
            "a bf16 buffer of 11 values where 10 values of bf16 are needed"
        );
        // An 8-bit parameter is no framework's tensor.
        let adam = fake::layout(presets::adamw_8bit(1e-3).build(), &[1 << 16], true);
        let mut quantized = adam.clone();
        quantized.formats[SlotKind::Param as usize] = adam.format(SlotKind::State1);
        assert!(quantized.formats[0].is_some_and(|f| f.lendable().is_none()));
        assert!(matches!(
            d.lent_view(&quantized, Some(View::new(1, Dtype::F32, 1 << 16))),
            Err(BackendError::Unsupported { what, .. }) if what == "lending a parameter of this storage"
        ));
    }
}
