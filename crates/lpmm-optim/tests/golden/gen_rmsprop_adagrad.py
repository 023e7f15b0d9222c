#!/usr/bin/env python3
"""Generate rmsprop_adagrad.safetensors: golden trajectories of RMSprop and Adagrad for lpmm-optim.

Anchors, all run on the CPU in float32 with one torch thread:
  torch.optim.RMSprop, torch.optim.Adagrad   (single-tensor path: foreach=False)
  bitsandbytes RMSprop8bit, Adagrad8bit      (bitsandbytes/backends/cpu/ops.py)
See README.md beside this file ("## rmsprop_adagrad.safetensors") for the pinned environment,
the command line, the op sequence each anchor runs and the findings.

The scenario is the one of gen_reference_optimizers.py (repeated here, so that this script needs
only torch, bitsandbytes and numpy, and checked bit for bit against init.* / grad1.* of
optim_trajectories.safetensors):
  tensors, tensor id = index:  0 "w1" [64, 80], 1 "w2" [4396], 2 "b" [33], 3 "w3" [96, 128];
  i = row-major flat index.
  mix(z)      = splitmix64 finalizer (all mod 2^64)
  h(tid,t,i)  = mix(tid * 0x9E3779B97F4A7C15 + t * 0xD1B54A32D192ED03 + i)
  u(tid,t,i)  = f32(h >> 40) / f32(2^23) - f32(1)
  p0[i]       = u(tid, 0, i) * f32(0.5)
  g_t[i]      = u(tid, t, i) * (f32(0.01) * f32(1 + i % 7))   for t = 1, 2, ...
Gradients do not depend on the parameters.

What is stored (little-endian safetensors, F32, sorted by name within the writer's order):
  {cfg}.step{k}.{name}     parameters after step k: every tensor at the last step (100 for torch,
                           50 for bitsandbytes); "b" at steps 1 and 10 (torch); "w1", "w2", "b" at
                           step 1 (bitsandbytes)
  {cfg}.{state}.w2         torch's state of "w2" after step 100, for the configurations listed
                           in STATES
  {cfg}.exact_sqrt.step100.w2  "w2" after step 100 of the float32 replay below with a correctly
                           rounded sqrt (torch configurations): what lpmm computes, bit for bit

The script also replays every torch anchor with a numpy float32 re-implementation of the op
sequence written in README.md (torch's own sqrt, then a correctly rounded one) and prints how far
each anchor is from it (stdout only).
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import bitsandbytes
import bitsandbytes as bnb

HERE = Path(__file__).resolve().parent
OUT = HERE / "rmsprop_adagrad.safetensors"
SIBLING = HERE / "optim_trajectories.safetensors"
SIZE_LIMIT = 1_000_000  # bytes

TENSORS = [("w1", (64, 80)), ("w2", (4396,)), ("b", (33,)), ("w3", (96, 128))]
NAMES = [n for n, _ in TENSORS]
M64 = (1 << 64) - 1
f32 = np.float32
f64 = np.float64


# --------------------------------------------------------------------------- scenario


def mix(z):
    z = z.copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def uniform(tid, t, n):
    base = (tid * 0x9E3779B97F4A7C15 + t * 0xD1B54A32D192ED03) & M64
    h = mix(np.uint64(base) + np.arange(n, dtype=np.uint64))
    return (h >> np.uint64(40)).astype(f32) / f32(2.0**23) - f32(1.0)


def init_param(tid, n):
    return uniform(tid, 0, n) * f32(0.5)


def gradient(tid, t, n):
    return uniform(tid, t, n) * (f32(0.01) * (f32(1.0) + (np.arange(n) % 7).astype(f32)))


class Scenario:
    def __init__(self, max_step):
        sizes = [math.prod(s) for _, s in TENSORS]
        self.p0 = [init_param(k, n).reshape(s) for k, (n, (_, s)) in enumerate(zip(sizes, TENSORS))]
        self.grads = {t: [gradient(k, t, n).reshape(s) for k, (n, (_, s)) in enumerate(zip(sizes, TENSORS))]
                      for t in range(1, max_step + 1)}


def read_safetensors(path):
    """{name: numpy array} of an F32/U8 safetensors file (no safetensors package needed)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        dt = {"F32": "<f4", "U8": "u1"}[v["dtype"]]
        out[k] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=dt).reshape(v["shape"])
    return out


def write_safetensors(path, tensors, metadata):
    """Byte-reproducible writer (as gen_reference_optimizers.py): "__metadata__" first (sorted
    keys), then tensors by name, contiguous offsets."""
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, off = [], 0
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k], dtype=np.float32)
        b = a.astype("<f4", copy=False).tobytes()
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


# --------------------------------------------------------------------------- configurations

TORCH_STEPS = 100
BNB_STEPS = 50

