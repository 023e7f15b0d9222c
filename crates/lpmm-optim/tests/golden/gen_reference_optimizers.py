#!/usr/bin/env python3
"""Generate optim_trajectories.safetensors: golden optimizer trajectories for lpmm-optim.

Anchors: torch.optim (SGD, Adam, AdamW), lion-pytorch (Lion), bitsandbytes (AdamW8bit, CPU)
and torchao (AdamW4bit, CPU).  See README.md beside this file for the pinned environment,
the command line, the update rules each anchor implements and the findings.

Scenario (the Rust side regenerates it with the same integer arithmetic):
  tensors, tensor id = index:  0 "w1" [64, 80], 1 "w2" [4396], 2 "b" [33], 3 "w3" [96, 128];
  i = row-major flat index.
  mix(z)      = splitmix64 finalizer (all mod 2^64):
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9; z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
                z = z ^ (z >> 31)
  h(tid,t,i)  = mix(tid * 0x9E3779B97F4A7C15 + t * 0xD1B54A32D192ED03 + i)
  u(tid,t,i)  = f32(h >> 40) / f32(2^23) - f32(1)        (in [-1, 1), every step exact in f32)
  p0[i]       = u(tid, 0, i) * f32(0.5)
  g_t[i]      = u(tid, t, i) * (f32(0.01) * f32(1 + i % 7))   for t = 1, 2, ...  (f32 products)
Gradients do not depend on the parameters.  Every configuration starts from p0.

What is stored (little-endian safetensors; F32 tensors first, then U8, each group by name):
  init.{name}, grad1.{name}                 f32   p0 and g_1, to check the regeneration bit for bit
  {config}.step{k}.{name}                   f32   parameters after step k (see snapshot_tensors())
  adamw.m.{name}, adamw.v.{name}            f32   torch AdamW exp_avg / exp_avg_sq after step 100
  bnb_adamw8bit.{state1,state2}.{name}      u8    raw 8-bit codes after step 50 (w1, w2, w3)
  bnb_adamw8bit.{absmax1,absmax2}.{name}    f32   per-256-block absmax
  bnb_adamw8bit.{qmap1,qmap2}.{name}        f32[256] the maps bnb keeps in optimizer.state[p]
  bnb_adamw8bit.{state1,state2}.b           f32   "b" (33 < min_8bit_size) keeps f32 m / v
  torchao_adamw4bit.{m,v}.{name}            f32   dequantized exp_avg / exp_avg_sq (w1, w3)
  torchao_adamw4bit.{m,v}.{codes,scale,qmap}.{name}  u8/f32/f32  torchao's raw 4-bit state
  torchao_adamw4bit.{m,v}.{name} for w2, b  f32   torchao keeps these unquantized (see README)

Size budget (< 2 MB): every configuration stores all four tensors at its final step; at the
intermediate steps (1, 10) it stores "w2" and "b" (every i % 7 class, a ragged SIMD tail, the
sub-min_8bit_size tensor), and the block-quantized configurations also "w1".  All four tensors
at every step would be 3.2 MB.

The script also replays every anchor with an independent numpy float32 re-implementation of
the op sequence documented in README.md (with an exact f32 fused multiply-add where the anchor's
kernel uses one) and prints how far the anchor's trajectory is from it (stdout, not stored).
"""

import importlib.util
import json
import math
from fractions import Fraction
import sys
from pathlib import Path

import numpy as np
import torch
import safetensors
import bitsandbytes
import bitsandbytes as bnb
import lion_pytorch
import torchao
from lion_pytorch import Lion
from torchao.optim import AdamW4bit

HERE = Path(__file__).resolve().parent
OUT = HERE / "optim_trajectories.safetensors"
REPO = HERE.parents[3]
SIZE_LIMIT = 2_000_000  # bytes

TENSORS = [("w1", (64, 80)), ("w2", (4396,)), ("b", (33,)), ("w3", (96, 128))]
NAMES = [n for n, _ in TENSORS]

M64 = (1 << 64) - 1
K_TID = 0x9E3779B97F4A7C15
K_STEP = 0xD1B54A32D192ED03

f32 = np.float32


# --------------------------------------------------------------------------- scenario


