"""The torch optimizers: ``LpmmOptimizer`` (any preset by name) and one class per common preset."""

import functools
import json
import threading
import warnings
import weakref

import torch

from .. import _lpmm
from .._errors import AliasError, ConfigError, LpmmError, StateDictError, StepError, TensorError

__all__ = ["LpmmOptimizer", "MissingGradientWarning", "NonFiniteGradientWarning"]

#: The state dict's per-parameter keys besides the regions.
_META = "lpmm"
_STEP = "step"


class NonFiniteGradientWarning(UserWarning):
    """A step met a NaN or infinite gradient: skipped (``non_finite="skip_step"``, the default) or
    those elements left unchanged (``"skip_elements"``; in a block-quantized storage the
    element is re-encoded with its block's new scale, so it may move by up to one step of the
    block's grid)."""


class MissingGradientWarning(UserWarning):
    """Parameters of the optimizer received no gradient in a step (``missing_gradient="warn"``):
    they were not stepped, as torch skips them."""


#: Hyperparameters that are whole numbers or None (AdEMAMix's warm-up lengths).
_INT_OR_NONE = frozenset({"t_alpha", "t_beta3"})
#: Hyperparameters that are floats or None whatever their default (Adafactor's ``beta1``: None,
#: transformers' default, is no first moment; AdaLomo's ``clip_grad_value``).
_FLOAT_OR_NONE = frozenset({"beta1", "clip_grad_value"})


