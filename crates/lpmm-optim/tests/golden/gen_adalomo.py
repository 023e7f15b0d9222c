#!/usr/bin/env python3
"""Generate adalomo.safetensors: golden trajectories of the AdaLomo authors' implementation.

Anchor, run on the CPU in float32 with one torch thread:
  lomo-optim 0.1.1 `lomo_optim.AdaLomo` (the package transformers' Trainer uses for
  `optim="adalomo"`), its non-ZeRO update `fuse_update()`, 100 steps
See README.md beside this file ("## adalomo.safetensors") for the pinned environment, the command
line and the findings.

How the anchor is driven. AdaLomo is not a torch.optim step: it registers a hook per parameter
and updates each parameter inside `fused_backward(loss, lr)`, which scales the loss by
`loss_scale`, increments `step_num`, runs `loss.backward()` and calls `grad_func(0)` for the last
parameter. Here each step does what `fused_backward` does around the backward pass, with the
scenario's gradients given instead of a loss: `opt.lr = lr`, `opt.step_num += 1`, `p.grad = g`
for every parameter, then `opt.grad_func(0)` — the authors' update code, unchanged, on exactly
these gradients (`loss_scale=0`: no loss scaling to undo, so `grad_fp32.div_(loss_scale)` does
not run; with the default 2**10 the division is exact in float32 anyway). The package creates its
second-moment buffers with `.cuda()`: on this CPU-only machine `torch.Tensor.cuda` is replaced by
the identity while the optimizer is constructed (nothing else is patched).

The scenario is gen_reference_optimizers.py's, as gen_rmsprop_adagrad.py restates it (TENSORS:
w1 64x80, w2 4396, b 33, w3 96x128; their initial values and gradients), so lpmm-optim's
tests/common reproduce it.

What is stored (little-endian safetensors, F32):
  {cfg}.step{k}.{name}             parameters after step k (k = 1, 10, 100)
  {cfg}.exp_avg_sq_row.{name}      2-D tensors' factored second moment after step 100 (rows)
  {cfg}.exp_avg_sq_col.{name}      (columns)
  {cfg}.exp_avg_sq.{name}          1-D tensors' second moment after step 100
"""

import json
import math
import sys
from importlib.metadata import version as dist_version
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gen_rmsprop_adagrad import TENSORS, init_param, gradient, write_safetensors  # noqa: E402

import lomo_optim  # noqa: E402

OUT = HERE / "adalomo.safetensors"
SIZE_LIMIT = 1_000_000  # bytes
STEPS = 100
STORE = (1, 10, 100)

RUNS = [
    ("adalomo_default", dict(lr=1e-2)),
    # weight decay, a value clamp that is active (gradients reach 0.07), a tighter RMS clip
    ("adalomo_wd_clamp", dict(lr=1e-2, weight_decay=0.1, clip_grad_value=0.03, clip_threshold=0.5)),
]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for k, (name, shape) in enumerate(TENSORS):
            p0 = init_param(k, math.prod(shape)).reshape(shape)
            self.register_parameter(name, torch.nn.Parameter(torch.from_numpy(p0.copy())))


def run(hp):
    model = Model()
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        opt = lomo_optim.AdaLomo(model, loss_scale=0, **hp)
    finally:
        torch.Tensor.cuda = cuda
    assert not opt.zero3_enabled
    params = dict(model.named_parameters())
    snaps = {}
    for t in range(1, STEPS + 1):
        opt.lr = hp["lr"]
        opt.step_num += 1
        for k, (name, shape) in enumerate(TENSORS):
            params[name].grad = torch.from_numpy(gradient(k, t, math.prod(shape)).reshape(shape))
        opt.grad_func(0)
        assert all(p.grad is None for p in params.values()), "every parameter updated"
        if t in STORE:
            snaps[t] = {n: p.detach().numpy().copy() for n, p in params.items()}
    states = {}
    for name, shape in TENSORS:
        if len(shape) > 1:
            states[f"exp_avg_sq_row.{name}"] = opt.exp_avg_sq_row[name].numpy().copy()
            states[f"exp_avg_sq_col.{name}"] = opt.exp_avg_sq_col[name].numpy().copy()
        else:
            states[f"exp_avg_sq.{name}"] = opt.exp_avg_sq[name].numpy().copy()
    return snaps, states


def main():
    torch.set_num_threads(1)
    versions = {
        "torch": torch.__version__,
        "lomo-optim": dist_version("lomo-optim"),
        "transformers": dist_version("transformers"),
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }
    print("versions:", json.dumps(versions))
    tensors, meta = {}, {}
    for name, hp in RUNS:
        snaps, states = run(hp)
        for t, params in snaps.items():
            for tname, p in params.items():
                tensors[f"{name}.step{t}.{tname}"] = p.astype(np.float32)
        for key, v in states.items():
            tensors[f"{name}.{key}"] = v.astype(np.float32)
        moved = max(float(np.abs(snaps[STEPS][n] - init_param(k, math.prod(s)).reshape(s)).max())
                    for k, (n, s) in enumerate(TENSORS))
        print(f"{name}: largest move from the initial values after {STEPS} steps: {moved:.4f}")
        meta[name] = dict(anchor="lomo_optim.AdaLomo", hp=hp, steps=STEPS, loss_scale=0)
    metadata = {
        "generator": "gen_adalomo.py",
        "versions": json.dumps(versions, sort_keys=True),
        "configs": json.dumps(meta, sort_keys=True),
    }
    write_safetensors(OUT, tensors, metadata)
    size = OUT.stat().st_size
    print(f"wrote {OUT.name}: {size} bytes, {len(tensors)} tensors")
    assert size < SIZE_LIMIT, f"{OUT.name} is {size} bytes, over the {SIZE_LIMIT} byte budget"


if __name__ == "__main__":
    main()