def mix(z):
    """splitmix64 finalizer on a uint64 array (numpy uint64 arithmetic wraps mod 2^64)."""
    z = z.copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def uniform(tid, t, n):
    """u(tid, t, i) for i in 0..n, float32 in [-1, 1)."""
    base = (tid * K_TID + t * K_STEP) & M64
    h = mix(np.uint64(base) + np.arange(n, dtype=np.uint64))
    top = (h >> np.uint64(40)).astype(np.float32)  # 24-bit integer, exact in f32
    return top / f32(2.0**23) - f32(1.0)


def init_param(tid, n):
    return uniform(tid, 0, n) * f32(0.5)


def gradient(tid, t, n):
    scale = f32(0.01) * (f32(1.0) + (np.arange(n) % 7).astype(np.float32))
    return uniform(tid, t, n) * scale


class Scenario:
    """p0 and cached gradients (flat f32 numpy arrays)."""

    def __init__(self, max_step):
        self.sizes = [math.prod(s) for _, s in TENSORS]
        self.p0 = [init_param(tid, n) for tid, n in enumerate(self.sizes)]
        self.grads = {
            t: [gradient(tid, t, n) for tid, n in enumerate(self.sizes)] for t in range(1, max_step + 1)
        }

    def grad(self, t):
        return self.grads[t]


# --------------------------------------------------------------------------- configurations

# Each configuration: name, kind (selects the replay), steps, store (the stored steps),
# hp (hyper-parameters, for the metadata and the replay), make(params) -> the anchor optimizer.
# torch optimizers run with foreach=False, fused=False (the single-tensor code path).
SGD_RUNS = [
    ("sgd_plain", dict(lr=0.01, momentum=0.0)),
    ("sgd_momentum", dict(lr=0.01, momentum=0.9)),
    ("sgd_nesterov_wd", dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd_dampening_wd", dict(lr=0.01, momentum=0.9, dampening=0.5, weight_decay=0.001)),
]
ADAM_HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)


def configs():
    out = []
    for name, hp in SGD_RUNS:
        out.append(dict(name=name, kind="sgd", steps=100, store=(1, 10, 100), hp=hp,
                        make=lambda ps, hp=hp: torch.optim.SGD(ps, foreach=False, fused=False, **hp)))
    out.append(dict(name="adamw", kind="adam", steps=100, store=(1, 10, 100),
                    hp=dict(ADAM_HP, weight_decay=0.01, decoupled=True),
                    make=lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, foreach=False, fused=False, **ADAM_HP)))
    out.append(dict(name="adam_l2", kind="adam", steps=100, store=(1, 10, 100),
                    hp=dict(ADAM_HP, weight_decay=0.01, decoupled=False),
                    make=lambda ps: torch.optim.Adam(ps, weight_decay=0.01, foreach=False, fused=False, **ADAM_HP)))
    out.append(dict(name="adam", kind="adam", steps=100, store=(1, 10, 100),
                    hp=dict(ADAM_HP, weight_decay=0.0, decoupled=False),
                    make=lambda ps: torch.optim.Adam(ps, weight_decay=0.0, foreach=False, fused=False, **ADAM_HP)))
    out.append(dict(name="lion", kind="lion", steps=100, store=(1, 10, 100),
                    hp=dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01),
                    make=lambda ps: Lion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01, use_triton=False)))
    out.append(dict(name="bnb_adamw8bit", kind="bnb8", steps=50, store=(1, 10, 50),
                    hp=dict(ADAM_HP, weight_decay=0.01, block=256, min_8bit_size=4096),
                    make=lambda ps: bnb.optim.AdamW8bit(ps, weight_decay=0.01, **ADAM_HP)))
    out.append(dict(name="torchao_adamw4bit", kind="ao4", steps=50, store=(1, 10, 50),
                    hp=dict(ADAM_HP, weight_decay=0.01, block=128),
                    make=lambda ps: AdamW4bit(ps, weight_decay=0.01, **ADAM_HP)))
    return out


QUANTIZED_KINDS = ("bnb8", "ao4")


def snapshot_tensors(cfg, step):
    """Which tensors are stored after `step` (see the size budget in the docstring)."""
    if step == cfg["steps"]:
        return NAMES
    return ["w1", "w2", "b"] if cfg["kind"] in QUANTIZED_KINDS else ["w2", "b"]


# --------------------------------------------------------------------------- anchor runs