def _plain(key, value, default):
    """``value`` of hyperparameter ``key`` as JSON-ready data of the kind lpmm's ``default`` for
    it has (torch's schedulers may store tensors or numpy numbers in a param group; a user may
    write ``0`` for ``0.0``). A whole-number hyperparameter given a fraction raises."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(default, bool):
        return bool(value)
    if isinstance(default, str):
        return str(value)
    if isinstance(default, (list, tuple)):
        return [float(v.item() if isinstance(v, torch.Tensor) else v) for v in value]
    if value is None and (default is None or key in _INT_OR_NONE or key in _FLOAT_OR_NONE):
        return None
    if key in _INT_OR_NONE or isinstance(default, int):
        whole = float(value)
        if not whole.is_integer():
            raise ConfigError(f"{key} = {value!r}: a whole number")
        return int(whole)
    return float(value)


def _torch_value(value):
    """A JSON value as a torch user reads it in a param group (tuples, not lists)."""
    return tuple(value) if isinstance(value, list) else value


def _locked(method):
    """``method`` under the optimizer's lock: lpmm's engine takes one call at a time, so two
    threads stepping one optimizer (or one stepping while another saves it) take turns, as
    torch's own optimizers would run both."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class LpmmOptimizer(torch.optim.Optimizer):
    r"""Any lpmm preset as a :class:`torch.optim.Optimizer`.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer (named parameters,
            ``model.named_parameters()``, name the parameters in errors).
        preset (str): one of :data:`lpmm.PRESETS` (``"adamw_8bit"``, ``"adamw_4bit"``,
            ``"lpmm_sgdm"``, ``"lion_8bit"``, ...). It decides the update rule and how the
            optimizer states are stored.
        lr (float): learning rate.
        param_storage (str): where each parameter's value lives. ``"auto"`` (default): in the
            tensor itself, stepped in place; float32 tensors as f32, bfloat16 tensors as bf16 with
            stochastic rounding. ``"bf16"`` (round to nearest), ``"bf16_sr"``, ``"bf16_kahan"``
            (a Kahan compensation held by lpmm), ``"split_f32"`` (a 16-bit remainder held by lpmm:
            f32 master weights behind a bf16 tensor), ``"bf16_plus8"``/``"bf16_plus8_sr"``
            (24-bit master weights): a bfloat16 tensor stepped in place. ``"preset"``: the preset's
            own storage; ``"linear8_sr"``: LPMM-SGDM's 8-bit parameter. A storage that is not the
            tensor's dtype is held by lpmm and written into the tensor after every step.
        seed (int): seed of every stochastic-rounding stream.
        max_grad_norm (float or None): clip the global gradient norm to this before the step.
        non_finite (str): ``"skip_step"`` (default: a NaN or infinite gradient skips the whole
            step, as AMP's GradScaler does) or ``"skip_elements"``.
        missing_gradient (str): a parameter without a gradient is skipped, as torch skips it
            (``"ignore"``, default), or named in a warning (``"warn"``), or refused
            (``"error"``).
        grad_release (bool): step each parameter as soon as its gradient is accumulated
            (``register_post_accumulate_grad_hook``) and free that gradient: the whole model's
            gradients never exist at once. ``step()`` then has nothing left to do.
        min_quantized_size (int or None): tensors with fewer elements keep quantized states in
            f32 (bitsandbytes' ``min_8bit_size``; the preset's value, 4096 for most, by default).
        **hyper: the update rule's hyperparameters (``betas``, ``eps``, ``weight_decay``,
            ``momentum``, ...); ``defaults`` lists them.
    """

    def __init__(
        self,
        params,
        preset="adamw_8bit",
        lr=1e-3,
        *,
        param_storage="auto",
        seed=0,
        max_grad_norm=None,
        non_finite="skip_step",
        missing_gradient="ignore",
        grad_release=False,
        min_quantized_size=None,
        **hyper,
    ):
        if grad_release and max_grad_norm is not None:
            raise ConfigError(
                "grad_release steps each parameter alone as its gradient arrives, so the global "
                "gradient norm that max_grad_norm clips to is never known: use one or the other"
            )
        if min_quantized_size is not None and (
            not isinstance(min_quantized_size, int) or min_quantized_size < 0
        ):
            raise ConfigError(f"min_quantized_size {min_quantized_size!r}: a non-negative int")
        rule, defaults = _lpmm.Engine.defaults(preset, 0.0 if lr is None else float(lr))
        defaults = json.loads(defaults)
        if lr is not None and "lr" in defaults:
            # The preset's learning rate is `lr` (Adafactor's presets take none: they start at the
            # relative step, where a fixed rate given with relative_step=False was dropped).
            defaults["lr"] = float(lr)
        for key in hyper:
            if key not in defaults:
                raise ConfigError(
                    f"{preset} ({rule}) has no hyperparameter {key!r}; its hyperparameters are: "
                    + ", ".join(defaults)
                )
        # The kinds of the hyperparameters are lpmm's defaults' (before the user's values).
        self._rule_defaults = dict(defaults)
        defaults.update(hyper)
        self._preset = preset
        self._rule = rule
        self._param_storage = param_storage
        self._min_quantized_size = min_quantized_size
        self._grad_release = bool(grad_release)
        # "warn" is a Python warning (MissingGradientWarning), raised here from the step's
        # report; lpmm's own warning is worded for its Rust API.
        self._warn_missing = missing_gradient == "warn"
        self._warned = None
        self._engine = _lpmm.Engine(
            int(seed),
            None if max_grad_norm is None else float(max_grad_norm),
            non_finite,
            "ignore" if self._warn_missing else missing_gradient,
        )
        self._lock = threading.RLock()  # one engine call at a time (`_locked`)
        self._params = []  # registered tensors, in the engine's order
        self._groups = []  # the param-group dict of each of lpmm's groups
        self._param_group = []  # each registered tensor's group (lpmm's index)
        self._members = (None, None)  # (fingerprint of param_groups, id(tensor) -> group dict)
        self._left = set()  # registered tensors out of their param group at the last step
        self._torch_index = []  # each one's index in torch's state dict
        self._index = {}  # id(tensor) -> engine index
        self._synced = []  # each group's hyperparameters as the engine has them
        self._hooks = []
        # The grad_release hooks hold the optimizer weakly and go with it (a deleted optimizer
        # must not step the model from a hook that outlived it).
        weakref.finalize(self, _remove_hooks, self._hooks)
        self._broken = None  # why the optimizer cannot go on, if it cannot
        self._count = 0  # parameters in all groups, registered or not (torch's indexing)
        #: The last step's report: ``updated``, ``skipped``, ``non_finite`` (names),
        #: ``grad_norm``, ``missing`` (names).
        self.last_report = None
        super().__init__(params, {k: _torch_value(v) for k, v in defaults.items()})

    # -- groups and parameters -------------------------------------------------------------

    def _hyper(self, group):
        """Group ``group``'s hyperparameters as JSON-ready data."""
        return {k: _plain(k, group[k], d) for k, d in self._rule_defaults.items()}

    @_locked
    def add_param_group(self, param_group):
        """Adds a param group (torch's ``add_param_group``), registering its tensors with lpmm.
        A tensor lpmm cannot step in place, or one sharing memory with another parameter, raises
        before the group is added."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        g = len(self.param_groups) - 1
        try:
            names = group.get("param_names")
            new = []
            for i, p in enumerate(group["params"]):
                name = names[i] if names else f"param_groups[{g}]['params'][{i}]"
                if id(p) in self._index or any(p is q for _, q, _ in new):
                    raise AliasError(
                        f"parameter {name} is listed twice; nothing was changed", name
                    )
                new.append((name, p, self._count + i))
            stepped = [(n, p, k) for n, p, k in new if p.numel() > 0]
            taken = {self._engine.name(i) for i in range(len(self._params))}
            for name, p, _ in stepped:
                if name in taken:
                    raise ConfigError(f"two parameters are named {name!r}", name)
                taken.add(name)
            _lpmm.check(
                [self._engine.name(i) for i in range(len(self._params))] + [n for n, _, _ in stepped],
                self._params + [p for _, p, _ in stepped],
            )
            for name, p, _ in stepped:
                if p.is_floating_point() and not torch.isfinite(p.detach()).all():
                    raise TensorError(
                        f"parameter {name} holds NaN or infinite values; nothing was changed", name
                    )
                if self._rule == "Muon" and p.dim() != 2:
                    # lpmm refuses it too, but only once the group's earlier tensors are
                    # registered (and written, for a storage lpmm holds): refused here first.
                    raise ConfigError(
                        f"parameter {name} has {p.dim()} dimensions: Muon steps matrices only; "
                        "give the other parameters to a second optimizer (AdamW8bit), as for "
                        "torch.optim.Muon. Nothing was changed",
                        name,
                    )
            hyper = self._hyper(group)
            index = self._engine.add_group(
                self._preset, json.dumps(hyper), self._param_storage, self._min_quantized_size
            )
            if index != g:
                raise ConfigError(f"lpmm's group {index} is torch's group {g}")
        except BaseException:
            self.param_groups.pop()
            raise
        self._synced.append(hyper)
        self._groups.append(group)
        for name, p, k in stepped:
            try:
                self._engine.add_param(name, p, list(p.shape), g)
            except BaseException as e:
                # Checked above, so not expected: lpmm has part of the group; refuse to go on.
                self._broken = f"registering {name} failed ({e}); create the optimizer again"
                raise
            self._index[id(p)] = len(self._params)
            self._params.append(p)
            self._param_group.append(g)
            self._torch_index.append(k)
            if self._grad_release:
                self._hooks.append(p.register_post_accumulate_grad_hook(_release_hook(self)))
        self._count += len(new)

    @_locked
    def param_info(self):
        """Each registered parameter: its name, whether it is stepped in place in the tensor
        (``lent``), and the storage lpmm keeps its value in."""
        return [self._engine.info(i) for i in range(len(self._params))]

    @_locked
    def memory(self):
        """Bytes lpmm holds, by slot: ``param`` (values lpmm holds beside or instead of the
        tensor: a Kahan compensation, an 8-bit parameter), ``grad`` (always 0: torch's
        gradients are read where they are), ``state1``, ``state2``, ``state3``."""
        return dict(zip(("param", "grad", "state1", "state2", "state3"), self._engine.memory()))

    # -- stepping ------------------------------------------------------------------------------

    def _sync(self):
        """Passes the param groups' hyperparameters to lpmm where they changed (LR schedulers
        change ``lr``; a change of another hyperparameter moves the state to an optimizer with
        the new ones, which costs a copy of it)."""
        for g, group in enumerate(self._groups):
            hyper = self._hyper(group)
            old = self._synced[g]
            if hyper == old:
                continue
            if all(hyper[k] == old[k] for k in hyper if k != "lr"):
                self._engine.set_group_lr(g, hyper["lr"])
            else:
                self._engine.set_group_hyper(g, json.dumps(hyper), self._params)
            self._synced[g] = hyper

    def _finish(self, report, stepped):
        self.last_report = report
        missing = tuple(report["missing"])
        if self._warn_missing and missing and missing != self._warned:
            warnings.warn(
                f"{len(missing)} parameter(s) received no gradient in this step and were not "
                "stepped (torch's optimizers skip them too): " + ", ".join(missing) + ". Freeze "
                "them (requires_grad=False) or leave them out of the optimizer, or pass "
                "missing_gradient='ignore'",
                MissingGradientWarning,
                stacklevel=3,
            )
        self._warned = missing or None
        if stepped and not report["skipped"]:
            torch.autograd.graph.increment_version(stepped)
        if report["non_finite"]:
            what = "the step was skipped" if report["skipped"] else "those elements were left unchanged"
            warnings.warn(
                "non-finite gradient in " + ", ".join(report["non_finite"]) + f": {what}",
                NonFiniteGradientWarning,
                stacklevel=3,
            )

    @torch.no_grad()
    @_locked
    def step(self, closure=None):
        """One step of every parameter with a gradient (a parameter whose ``.grad`` is None is
        skipped). Every tensor is checked first; a refused step changes nothing."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_usable()
        where = self._membership(refresh=True)
        live = [self._live(i, where) for i in range(len(self._params))]
        for i, on in enumerate(live):
            # A tensor out of its group is not missing a gradient (set every step: a change of
            # hyperparameters or a load rebuilds lpmm's optimizer, which forgets it).
            if not on or i in self._left:
                self._engine.set_expects_gradient(i, on)
                if on:
                    self._left.discard(i)
                else:
                    self._left.add(i)
        self._sync()
        grads = [p.grad if on else None for p, on in zip(self._params, live)]
        params = [None if g is None else p for p, g in zip(self._params, grads)]
        report = self._engine.step(params, grads)
        self._finish(report, [p for p in params if p is not None])
        return loss

    def _check_usable(self):
        if self._broken:
            raise StepError(self._broken)

    def _membership(self, refresh=False):
        """``id(tensor) -> param-group dict`` of the tensors ``param_groups`` holds now (rebuilt
        when the groups or their lengths changed, or with ``refresh``). A tensor put into
        ``param_groups`` other than by ``add_param_group`` raises: lpmm has no state for it."""
        groups = self.param_groups
        key = tuple((id(g), id(g["params"]), len(g["params"])) for g in groups)
        if refresh or self._members[0] != key:
            where = {}
            for group in groups:
                for p in group["params"]:
                    if id(p) not in self._index and p.numel() > 0:
                        raise ConfigError(
                            f"a tensor of shape {tuple(p.shape)} in param_groups is not "
                            "registered with lpmm: add parameters with add_param_group (a tensor "
                            "put into a group's 'params' directly, or a 0-element parameter "
                            "given data later, has no lpmm state)"
                        )
                    where[id(p)] = group
            self._members = (key, where)
        return self._members[1]

    def _live(self, i, where):
        """Whether registered tensor ``i`` is still in its param group, as torch's optimizers
        step the tensors ``param_groups`` holds at the step (one removed from its group's
        ``params``, or whose group was removed, is not stepped). Moved to another group: raises
        (lpmm keeps its state under its first group's hyperparameters)."""
        group = where.get(id(self._params[i]))
        if group is not None and group is not self._groups[self._param_group[i]]:
            name = self._engine.name(i)
            raise ConfigError(
                f"parameter {name} was moved to another param group; lpmm keeps its state under "
                "its first group: create the optimizer again",
                name,
            )
        return group is not None

    @_locked
    def _release(self, p):
        """The post-accumulate-grad hook of ``grad_release``: steps ``p`` and frees its
        gradient."""
        i = self._index.get(id(p))
        if p.grad is None or i is None or self._params[i] is not p:
            return
        self._check_usable()
        if not self._live(i, self._membership()):
            return
        self._sync()
        with torch.no_grad():
            report = self._engine.step_param(i, p, p.grad)
        p.grad = None
        self._finish(report, [p])

    @_locked
    def train(self):
        """Parameters back at their training point (schedule-free presets; others: no-op)."""
        self._engine.set_eval(False, self._params)

    @_locked
    def eval(self):
        """Parameters at their evaluation point: schedule-free AdamW's averaged weights (the
        ``schedulefree`` package's ``optimizer.eval()``); other presets' parameters do not move.
        With any preset, steps are refused until ``train()``."""
        self._engine.set_eval(True, self._params)

    def __getstate__(self):
        # torch's optimizers pickle (``copy.deepcopy``, ``torch.save(optimizer)``) through their
        # ``__dict__``; lpmm's state is in its engine, which does not pickle: a copy without it
        # would be an optimizer that cannot step. Refused, with what to do instead.
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied (copy.deepcopy, "
            "torch.save(optimizer)): its state lives in lpmm's engine. Save "
            "optimizer.state_dict() with torch.save and load it into a new optimizer with "
            "load_state_dict (bit-exact resume)"
        )

    # -- state -----------------------------------------------------------------------------------

    @_locked
    def state_dict(self):
        """torch's state dict: ``param_groups`` as torch writes them, and per parameter
        ``step``, ``lpmm`` (its metadata as JSON bytes) and each region of its optimizer state as
        raw bytes (uint8 tensors, exact under the dtype cast of torch's ``load_state_dict``). A
        parameter stepped in its tensor has its values in the model's state dict, not here."""
        sd = super().state_dict()
        saved = self._engine.state(self._params)
        state = sd["state"]
        for k, (meta, steps, regions) in zip(self._torch_index, saved):
            entry = {_STEP: torch.tensor(float(steps)), _META: _bytes_tensor(meta.encode())}
            for key, data in regions:
                entry[key] = _bytes_tensor(data)
            state[k] = entry
        return sd

    @_locked
    def load_state_dict(self, state_dict):
        """Loads a state dict of this optimizer's ``state_dict()`` (after ``torch.save`` and
        ``torch.load``, cast to the parameters' dtype by torch or not): the parameters' counters,
        stochastic-rounding streams and states resume bit for bit, and the param groups'
        hyperparameters are the saved ones. A state dict of another optimizer (torch's AdamW,
        bitsandbytes', another preset) or of another model, or a damaged one, raises
        :class:`lpmm.StateDictError` and changes nothing (the param groups stay the same
        objects)."""
        old_groups = self.param_groups
        old_state = self.state
        try:
            self._load_state_dict(state_dict)
        except BaseException as e:
            self.param_groups = old_groups
            self.state = old_state
            if isinstance(e, (LpmmError, KeyboardInterrupt, SystemExit)) or not isinstance(
                e, Exception
            ):
                raise
            # torch's own checks (another number of groups), and values of the wrong kind
            # (metadata that is not UTF-8, an lr that is not a number, a tensor on the meta
            # device): the state dict is not one this optimizer wrote.
            raise StateDictError(
                f"the state dict does not load into this optimizer ({type(e).__name__}: {e}). "
                "Nothing was changed"
            ) from e
        self.state = type(old_state)()
        self._groups = list(self.param_groups)
        self._members = (None, None)
        self._synced = [self._hyper(g) for g in self._groups]

    def _load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise StateDictError("not an optimizer state dict (no 'state' and 'param_groups')")
        for k, entry in state_dict["state"].items():
            if not isinstance(entry, dict) or _META not in entry:
                keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
                raise StateDictError(
                    f"the state of parameter {k} holds {keys}, not lpmm's state: it was written by "
                    "another optimizer (torch.optim.AdamW writes exp_avg and exp_avg_sq, "
                    "bitsandbytes state1 and state2); lpmm.torch loads only its own state dicts. "
                    "Nothing was changed"
                )
        for g, group in enumerate(state_dict["param_groups"]):
            missing = [k for k in self._rule_defaults if k not in group]
            if missing:
                raise StateDictError(
                    f"param group {g} of the state dict has no {', '.join(missing)}: it was written "
                    f"by another optimizer or preset (this one is {self._preset}). Nothing was changed"
                )
        # torch's load builds new group dicts (the saved ones, with this optimizer's tensors) and
        # leaves the old ones as they were; the caller puts the old list back if this fails.
        super().load_state_dict(state_dict)
        hypers = [json.dumps(self._hyper(g)) for g in self.param_groups]
        saved = []
        for p in self._params:
            entry = self.state.get(p)
            if entry is None:
                raise StateDictError(
                    f"no state for parameter {self._engine.name(len(saved))}: the state dict is "
                    "of another model"
                )
            regions = {
                k: _from_bytes_tensor(v, k) for k, v in entry.items() if k not in (_STEP, _META)
            }
            meta = bytes(_from_bytes_tensor(entry[_META], _META).tolist()).decode()
            saved.append((meta, regions))
        self._engine.load_state(hypers, saved, self._params)


def _release_hook(optimizer):
    """``optimizer._release`` as a post-accumulate-grad hook that does not keep the optimizer
    alive (a bound method would: the tensor holds its hooks)."""
    ref = weakref.ref(optimizer)

    def hook(p):
        opt = ref()
        if opt is not None:
            opt._release(p)

    return hook


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()
    handles.clear()


def _bytes_tensor(data):
    return torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)


def _from_bytes_tensor(value, key):
    """A state entry back as uint8: torch's ``load_state_dict`` casts every state tensor to a
    floating parameter's dtype, and bytes come back exactly from float32 and bfloat16 (every
    integer up to 256 is exact in both); anything else is refused."""
    if not isinstance(value, torch.Tensor):
        raise StateDictError(f"state entry {key!r} is a {type(value).__name__}, not a tensor")
    value = value.detach().cpu().reshape(-1)
    if value.dtype == torch.uint8:
        return value.contiguous()
    as_bytes = value.to(torch.uint8)
    if value.is_floating_point() and torch.equal(as_bytes.to(value.dtype), value):
        return as_bytes
    raise StateDictError(
        f"state entry {key!r} is a {value.dtype} tensor whose values are not bytes: the state "
        "dict was changed or written by another optimizer"
    )

