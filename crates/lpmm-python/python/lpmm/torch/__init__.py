"""lpmm's optimizers as :class:`torch.optim.Optimizer` subclasses (needs torch).

Swap the optimizer line of a training script::

    opt = lpmm.torch.AdamW8bit(model.parameters(), lr=3e-4, weight_decay=0.1)

Every class takes torch's arguments for its rule and lpmm's options
(:class:`LpmmOptimizer`: ``param_storage``, ``seed``, ``max_grad_norm``, ``non_finite``,
``missing_gradient``, ``grad_release``, ``min_quantized_size``). Parameters are stepped in place
in their tensors (CPU, float32 or bfloat16); docs/PYTHON.md has the guide.
"""

import torch as _torch  # noqa: F401  (lpmm.torch needs torch: the ImportError says so)

from .._errors import ConfigError
from ._optim import LpmmOptimizer, MissingGradientWarning, NonFiniteGradientWarning

__all__ = [
    "LpmmOptimizer",
    "MissingGradientWarning",
    "NonFiniteGradientWarning",
    "AdamW8bit",
    "AdamW4bit",
    "LPMMSGDM",
    "Lion8bit",
    "Adafactor",
    "CAME",
    "AdEMAMix8bit",
    "ScheduleFreeAdamW8bit",
    "RMSprop8bit",
    "Adagrad8bit",
    "LAMB8bit",
    "Muon8bit",
    "Muon4bit",
]