def run_anchor(cfg, scen):
    """Run one configuration from p0; returns ({step: [flat f32 params]}, optimizer, params)."""
    params = [torch.nn.Parameter(torch.from_numpy(p.copy()).reshape(shape))
              for p, (_, shape) in zip(scen.p0, TENSORS)]
    opt = cfg["make"](params)
    snaps = {}
    for t in range(1, cfg["steps"] + 1):
        for p, g, (_, shape) in zip(params, scen.grad(t), TENSORS):
            p.grad = torch.from_numpy(g.copy()).reshape(shape)
        opt.step()
        if t in cfg["store"]:
            snaps[t] = [p.detach().numpy().reshape(-1).copy() for p in params]
    return snaps, opt, params


def trace_bnb_cpu_path(scen):
    """Record which bitsandbytes Python functions one AdamW8bit step runs on the CPU."""
    params = [torch.nn.Parameter(torch.from_numpy(p.copy()).reshape(shape))
              for p, (_, shape) in zip(scen.p0, TENSORS)]
    opt = bnb.optim.AdamW8bit(params, weight_decay=0.01, **ADAM_HP)
    for p, g, (_, shape) in zip(params, scen.grad(1), TENSORS):
        p.grad = torch.from_numpy(g.copy()).reshape(shape)
    seen = []

    def prof(frame, event, arg):
        if event == "call" and "bitsandbytes" in frame.f_code.co_filename:
            f = frame.f_code.co_filename.split("site-packages/")[-1]
            seen.append(f"{f}:{frame.f_code.co_firstlineno} {frame.f_code.co_name}")

    sys.setprofile(prof)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return list(dict.fromkeys(s for s in seen if "/backends/" in s))


# --------------------------------------------------------------------------- float32 replays
#
# Independent numpy re-implementations of the anchors' op sequences.  Python float scalars
# are rounded to f32 where the anchor's kernel receives them (torch casts a double Scalar to
# the f32 opmath type).  fma() is an exactly rounded f32 fused multiply-add: torch 2.15's CPU
# kernels for add(alpha=), lerp and addcmul compute with FMA (checked: bit for bit).


