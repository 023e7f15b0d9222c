#!/usr/bin/env python3
"""Generate muon.safetensors: golden trajectories of torch.optim.Muon for lpmm-optim.

Anchor, run on the CPU in float32 with one torch thread:
  torch.optim.Muon (torch 2.15.0), 100 steps, the single-tensor path (the only one it has)
See README.md beside this file ("## muon.safetensors") for the pinned environment, the command
line, the op sequence and the findings.

Two Newton-Schulz precisions per configuration:
  "bf16"  torch.optim.Muon as shipped: its `_zeropower_via_newtonschulz` casts the update to
          bfloat16 and runs the normalisation and the five iterations in bf16 (its result, bf16,
          moves the float32 parameter)
  "f32"   the same function with the cast to float32 instead (patched in the module; nothing else
          changes): the algorithm in the precision lpmm's f32 Muon runs it

The scenario's hash and generators are gen_rmsprop_adagrad.py's (imported from it); the tensors
are matrices of their own (ids 10 to 13): a wide one, a tall one (Muon steps its transpose), a
square one and a larger wide one.

What is stored (little-endian safetensors, F32):
  {cfg}.{ns}.step{k}.{name}     parameters after step k: every tensor at step 100, "s" at steps 1
                                and 10
  {cfg}.{ns}.momentum.t         the momentum buffer of "t" after step 100 (it does not depend on
                                the Newton-Schulz precision: gradients do not depend on the
                                parameters)
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.optim._muon as muon_module

from gen_rmsprop_adagrad import diff_row, gradient, init_param, write_safetensors

HERE = Path(__file__).resolve().parent
OUT = HERE / "muon.safetensors"
SIZE_LIMIT = 1_000_000  # bytes
STEPS = 100
f32 = np.float32

# tensor id, name, shape
TENSORS = [(10, "w", (40, 96)), (11, "t", (120, 36)), (12, "s", (48, 48)), (13, "x", (64, 200))]

RUNS = [
    ("muon_default", dict(lr=0.02)),
    # no Nesterov, another momentum and decay, Moonshot's shape adjustment, 3 iterations
    ("muon_plain_rms", dict(lr=0.02, momentum=0.9, nesterov=False, weight_decay=0.01,
                            adjust_lr_fn="match_rms_adamw", ns_steps=3)),
    ("muon_spectral", dict(lr=0.01, adjust_lr_fn="spectral_unclamped")),
]

SHIPPED = muon_module._zeropower_via_newtonschulz


def zeropower_f32(grad, ns_coefficients, ns_steps, eps):
    """torch's `_zeropower_via_newtonschulz` with float32 in place of bfloat16 (line for line)."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    ortho_grad = grad.to(dtype=torch.float32, copy=True)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def run(hp, ns):
    muon_module._zeropower_via_newtonschulz = SHIPPED if ns == "bf16" else zeropower_f32
    params = [torch.nn.Parameter(torch.from_numpy(init_param(tid, math.prod(s)).reshape(s)))
              for tid, _, s in TENSORS]
    opt = torch.optim.Muon(params, **hp)
    snaps = {}
    for t in range(1, STEPS + 1):
        for p, (tid, _, s) in zip(params, TENSORS):
            p.grad = torch.from_numpy(gradient(tid, t, math.prod(s)).reshape(s))
        opt.step()
        snaps[t] = [p.detach().numpy().copy() for p in params]
    bufs = [opt.state[p]["momentum_buffer"].detach().numpy().copy() for p in params]
    muon_module._zeropower_via_newtonschulz = SHIPPED
    return snaps, bufs


def replay_momentum(hp, k):
    """The momentum buffer of tensor k after STEPS steps, replayed in numpy float32 with torch's
    CPU lerp (fma(w, g - buf, buf) for |w| < 0.5): what lpmm computes."""
    from gen_rmsprop_adagrad import fma
    tid, _, s = TENSORS[k]
    w = f32(1 - hp.get("momentum", 0.95))
    buf = np.zeros(math.prod(s), f32)
    for t in range(1, STEPS + 1):
        g = gradient(tid, t, math.prod(s))
        buf = fma(w, g - buf, buf) if abs(w) < 0.5 else fma(w - f32(1), g - buf, g)
    return buf.reshape(s)


def main():
    torch.set_num_threads(1)
    versions = {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }
    print("versions:", json.dumps(versions))
    tensors, meta, rows = {}, {}, []
    s_index = [n for _, n, _ in TENSORS].index("s")
    t_index = [n for _, n, _ in TENSORS].index("t")
    for name, hp in RUNS:
        results = {}
        for ns in ("bf16", "f32"):
            snaps, bufs = run(hp, ns)
            results[ns] = snaps
            for (_, tname, _), p in zip(TENSORS, snaps[STEPS]):
                tensors[f"{name}.{ns}.step{STEPS}.{tname}"] = p
            for t in (1, 10):
                tensors[f"{name}.{ns}.step{t}.s"] = snaps[t][s_index]
            tensors[f"{name}.{ns}.momentum.t"] = bufs[t_index]
            rows.append(diff_row(f"{name} ({ns} NS) momentum of t vs float32 replay",
                                 [(bufs[t_index], replay_momentum(hp, t_index))]))
        for t in (1, 10, STEPS):
            rows.append(diff_row(f"{name} step {t:>3}: bf16 NS vs f32 NS",
                                 zip(results["bf16"][t], results["f32"][t])))
        meta[name] = dict(anchor="torch.optim.Muon", hp=hp, steps=STEPS)

    print("\nbf16 (shipped) against f32 Newton-Schulz, and the momentum against its replay:")
    for row in rows:
        print("  ", row)

    metadata = {
        "generator": "gen_muon.py",
        "versions": json.dumps(versions, sort_keys=True),
        "tensors": json.dumps([[tid, n, list(s)] for tid, n, s in TENSORS]),
        "configs": json.dumps(meta, sort_keys=True),
    }
    write_safetensors(OUT, tensors, metadata)
    size = OUT.stat().st_size
    print(f"\nwrote {OUT.name}: {size} bytes, {len(tensors)} tensors")
    assert size < SIZE_LIMIT, f"{OUT.name} is {size} bytes, over the {SIZE_LIMIT} byte budget"


if __name__ == "__main__":
    main()