class AdamW8bit(LpmmOptimizer):
    """AdamW with 8-bit block-wise states (preset ``adamw_8bit``: bitsandbytes' dynamic maps,
    blocks of 256): 2 bytes of state per parameter instead of 8. ``torch.optim.AdamW``'s
    arguments."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **options):
        super().__init__(
            params, "adamw_8bit", lr, betas=betas, eps=eps, weight_decay=weight_decay, **options
        )


class AdamW4bit(LpmmOptimizer):
    """AdamW with 4-bit states (preset ``adamw_4bit``: 4-bit block-wise first moment, rank-1
    normalized 4-bit second moment, as thu-ml's 4-bit optimizers): 1 byte of state per
    parameter."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **options):
        super().__init__(
            params, "adamw_4bit", lr, betas=betas, eps=eps, weight_decay=weight_decay, **options
        )


class LPMMSGDM(LpmmOptimizer):
    """SGD with momentum in 8 bits with stochastic rounding (preset ``lpmm_sgdm``): the momentum,
    and by default the parameter itself (``param_storage="preset"``: lpmm holds the 8-bit
    parameter and writes it into the tensor after every step). ``param_storage="auto"`` keeps the
    parameter in its tensor instead. ``torch.optim.SGD``'s arguments."""

    def __init__(
        self,
        params,
        lr=1e-2,
        momentum=0.9,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        param_storage="preset",
        **options,
    ):
        super().__init__(
            params,
            "lpmm_sgdm",
            lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            param_storage=param_storage,
            **options,
        )


class Lion8bit(LpmmOptimizer):
    """Lion with an 8-bit momentum (preset ``lion_8bit``)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **options):
        super().__init__(params, "lion_8bit", lr, betas=betas, weight_decay=weight_decay, **options)


class Adafactor(LpmmOptimizer):
    """Adafactor (Shazeer & Stern; the arguments of transformers' ``Adafactor``) with a factorized
    second moment and an 8-bit first moment (preset ``adafactor_8bit``, ``beta1`` 0.9).
    ``lr=None`` (default) uses the relative step; a number fixes the learning rate.
    ``relative_step`` may be given as transformers takes it (``relative_step=False`` with an
    ``lr``; ``True`` with an ``lr``, or ``False`` without one, is refused as transformers
    refuses it)."""

    def __init__(
        self,
        params,
        lr=None,
        eps=(1e-30, 1e-3),
        clip_threshold=1.0,
        decay_rate=-0.8,
        beta1=0.9,
        weight_decay=0.0,
        scale_parameter=True,
        relative_step=None,
        warmup_init=False,
        **options,
    ):
        if relative_step is None:
            relative_step = lr is None
        if relative_step and lr is not None:
            raise ConfigError(
                f"lr={lr!r} with relative_step=True: the relative step sets the learning rate "
                "(give lr=None, or relative_step=False to fix it), as transformers' Adafactor"
            )
        if not relative_step and lr is None:
            raise ConfigError("relative_step=False needs an lr (a number)")
        super().__init__(
            params,
            "adafactor_8bit",
            0.0 if lr is None else lr,
            eps=eps,
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            beta1=beta1,
            weight_decay=weight_decay,
            scale_parameter=scale_parameter,
            relative_step=bool(relative_step),
            warmup_init=warmup_init,
            **options,
        )


class CAME(LpmmOptimizer):
    """CAME (Luo et al. 2023) with factorized second moment and instability and an 8-bit first
    moment (preset ``came_8bit``)."""

    def __init__(
        self,
        params,
        lr=2e-4,
        betas=(0.9, 0.999, 0.9999),
        eps=(1e-30, 1e-16),
        clip_threshold=1.0,
        weight_decay=0.0,
        **options,
    ):
        super().__init__(
            params,
            "came_8bit",
            lr,
            betas=betas,
            eps=eps,
            clip_threshold=clip_threshold,
            weight_decay=weight_decay,
            **options,
        )


class AdEMAMix8bit(LpmmOptimizer):
    """AdEMAMix (Pagliardini et al. 2024) with its three moments in 8 bits (preset
    ``ademamix_8bit``)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        eps=1e-8,
        weight_decay=1e-2,
        t_alpha=None,
        t_beta3=None,
        **options,
    ):
        super().__init__(
            params,
            "ademamix_8bit",
            lr,
            betas=betas,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            t_alpha=t_alpha,
            t_beta3=t_beta3,
            **options,
        )


class ScheduleFreeAdamW8bit(LpmmOptimizer):
    """Schedule-free AdamW (Defazio et al. 2024; the ``schedulefree`` package's
    ``AdamWScheduleFree``) with an 8-bit second moment (preset ``schedule_free_adamw_8bit``).
    Call ``optimizer.eval()`` before evaluating or saving and ``optimizer.train()`` before
    training, as with ``schedulefree``."""

    def __init__(
        self,
        params,
        lr=2.5e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        warmup_steps=0,
        r=0.0,
        weight_lr_power=2.0,
        **options,
    ):
        super().__init__(
            params,
            "schedule_free_adamw_8bit",
            lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            r=r,
            weight_lr_power=weight_lr_power,
            **options,
        )


class RMSprop8bit(LpmmOptimizer):
    """RMSprop with 8-bit states (preset ``rmsprop_8bit``); ``torch.optim.RMSprop``'s
    arguments."""

    def __init__(
        self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, **options
    ):
        super().__init__(
            params,
            "rmsprop_8bit",
            lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
            **options,
        )


class Adagrad8bit(LpmmOptimizer):
    """Adagrad with an 8-bit sum of squares (preset ``adagrad_8bit``); ``torch.optim.Adagrad``'s
    arguments."""

    def __init__(
        self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10, **options
    ):
        super().__init__(
            params,
            "adagrad_8bit",
            lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            **options,
        )


class LAMB8bit(LpmmOptimizer):
    """LAMB with 8-bit states (preset ``lamb_8bit``)."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, clamp_value=10.0, debias=False, **options
    ):
        super().__init__(
            params,
            "lamb_8bit",
            lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            clamp_value=clamp_value,
            debias=debias,
            **options,
        )


# torch.optim.Muon's ``adjust_lr_fn`` names and lpmm's.
_ADJUST_LR = {
    None: "Original",
    "original": "Original",
    "match_rms_adamw": "MatchRmsAdamW",
    "spectral_unclamped": "SpectralUnclamped",
}


class _Muon(LpmmOptimizer):
    _PRESET = ""

    def __init__(
        self,
        params,
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_coefficients=(3.4445, -4.775, 2.0315),
        eps=1e-7,
        ns_steps=5,
        adjust_lr_fn=None,
        **options,
    ):
        if adjust_lr_fn not in _ADJUST_LR:
            raise ValueError(
                f"adjust_lr_fn {adjust_lr_fn!r}: one of None, 'original', 'match_rms_adamw', "
                "'spectral_unclamped'"
            )
        super().__init__(
            params,
            self._PRESET,
            lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr=_ADJUST_LR[adjust_lr_fn],
            **options,
        )


class Muon8bit(_Muon):
    """``torch.optim.Muon`` (its arguments and defaults: momentum 0.95, Nesterov, Newton–Schulz
    coefficients (3.4445, -4.775, 2.0315), 5 iterations, eps 1e-7, ``adjust_lr_fn``) with an
    8-bit block-wise momentum (preset ``muon_8bit``; bfloat16 parameters are stored bf16 with
    stochastic rounding). Muon steps matrices only: a parameter that is not 2-D raises
    :class:`lpmm.ConfigError` naming it, as torch's ``Muon`` refuses it. Give it a model's hidden
    matrices and another optimizer (e.g. :class:`AdamW8bit`) the embeddings, output head, norms and
    biases, as torch's documentation of ``Muon`` recommends."""

    _PRESET = "muon_8bit"


class Muon4bit(_Muon):
    """:class:`Muon8bit` with a 4-bit block-wise momentum (preset ``muon_4bit``, blocks of 128)."""

    _PRESET = "muon_4bit"