def fma(a, b, c):
    """Correctly rounded f32 a*b + c (a*b is exact in f64; the f64 sum's rounding error is
    recovered with TwoSum and breaks the only bad case of double rounding: an f64 sum that
    lies exactly on an f32 midpoint)."""
    a, b, c = (np.asarray(x, dtype=np.float64) for x in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    lo = np.where(r64 <= s, r, np.nextafter(r, f32(-np.inf)))
    hi = np.nextafter(lo, f32(np.inf))
    on_mid = (lo.astype(np.float64) + hi.astype(np.float64)) / 2.0 == s
    fix = on_mid & (err != 0)
    return np.where(fix, np.where(err > 0, hi, lo), r).astype(np.float32)


def sqrt_exact(x):
    return np.sqrt(x.astype(np.float32))


def sqrt_torch(x):
    """torch 2.15's CPU float32 sqrt (not correctly rounded, see README)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).sqrt().numpy()


def replay_sgd(scen, hp, steps, store, sqrt=None):
    lr, mu = hp["lr"], hp.get("momentum", 0.0)
    damp, wd, nesterov = hp.get("dampening", 0.0), hp.get("weight_decay", 0.0), hp.get("nesterov", False)
    ps = [p.copy() for p in scen.p0]
    bufs = [None] * len(ps)
    snaps = {}
    for t in range(1, steps + 1):
        for k, g in enumerate(scen.grad(t)):
            d = g
            if wd != 0:
                d = fma(ps[k], f32(wd), d)                          # grad.add(param, alpha=wd)
            if mu != 0:
                if bufs[k] is None:
                    bufs[k] = d.copy()                               # first step: buf = d
                else:
                    bufs[k] = fma(d, f32(1 - damp), bufs[k] * f32(mu))  # buf.mul_(mu).add_(d, 1-damp)
                d = fma(bufs[k], f32(mu), d) if nesterov else bufs[k]
            ps[k] = fma(d, f32(-lr), ps[k])                          # param.add_(d, alpha=-lr)
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps


def replay_adam(scen, hp, steps, store, sqrt):
    lr, (b1, b2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    ps = [p.copy() for p in scen.p0]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    snaps = {}
    for t in range(1, steps + 1):
        bc1 = 1 - b1**t                                             # Python doubles
        bc2_sqrt = (1 - b2**t) ** 0.5
        step_size = lr / bc1
        for k, g in enumerate(scen.grad(t)):
            if wd != 0:
                if hp["decoupled"]:
                    ps[k] = ps[k] * f32(1 - lr * wd)                  # param.mul_(1 - lr*wd)
                else:
                    g = fma(ps[k], f32(wd), g)                       # grad.add(param, alpha=wd)
            ms[k] = fma(f32(1 - b1), g - ms[k], ms[k])               # exp_avg.lerp_(g, 1-b1), w < 0.5
            vs[k] = fma(f32(1 - b2) * g, g, vs[k] * f32(b2))         # mul_(b2).addcmul_(g, g, 1-b2)
            denom = sqrt(vs[k]) / f32(bc2_sqrt) + f32(eps)
            ps[k] = ps[k] + (f32(-step_size) * ms[k]) / denom        # addcdiv_(m, denom, -step_size)
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps, ms, vs


def replay_lion(scen, hp, steps, store, sqrt=None):
    lr, (b1, b2), wd = hp["lr"], hp["betas"], hp["weight_decay"]
    ps = [p.copy() for p in scen.p0]
    ms = [np.zeros_like(p) for p in ps]
    snaps = {}
    for t in range(1, steps + 1):
        for k, g in enumerate(scen.grad(t)):
            ps[k] = ps[k] * f32(1 - lr * wd)                         # p.mul_(1 - lr*wd)
            u = np.sign(fma(g, f32(1 - b1), ms[k] * f32(b1)))        # sign(b1*m + (1-b1)*g), old m
            ps[k] = fma(u, f32(-lr), ps[k])                          # p.add_(u, alpha=-lr)
            ms[k] = fma(g, f32(1 - b2), ms[k] * f32(b2))             # m.mul_(b2).add_(g, 1-b2)
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps


def load_exact_thresholds():
    """The exact nearest-code rule of crates/lpmm-quant (thresholds() of its generator)."""
    path = REPO / "crates" / "lpmm-quant" / "tests" / "golden" / "gen_bnb_blockwise.py"
    spec = importlib.util.spec_from_file_location("gen_bnb_blockwise", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.thresholds


def bnb_quantizer(code, kind, thresholds):
    """Block-256 quantizer: kind 'bnb' = bitsandbytes' own CPU quantize_blockwise (its 65,536-bin
    table), kind 'exact' = lpmm-quant's exact nearest-code rule."""
    code_t = torch.from_numpy(code.copy())
    thr = thresholds(code)[0].astype(np.float64) if kind == "exact" else None

    def quantize(x):
        if kind == "bnb":
            q, st = bitsandbytes.functional.quantize_blockwise(torch.from_numpy(x.copy()), code=code_t, blocksize=256)
            return q.numpy().astype(np.uint8), st.absmax.numpy().astype(np.float32)
        n = len(x)
        nb = -(-n // 256)
        pad = np.zeros(nb * 256, dtype=np.float32)
        pad[:n] = np.abs(x)
        absmax = pad.reshape(nb, 256).max(axis=1)
        scale = np.repeat(absmax, 256)[:n]
        with np.errstate(invalid="ignore", divide="ignore"):
            y = np.where(scale == 0, f32(0), x / scale).astype(np.float32)
        return np.searchsorted(thr, y.astype(np.float64), side="right").astype(np.uint8), absmax

    return quantize


def replay_bnb8(scen, hp, steps, store, sqrt, quantizer="bnb"):
    """bitsandbytes 0.50.2 AdamW8bit on the CPU (backends/cpu/ops.py)."""
    lr, (b1, b2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    qmap1 = bitsandbytes.functional.create_dynamic_map(signed=True).numpy().astype(np.float32)
    qmap2 = bitsandbytes.functional.create_dynamic_map(signed=False).numpy().astype(np.float32)
    thresholds = load_exact_thresholds() if quantizer == "exact" else None
    quant1 = bnb_quantizer(qmap1, quantizer, thresholds)
    quant2 = bnb_quantizer(qmap2, quantizer, thresholds)
    ps = [p.copy() for p in scen.p0]
    n8 = [len(p) >= hp["min_8bit_size"] for p in ps]
    st = [dict(c1=np.zeros(len(p), np.uint8), c2=np.zeros(len(p), np.uint8),
               a1=np.zeros(-(-len(p) // 256), np.float32), a2=np.zeros(-(-len(p) // 256), np.float32))
          if q else dict(m=np.zeros_like(p), v=np.zeros_like(p)) for p, q in zip(ps, n8)]
    snaps = {}
    for t in range(1, steps + 1):
        c1 = 1 - b1**t
        c2 = math.sqrt(1 - b2**t)
        for k, g in enumerate(scen.grad(t)):
            s = st[k]
            if n8[k]:  # 8-bit blockwise path, cpu/ops.py:469-577
                m = qmap1[s["c1"]] * np.repeat(s["a1"], 256)[: len(g)]   # dequantize: code * absmax
                v = qmap2[s["c2"]] * np.repeat(s["a2"], 256)[: len(g)]
                m = fma(g, f32(1 - b1), m * f32(b1))                   # mul_(b1).add_(g, 1-b1)
                v = fma(f32(1 - b2) * g, g, v * f32(b2))               # mul_(b2).addcmul_(g, g, 1-b2)
                denom = sqrt(v) / f32(c2) + f32(eps)
                ps[k] = ps[k] * f32(1 - lr * wd)                       # decay BEFORE the update
                ps[k] = ps[k] + (f32(-lr / c1) * m) / denom            # addcdiv_(m, denom, -lr/c1)
                s["c1"], s["a1"] = quant1(m)
                s["c2"], s["a2"] = quant2(v)
            else:  # f32 states, cpu/ops.py:345-383
                s["m"] = fma(g, f32(1 - b1), s["m"] * f32(b1))
                s["v"] = fma(f32(1 - b2) * g, g, s["v"] * f32(b2))
                ps[k] = ps[k] * f32(1 - lr * wd)                       # decay BEFORE the update
                upd = s["m"] / (sqrt(s["v"]) + f32(eps * c2))         # eps scaled by c2 here
                ps[k] = fma(upd, f32(-lr * c2 / c1), ps[k])            # add_(update, alpha=step_size)
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps, st


def ao_qmaps():
    from torchao.optim.subclass_4bit import get_qmap_signed, get_qmap_unsigned
    return np.array(get_qmap_signed(), np.float32), np.array(get_qmap_unsigned(), np.float32)


def ao_quantize(x, qmap, block):
    """torchao quant_utils.scale_tensor + quantize_4bit_with_qmap (f32 arithmetic throughout)."""
    xb = x.reshape(-1, block)
    scale = np.maximum(np.abs(xb).max(axis=1), f32(1e-12)).astype(np.float32)
    y = (xb / scale[:, None]).reshape(-1)
    codes = np.zeros(len(y), np.int64)
    for step in (8, 4, 2, 1):                                        # branchless binary search
        codes += np.where(y >= qmap[np.minimum(codes + step, 15)], step, 0)
    up = np.minimum(codes + 1, 15)
    lo_v, hi_v = qmap[codes], qmap[up]
    codes = np.where(y - lo_v >= (hi_v - lo_v) * f32(0.5), up, codes)  # ties (and above) go up
    return codes.astype(np.uint8), scale


def powf_cr(base, t):
    """Correctly rounded f32 power f32(base)**t (torch's f32 pow agrees on every step used here;
    numpy's float32 power does not)."""
    b = f32(base)
    x = Fraction(float(b)) ** t
    c = f32(float(x))
    cands = [np.nextafter(c, f32(-np.inf)), c, np.nextafter(c, f32(np.inf))]
    return min(cands, key=lambda y: abs(Fraction(float(y)) - x))


def replay_ao4(scen, hp, steps, store, sqrt):
    """torchao 0.18.0 AdamW4bit (adam.py single_param_adam, compiled by inductor on the CPU)."""
    lr, (b1, b2), eps, wd, block = f32(hp["lr"]), hp["betas"], hp["eps"], hp["weight_decay"], hp["block"]
    qs, qu = ao_qmaps()
    ps = [p.copy() for p in scen.p0]
    quant = [len(p) >= 4096 and len(p) % block == 0 for p in ps]
    st = [dict(m=np.zeros_like(p), v=np.zeros_like(p)) for p in ps]   # dequantized values
    raw = [dict() for _ in ps]                                       # packed codes and scales
    snaps = {}
    for t in range(1, steps + 1):
        bc1 = f32(1) - powf_cr(b1, t)                                # f32 pow: step is an f32 tensor
        bc2 = f32(1) - powf_cr(b2, t)
        for k, g in enumerate(scen.grad(t)):
            p = ps[k]
            p = p - (lr * f32(wd)) * p                                 # p - lr*wd*p
            m = st[k]["m"] + f32(1 - b1) * (g - st[k]["m"])            # lerp, weight < 0.5
            v = st[k]["v"] + f32(1 - b2) * (g * g - st[k]["v"])
            denom = sqrt(v) / np.sqrt(bc2) + f32(eps)
            ps[k] = p - lr * (m / bc1) / denom
            if quant[k]:
                cm, sm = ao_quantize(m, qs, block)
                cv, sv = ao_quantize(v, qu, block)
                st[k]["m"] = (qs[cm].reshape(-1, block) * sm[:, None]).reshape(-1)
                st[k]["v"] = (qu[cv].reshape(-1, block) * sv[:, None]).reshape(-1)
                # packing: element 2j in the high nibble, 2j+1 in the low nibble (subclass_4bit.py:158)
                raw[k] = dict(m_codes=(cm[0::2] << 4) | cm[1::2], m_scale=sm,
                              v_codes=(cv[0::2] << 4) | cv[1::2], v_scale=sv)
            else:
                st[k]["m"], st[k]["v"] = m, v
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps, st, raw


# --------------------------------------------------------------------------- comparison


def ordered(x):
    """f32 -> integers ordered like the floats (adjacent floats differ by 1)."""
    i = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def compare(a, b):
    """(elements that differ, max ulp distance, max |a - b|) over flat f32 arrays."""
    d = np.abs(ordered(a) - ordered(b))
    return int((d != 0).sum()), int(d.max()), float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def report_replay(label, anchor_snaps, replay_snaps):
    rows = []
    for t in sorted(anchor_snaps):
        n_diff = n_tot = n_big = 0
        max_ulp = 0
        max_abs = 0.0
        for a, r in zip(anchor_snaps[t], replay_snaps[t]):
            nd, mu, ma = compare(a, r)
            n_diff += nd
            n_tot += len(a)
            max_ulp = max(max_ulp, mu)
            max_abs = max(max_abs, ma)
            n_big += int((np.abs(a.astype(np.float64) - r.astype(np.float64)) > 1e-6).sum())
        rows.append(f"{label:<48} step {t:>3}: {n_diff:>6} of {n_tot} differ, max {max_ulp:>7} ulp, "
                    f"max |d| {max_abs:.3e}, |d| > 1e-6: {n_big}")
    return rows


# --------------------------------------------------------------------------- output


def write_safetensors(path, tensors, metadata):
    """Byte-reproducible safetensors writer (as crates/lpmm-quant/tests/golden): "__metadata__"
    first (sorted keys), then tensors by (descending item size, name), contiguous offsets."""
    st_dtype = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, off = [], 0
    for k in order:
        a = np.ascontiguousarray(tensors[k])
        b = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[k] = {"dtype": st_dtype[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def shaped(flat, name):
    return flat.reshape(dict(TENSORS)[name]).astype(np.float32)


# --------------------------------------------------------------------------- main


def main():
    torch.manual_seed(0)  # nothing here is random; set anyway
    versions = {
        "torch": torch.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "lion-pytorch": getattr(lion_pytorch, "__version__", None) or _dist_version("lion-pytorch"),
        "torchao": torchao.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print("versions:", json.dumps(versions))

    scen = Scenario(max_step=100)
    tensors = {}
    for k, name in enumerate(NAMES):
        tensors[f"init.{name}"] = shaped(scen.p0[k], name)
        tensors[f"grad1.{name}"] = shaped(scen.grad(1)[k], name)

    print("\nbitsandbytes AdamW8bit, CPU path (functions run by one step):")
    for line in trace_bnb_cpu_path(scen):
        print("  ", line)

    replay_rows = []
    summary = {}
    for cfg in configs():
        name = cfg["name"]
        snaps, opt, params = run_anchor(cfg, scen)
        for t, flat in snaps.items():
            for k, tname in enumerate(NAMES):
                if tname in snapshot_tensors(cfg, t):
                    tensors[f"{name}.step{t}.{tname}"] = shaped(flat[k], tname)

        if name == "adamw":
            for p, tname in zip(params, NAMES):
                tensors[f"adamw.m.{tname}"] = opt.state[p]["exp_avg"].numpy().astype(np.float32).copy()
                tensors[f"adamw.v.{tname}"] = opt.state[p]["exp_avg_sq"].numpy().astype(np.float32).copy()

        if name == "bnb_adamw8bit":
            info = {}
            for p, tname in zip(params, NAMES):
                s = opt.state[p]
                info[tname] = {k: f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}" if torch.is_tensor(v) else repr(v)
                               for k, v in s.items()}
                for key in ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"):
                    if key in s:
                        tensors[f"{name}.{key}.{tname}"] = s[key].numpy().copy()
            summary["bnb_state_keys"] = info
            # the maps bnb keeps are the lpmm-quant golden maps (bnb_blockwise.safetensors)
            quant_golden = REPO / "crates" / "lpmm-quant" / "tests" / "golden" / "bnb_blockwise.safetensors"
            if quant_golden.exists():
                from safetensors.numpy import load_file
                maps = load_file(str(quant_golden))
                same = all(np.array_equal(tensors[f"{name}.qmap{j}.{tname}"].view(np.uint32), maps[f"map.{m}"].view(np.uint32))
                           for tname in ("w1", "w2", "w3") for j, m in ((1, "signed"), (2, "unsigned")))
                print(f"\nbnb qmap1 / qmap2 equal lpmm-quant map.signed / map.unsigned bit for bit: {same}")
                assert same

        if name == "torchao_adamw4bit":
            from torchao.optim.subclass_4bit import OptimState4bit
            info = {}
            for p, tname in zip(params, NAMES):
                s = opt.state[p]
                info[tname] = {k: type(v).__name__ + (f"(signed={v.signed}, block_size={v.block_size})"
                                                      if isinstance(v, OptimState4bit) else "")
                               for k, v in s.items()}
                for key, short in (("exp_avg", "m"), ("exp_avg_sq", "v")):
                    x = s[key]
                    if isinstance(x, OptimState4bit):
                        tensors[f"{name}.{short}.{tname}"] = x.dequantize().numpy().astype(np.float32).copy()
                        tensors[f"{name}.{short}.codes.{tname}"] = x.codes.numpy().copy()
                        tensors[f"{name}.{short}.scale.{tname}"] = x.scale.numpy().astype(np.float32).copy()
                        tensors[f"{name}.{short}.qmap.{tname}"] = x.qmap.numpy().astype(np.float32).copy()
                    else:
                        tensors[f"{name}.{short}.{tname}"] = x.numpy().astype(np.float32).copy()
            summary["torchao_state"] = info

        # ----- replays (stdout only)
        kind, hp, steps, store = cfg["kind"], cfg["hp"], cfg["steps"], cfg["store"]
        if kind == "sgd":
            replay_rows += report_replay(f"{name} (replay)", snaps, replay_sgd(scen, hp, steps, store))
        elif kind == "adam":
            for label, sq in (("torch sqrt", sqrt_torch), ("exact sqrt", sqrt_exact)):
                r, ms, vs = replay_adam(scen, hp, steps, store, sq)
                replay_rows += report_replay(f"{name} (replay, {label})", snaps, r)
                if name == "adamw":
                    m_anchor = np.concatenate([tensors[f"adamw.m.{n}"].reshape(-1) for n in NAMES])
                    v_anchor = np.concatenate([tensors[f"adamw.v.{n}"].reshape(-1) for n in NAMES])
                    for sname, a, b in (("m", m_anchor, np.concatenate(ms)), ("v", v_anchor, np.concatenate(vs))):
                        nd, mu, ma = compare(a, b)
                        replay_rows.append(f"{'adamw.' + sname + ' (replay, ' + label + ')':<48} step 100: "
                                           f"{nd:>6} of {len(a)} differ, max {mu:>7} ulp, max |d| {ma:.3e}")
        elif kind == "lion":
            replay_rows += report_replay(f"{name} (replay)", snaps, replay_lion(scen, hp, steps, store))
        elif kind == "bnb8":
            r, st = replay_bnb8(scen, hp, steps, store, sqrt_torch, "bnb")
            replay_rows += report_replay(f"{name} (replay, bnb quant, torch sqrt)", snaps, r)
            same = all(np.array_equal(tensors[f"{name}.{key}.{tname}"].reshape(-1), st[k][short])
                       for k, tname in enumerate(NAMES)
                       for key, short in (("state1", "c1"), ("state2", "c2"), ("absmax1", "a1"), ("absmax2", "a2"),
                                          ("state1", "m"), ("state2", "v"))
                       if short in st[k])
            replay_rows.append(f"{name + ' final state (replay, bnb quant)':<48} step {steps:>3}: bit for bit: {same}")
            r, _ = replay_bnb8(scen, hp, steps, store, sqrt_exact, "exact")
            replay_rows += report_replay(f"{name} (replay, exact quant, exact sqrt)", snaps, r)
            # the states after step 1 are the same f32 values for both quantizers: count the codes
            # on which bnb's CPU quantizer and the exact rule disagree
            _, s_bnb = replay_bnb8(scen, hp, 1, (), sqrt_torch, "bnb")
            _, s_ex = replay_bnb8(scen, hp, 1, (), sqrt_torch, "exact")
            for key, label in (("c1", "m (signed map)"), ("c2", "v (unsigned map)")):
                nd = sum(int((a[key] != b[key]).sum()) for a, b in zip(s_bnb, s_ex) if key in a)
                nt = sum(len(a[key]) for a in s_bnb if key in a)
                replay_rows.append(f"{name + ' step-1 ' + label + ' codes':<48} bnb CPU quantizer vs exact rule: "
                                   f"{nd} of {nt} differ")
        elif kind == "ao4":
            r, st, raw = replay_ao4(scen, hp, steps, store, sqrt_exact)
            replay_rows += report_replay(f"{name} (replay, exact sqrt)", snaps, r)
            same = all(np.array_equal(tensors[f"{name}.{short}.{tname}"].reshape(-1), st[k][short])
                       for k, tname in enumerate(NAMES) for short in ("m", "v"))
            same &= all(np.array_equal(tensors[f"{name}.{key.replace('_', '.')}.{tname}"], raw[k][key])
                        for k, tname in enumerate(NAMES) for key in raw[k])
            replay_rows.append(f"{name + ' final state (replay)':<48} step {steps:>3}: bit for bit: {same}")

    print("\nbitsandbytes AdamW8bit optimizer.state[p] after step 50:")
    for k, v in summary["bnb_state_keys"].items():
        print(f"   {k}: {v}")
    print("\ntorchao AdamW4bit optimizer.state[p] after step 50:")
    for k, v in summary["torchao_state"].items():
        print(f"   {k}: {v}")

    print("\nanchor vs float32 replay of the documented op sequence (all four tensors at each stored step):")
    for row in replay_rows:
        print("  ", row)

    metadata = {
        "generator": "gen_reference_optimizers.py",
        "versions": json.dumps(versions, sort_keys=True),
        "tensors": json.dumps([[n, list(s)] for n, s in TENSORS]),
        "scenario": (
            "mix(z)=splitmix64 finalizer mod 2^64: z=(z^(z>>30))*0xBF58476D1CE4E5B9; z=(z^(z>>27))*0x94D049BB133111EB; "
            "z^(z>>31). h(tid,t,i)=mix(tid*0x9E3779B97F4A7C15 + t*0xD1B54A32D192ED03 + i). "
            "u=f32(h>>40)/f32(2^23)-f32(1). p0[i]=u(tid,0,i)*f32(0.5). "
            "g_t[i]=u(tid,t,i)*(f32(0.01)*f32(1+i%7)), t>=1; all f32 ops. tid = index in 'tensors', i = row-major flat index"
        ),
        "configs": json.dumps({c["name"]: dict(c["hp"], steps=c["steps"], store=list(c["store"]),
                                               intermediate_tensors=snapshot_tensors(c, 1))
                               for c in configs()}, sort_keys=True),
    }
    write_safetensors(OUT, tensors, metadata)
    size = OUT.stat().st_size
    print(f"\nwrote {OUT.name}: {size} bytes, {len(tensors)} tensors")
    assert size < SIZE_LIMIT, f"{OUT.name} is {size} bytes, over the {SIZE_LIMIT} byte budget"


def _dist_version(dist):
    from importlib.metadata import version
    return version(dist)


if __name__ == "__main__":
    main()
