"""lpmm: low-precision optimizers whose parameters, gradients and states take a fraction of the
memory, with the numerics that keep training on par with f32 (stochastic rounding, Kahan
summation, block-wise 8-bit and 4-bit states).

``import lpmm`` needs nothing else; the PyTorch optimizers are in :mod:`lpmm.torch` (needs torch).
"""

from ._errors import (
    AliasError,
    ConfigError,
    CudaError,
    DeviceError,
    DtypeError,
    LayoutError,
    LpmmError,
    StateDictError,
    StepError,
    TensorError,
)
from ._lpmm import __version__
from ._lpmm import names as _names

#: Every preset's name (the functions of the Rust crate's ``lpmm_optim::presets``).
PRESETS = tuple(_names()[0])
#: The names ``param_storage`` takes.
PARAM_STORAGES = tuple(_names()[1])

__all__ = [
    "__version__",
    "PRESETS",
    "PARAM_STORAGES",
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
