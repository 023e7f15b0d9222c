"""The exceptions lpmm raises. Each tensor error names the parameter (``.param``); a refused call
changes nothing."""

__all__ = [
    "LpmmError",
    "ConfigError",
    "StateDictError",
    "StepError",
    "TensorError",
    "DtypeError",
    "DeviceError",
    "CudaError",
    "LayoutError",
    "AliasError",
]


class LpmmError(Exception):
    """Base class of lpmm's exceptions."""

    def __init__(self, message, param=None):
        super().__init__(message)
        #: The name of the parameter at fault, where one is.
        self.param = param


class ConfigError(LpmmError, ValueError):
    """A preset, hyperparameter, storage or option that lpmm does not take."""


class StateDictError(LpmmError, ValueError):
    """A state dict that does not load into this optimizer (another optimizer's, another model's,
    or damaged); the optimizer is left as it was."""


class StepError(LpmmError, RuntimeError):
    """A step, or another operation, that lpmm refused (its message says why)."""


class TensorError(LpmmError, ValueError):
    """A tensor lpmm cannot step in place."""


class DtypeError(TensorError, TypeError):
    """A parameter or gradient that is neither float32 nor bfloat16, or whose dtype changed since
    the optimizer was created."""


class DeviceError(TensorError):
    """A tensor that is not on the CPU."""


class CudaError(DeviceError):
    """A CUDA tensor: lpmm.torch steps CPU tensors (and never copies one to the host)."""


class LayoutError(TensorError):
    """A sparse, non-contiguous or lazily negated tensor, or one that does not lie inside its
    storage."""


class AliasError(TensorError):
    """Two tensors of one step that share memory where one of them is written."""