TORCH_RUNS = [
    ("rmsprop_default", "rmsprop", dict(lr=1e-3)),
    ("rmsprop_momentum_wd", "rmsprop", dict(lr=1e-3, momentum=0.9, weight_decay=0.01)),
    ("rmsprop_centered", "rmsprop", dict(lr=1e-3, momentum=0.5, centered=True, weight_decay=0.01)),
    # alpha < 0.5: the gradient average's lerp takes torch's other branch (weight >= 0.5)
    ("rmsprop_centered_alpha04", "rmsprop", dict(lr=1e-3, alpha=0.4, centered=True)),
    ("adagrad_default", "adagrad", dict(lr=1e-2)),
    ("adagrad_decay_wd_init", "adagrad",
     dict(lr=1e-2, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
]
# bitsandbytes refuses centered RMSprop, lr_decay and an initial accumulator, and its kernels
# ignore RMSprop's momentum: its defaults otherwise.
BNB_RUNS = [
    ("bnb_rmsprop8bit", "rmsprop", dict(lr=1e-3, alpha=0.99, eps=1e-8)),
    ("bnb_adagrad8bit", "adagrad", dict(lr=1e-2, eps=1e-10)),
]
# torch's state key -> stored name, for "w2" after the last step.
STATES = {
    "rmsprop_centered": {"square_avg": "square_avg", "grad_avg": "grad_avg", "momentum_buffer": "momentum_buffer"},
    "adagrad_decay_wd_init": {"sum": "sum"},
}

TORCH_DEFAULTS = {
    "rmsprop": dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False),
    "adagrad": dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10),
}


def make_torch(kind, hp, params):
    cls = torch.optim.RMSprop if kind == "rmsprop" else torch.optim.Adagrad
    return cls(params, foreach=False, **hp)


def make_bnb(kind, hp, params):
    cls = bnb.optim.RMSprop8bit if kind == "rmsprop" else bnb.optim.Adagrad8bit
    return cls(params, **hp)


def run(make, scen, steps):
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in scen.p0]
    opt = make(params)
    snaps = {}
    for t in range(1, steps + 1):
        for p, g in zip(params, scen.grads[t]):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
        snaps[t] = [p.detach().numpy().copy() for p in params]
    return snaps, opt, params


# --------------------------------------------------------------------------- float32 replay


def fma(a, b, c):
    """Correctly rounded f32 a*b + c (as gen_reference_optimizers.py: the f64 product is exact,
    TwoSum recovers the f64 sum's error and breaks the one bad case of double rounding)."""
    a, b, c = (np.asarray(x, dtype=f64) for x in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.astype(f32)
    lo = np.where(r.astype(f64) <= s, r, np.nextafter(r, f32(-np.inf)))
    hi = np.nextafter(lo, f32(np.inf))
    on_mid = (lo.astype(f64) + hi.astype(f64)) / 2.0 == s
    fix = on_mid & (err != 0)
    return np.where(fix, np.where(err > 0, hi, lo), r).astype(f32)


def sqrt_torch(x):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=f32)).sqrt().numpy()


def sqrt_exact(x):
    return np.sqrt(np.asarray(x, f32))


def replay(kind, hp, scen, steps, sqrt):
    """The op sequence of README.md in numpy float32; returns {step: [params]} and the states."""
    hp = dict(TORCH_DEFAULTS[kind], **hp)
    ps = [p.astype(f32).reshape(-1).copy() for p in scen.p0]
    states = [dict() for _ in ps]
    snaps = {}
    for t in range(1, steps + 1):
        for k, p in enumerate(ps):
            g = scen.grads[t][k].reshape(-1)
            s = states[k]
            if hp["weight_decay"] != 0:
                g = fma(p, f32(hp["weight_decay"]), g)
            if kind == "rmsprop":
                a = hp["alpha"]
                v = s.get("square_avg", np.zeros_like(p))
                v = fma(f32(1 - a) * g, g, v * f32(a))
                s["square_avg"] = v
                if hp["centered"]:
                    ga = s.get("grad_avg", np.zeros_like(p))
                    w = f32(1 - a)
                    ga = fma(w, g - ga, ga) if abs(w) < 0.5 else fma(w - f32(1), g - ga, g)
                    s["grad_avg"] = ga
                    avg = sqrt(fma(-ga, ga, v))
                else:
                    avg = sqrt(v)
                avg = avg + f32(hp["eps"])
                if hp["momentum"] > 0:
                    buf = s.get("momentum_buffer", np.zeros_like(p))
                    buf = buf * f32(hp["momentum"]) + g / avg
                    s["momentum_buffer"] = buf
                    p = fma(buf, f32(-hp["lr"]), p)
                else:
                    p = p + (f32(-hp["lr"]) * g) / avg
            else:
                clr = hp["lr"] / (1 + (t - 1) * hp["lr_decay"])
                sm = s.get("sum", np.full_like(p, f32(hp["initial_accumulator_value"])))
                sm = fma(g, g, sm)
                s["sum"] = sm
                p = p + (f32(-clr) * g) / (sqrt(sm) + f32(hp["eps"]))
            ps[k] = p.astype(f32)
        snaps[t] = [p.copy() for p in ps]
    return snaps, states


