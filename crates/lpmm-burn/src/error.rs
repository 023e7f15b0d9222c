use lpmm_optim::OptimError;

/// What can go wrong in lpmm-burn. Each variant says what to change; nothing panics.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BurnError {
    /// The optimizer core refused or failed (hyperparameters, shapes, a device error).
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// A parameter of the module cannot be stepped as it is (dtype, device, shape).
    #[error("parameter {param}: {reason}")]
    Param {
        /// The parameter (its burn `ParamId` and module path).
        param: String,
        /// What is wrong.
        reason: String,
    },
    /// The tensors' device has no lpmm backend here (a backend not compiled in, or a wgpu device
    /// that was not shared with lpmm).
    #[error("device {device}: {reason}")]
    Device {
        /// The device, as burn prints it.
        device: String,
        /// Why, and what to do.
        reason: String,
    },
    /// A record or checkpoint could not be written, read or applied.
    #[error("record: {0}")]
    Record(String),
    /// The configuration cannot be used in this form (global-norm clipping in the per-tensor
    /// optimizer).
    #[error("configuration: {0}")]
    Config(String),
}

impl BurnError {
    pub(crate) fn param(param: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        BurnError::Param {
            param: param.to_string(),
            reason: reason.into(),
        }
    }

    pub(crate) fn device(device: impl std::fmt::Debug, reason: impl Into<String>) -> Self {
        BurnError::Device {
            device: format!("{device:?}"),
            reason: reason.into(),
        }
    }
}

impl From<lpmm_optim::backend::BackendError> for BurnError {
    fn from(e: lpmm_optim::backend::BackendError) -> Self {
        BurnError::Optim(OptimError::Backend(e))
    }
}
