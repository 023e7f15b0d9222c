#!/usr/bin/env python3
"""Generate lamb.safetensors: golden trajectories of LAMB for lpmm-optim.

Anchor, run on the CPU in float32 with one torch thread:
  torch_optimizer.Lamb (torch-optimizer 0.3.0), 100 steps
See README.md beside this file ("## lamb.safetensors") for the pinned environment, the command
line, the op sequence and the findings.

The scenario (tensors, initial values, gradients) is gen_rmsprop_adagrad.py's, imported from it.

What is stored (little-endian safetensors, F32):
  {cfg}.step{k}.{name}     parameters after step k: every tensor at step 100; "b" at steps 1, 10
  {cfg}.{state}.w2         torch_optimizer's exp_avg / exp_avg_sq of "w2" after step 100
  {cfg}.lpmm.step100.w2    "w2" after step 100 of the float32 replay below with a correctly
                           rounded sqrt and lpmm's tensor-wide sums (the fixed-point fold of
                           lpmm-optim src/fixed.rs): what lpmm computes, bit for bit

The replay re-implements torch_optimizer.Lamb's op sequence in numpy float32 and is printed
against the anchor (stdout only) with torch's sqrt and norm (expected: bit for bit), then with
lpmm's sqrt and sums.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch_optimizer

from gen_rmsprop_adagrad import (NAMES, TENSORS, Scenario, diff_row, fma, sqrt_exact, sqrt_torch,
                                 write_safetensors)

HERE = Path(__file__).resolve().parent
OUT = HERE / "lamb.safetensors"
SIZE_LIMIT = 400_000  # bytes
STEPS = 100
f32 = np.float32
f64 = np.float64

RUNS = [
    ("lamb_default", dict(lr=1e-3)),
    # weight decay in the update, the step size's bias correction, a clamp the parameters' norms
    # exceed (w1, w3: about 20), other betas
    ("lamb_wd_debias_clamp", dict(lr=1e-3, weight_decay=0.01, debias=True, clamp_value=0.5,
                                  betas=(0.8, 0.99))),
]
DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, clamp_value=10.0,
                debias=False)


def run(hp, scen):
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in scen.p0]
    opt = torch_optimizer.Lamb(params, **hp)
    snaps = {}
    for t in range(1, STEPS + 1):
        for p, g in zip(params, scen.grads[t]):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
        snaps[t] = [p.detach().numpy().copy() for p in params]
    return snaps, opt, params


def norm_torch(x):
    """torch.norm of a float32 tensor (a float32 result)."""
    return f32(torch.norm(torch.from_numpy(np.ascontiguousarray(x, dtype=f32))).item())


def lpmm_sum(values):
    """lpmm's sum of squares: the fixed-point fold of src/fixed.rs (the largest square's exponent
    E, every square floored to a multiple of 2^(E - F) with F = 62 - bitlen(count), the integer
    sum rounded once to f64)."""
    x = np.asarray(values, f32).reshape(-1)
    count = x.size
    x = x.astype(f64)
    x = x[np.isfinite(x) & (x != 0)]
    if x.size == 0:
        return 0.0
    q = x * x
    bits = q.view(np.uint64)
    field = ((bits >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64)
    e = int(field.max()) - 1023
    frac = 62 - count.bit_length()
    mantissa = (bits & np.uint64((1 << 52) - 1)) | np.uint64(1 << 52)
    total = 0
    for m, fld in zip(mantissa.tolist(), field.tolist()):
        shift = fld - 1023 - 52 + frac - e
        if shift >= 0:
            total += m << shift
        elif shift > -64:
            total += m >> -shift
    return float(total) * 2.0 ** (e - frac)


def norm_exact(x):
    return f32(math.sqrt(lpmm_sum(x)))


def replay(hp, scen, sqrt, norm):
    """torch_optimizer.Lamb's op sequence in numpy float32; returns {step: [params]}, states."""
    hp = dict(DEFAULTS, **hp)
    b1, b2 = hp["betas"]
    ps = [p.astype(f32).reshape(-1).copy() for p in scen.p0]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    snaps = {}
    for t in range(1, STEPS + 1):
        for k, p in enumerate(ps):
            g = scen.grads[t][k].reshape(-1)
            # exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            ms[k] = fma(g, f32(1 - b1), ms[k] * f32(b1))
            # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            vs[k] = fma(f32(1 - b2) * g, g, vs[k] * f32(b2))
            bias_correction = 1.0
            if hp["debias"]:
                bias_correction = math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            step_size = hp["lr"] * bias_correction
            weight_norm = min(norm(p), f32(hp["clamp_value"]))
            adam_step = ms[k] / (sqrt(vs[k]) + f32(hp["eps"]))
            if hp["weight_decay"] != 0:
                adam_step = fma(p, f32(hp["weight_decay"]), adam_step)
            adam_norm = norm(adam_step)
            trust_ratio = f32(1.0) if weight_norm == 0 or adam_norm == 0 else f32(weight_norm / adam_norm)
            alpha = f32(-step_size) * trust_ratio
            ps[k] = fma(adam_step, alpha, p)
        snaps[t] = [p.copy() for p in ps]
    return snaps, ms, vs


def main():
    torch.set_num_threads(1)
    versions = {
        "torch": torch.__version__,
        "torch_optimizer": torch_optimizer.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }
    print("versions:", json.dumps(versions))
    scen = Scenario(STEPS)
    tensors, meta, rows = {}, {}, []
    w2 = NAMES.index("w2")
    for name, hp in RUNS:
        snaps, opt, params = run(hp, scen)
        for k, tname in enumerate(NAMES):
            tensors[f"{name}.step{STEPS}.{tname}"] = snaps[STEPS][k]
        for t in (1, 10):
            tensors[f"{name}.step{t}.b"] = snaps[t][NAMES.index("b")]
        state = opt.state[params[w2]]
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"{name}.{key}.w2"] = state[key].detach().numpy().copy()
        meta[name] = dict(anchor="torch_optimizer.Lamb", hp=dict(DEFAULTS, **hp), steps=STEPS)
        for label, sqrt, norm in (("torch sqrt, torch norm", sqrt_torch, norm_torch),
                                  ("exact sqrt, lpmm sums", sqrt_exact, norm_exact)):
            r_snaps, r_ms, r_vs = replay(hp, scen, sqrt, norm)
            if label.startswith("exact"):
                tensors[f"{name}.lpmm.step{STEPS}.w2"] = r_snaps[STEPS][w2]
            for t in (1, 10, STEPS):
                rows.append(diff_row(f"{name} (replay, {label}) step {t:>3}", zip(snaps[t], r_snaps[t])))
            rows.append(diff_row(f"{name} (replay, {label}) exp_avg_sq",
                                 [(opt.state[p]["exp_avg_sq"].detach().numpy(), v) for p, v in zip(params, r_vs)]))

    print("\nanchor vs float32 replay of the op sequence (all four tensors per row):")
    for row in rows:
        print("  ", row)

    metadata = {
        "generator": "gen_lamb.py",
        "versions": json.dumps(versions, sort_keys=True),
        "tensors": json.dumps([[n, list(s)] for n, s in TENSORS]),
        "configs": json.dumps(meta, sort_keys=True),
    }
    write_safetensors(OUT, tensors, metadata)
    size = OUT.stat().st_size
    print(f"\nwrote {OUT.name}: {size} bytes, {len(tensors)} tensors")
    assert size < SIZE_LIMIT, f"{OUT.name} is {size} bytes, over the {SIZE_LIMIT} byte budget"


if __name__ == "__main__":
    main()