def ordered(x):
    i = np.asarray(x, f32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def diff_row(label, pairs):
    n_diff = n_tot = max_ulp = 0
    max_abs = 0.0
    for a, b in pairs:
        a, b = np.asarray(a, f32).reshape(-1), np.asarray(b, f32).reshape(-1)
        d = np.abs(ordered(a) - ordered(b))
        n_diff += int((d != 0).sum())
        n_tot += a.size
        max_ulp = max(max_ulp, int(d.max()))
        max_abs = max(max_abs, float(np.abs(a.astype(f64) - b.astype(f64)).max()))
    return f"{label:<62} {n_diff:>6} of {n_tot:>5} differ, max {max_ulp:>5} ulp, max |d| {max_abs:.3e}"


# --------------------------------------------------------------------------- main


def main():
    torch.set_num_threads(1)
    versions = {
        "torch": torch.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }
    print("versions:", json.dumps(versions))
    scen = Scenario(TORCH_STEPS)
    if SIBLING.exists():
        sib = read_safetensors(SIBLING)
        same = all(np.array_equal(scen.p0[k].reshape(-1).view(np.uint32), sib[f"init.{n}"].reshape(-1).view(np.uint32))
                   and np.array_equal(scen.grads[1][k].reshape(-1).view(np.uint32),
                                      sib[f"grad1.{n}"].reshape(-1).view(np.uint32))
                   for k, n in enumerate(NAMES))
        print(f"p0 and g_1 equal init.* / grad1.* of {SIBLING.name} bit for bit: {same}")
        assert same

    tensors, meta, rows = {}, {}, []
    for name, kind, hp in TORCH_RUNS:
        snaps, opt, params = run(lambda ps: make_torch(kind, hp, ps), scen, TORCH_STEPS)
        for k, tname in enumerate(NAMES):
            tensors[f"{name}.step{TORCH_STEPS}.{tname}"] = snaps[TORCH_STEPS][k]
        for t in (1, 10):
            tensors[f"{name}.step{t}.b"] = snaps[t][NAMES.index("b")]
        w2 = params[NAMES.index("w2")]
        for key, stored in STATES.get(name, {}).items():
            tensors[f"{name}.{stored}.w2"] = opt.state[w2][key].detach().numpy().copy()
        meta[name] = dict(anchor=f"torch.optim.{'RMSprop' if kind == 'rmsprop' else 'Adagrad'}",
                          hp=dict(TORCH_DEFAULTS[kind], **hp), steps=TORCH_STEPS)
        for label, sqrt in (("torch sqrt", sqrt_torch), ("exact sqrt", sqrt_exact)):
            r_snaps, r_states = replay(kind, hp, scen, TORCH_STEPS, sqrt)
            if label == "exact sqrt":
                tensors[f"{name}.exact_sqrt.step{TORCH_STEPS}.w2"] = r_snaps[TORCH_STEPS][NAMES.index("w2")]
            for t in (1, 10, 100):
                rows.append(diff_row(f"{name} (replay, {label}) step {t:>3}", zip(snaps[t], r_snaps[t])))
            for key in STATES.get(name, {}):
                rows.append(diff_row(f"{name} (replay, {label}) {key}",
                                     [(opt.state[p][key].detach().numpy(), r[key]) for p, r in zip(params, r_states)]))

    for name, kind, hp in BNB_RUNS:
        snaps, opt, params = run(lambda ps: make_bnb(kind, hp, ps), scen, BNB_STEPS)
        for k, tname in enumerate(NAMES):
            tensors[f"{name}.step{BNB_STEPS}.{tname}"] = snaps[BNB_STEPS][k]
            if tname != "w3":
                tensors[f"{name}.step1.{tname}"] = snaps[1][k]
        layout = {n: sorted(f"{key}:{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                            for key, v in opt.state[p].items() if torch.is_tensor(v))
                  for n, p in zip(NAMES, params)}
        print(f"{name}: state layout {json.dumps(layout)}")
        qmap = opt.state[params[0]]["qmap1"]
        signed = bool((qmap < 0).any())
        print(f"{name}: qmap1 of w1 is the {'signed' if signed else 'unsigned'} dynamic map "
              f"(min {float(qmap.min()):.6g}, max {float(qmap.max()):.6g})")
        meta[name] = dict(anchor=f"bitsandbytes.optim.{'RMSprop8bit' if kind == 'rmsprop' else 'Adagrad8bit'}",
                          hp=hp, steps=BNB_STEPS, state1_map="signed" if signed else "unsigned")
        # The same rule in f32 (the torch replay), to see the 8-bit state's effect.
        r_snaps, _ = replay(kind, hp, scen, BNB_STEPS, sqrt_torch)
        for t in (1, 10, 50):
            rows.append(diff_row(f"{name} vs its rule in f32 (torch sqrt) step {t:>3}", zip(snaps[t], r_snaps[t])))

    print("\nanchor vs float32 replay of the documented op sequence (all four tensors per row):")
    for row in rows:
        print("  ", row)

    metadata = {
        "generator": "gen_rmsprop_adagrad.py",
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
