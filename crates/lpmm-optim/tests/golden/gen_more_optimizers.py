#!/usr/bin/env python3
"""Generate more_optimizers.safetensors: golden trajectories of four more optimizers for lpmm-optim.

Anchors, all run on the CPU in float32 with one torch thread:
  transformers  Adafactor         (transformers/optimization.py)
  came-pytorch  CAME              (came_pytorch/CAME.py, the CAME authors' package)
  bitsandbytes  AdEMAMix, 32-bit  (bitsandbytes/optim/ademamix.py -> backends/cpu/ops.py)
  schedulefree  AdamWScheduleFree (schedulefree/adamw_schedulefree.py)
See README.md beside this file ("## more_optimizers.safetensors") for the pinned environment, the
command line, the op sequence each anchor runs and the findings.

The scenario is the one of gen_reference_optimizers.py (imported from it, and checked bit for bit
against init.* / grad1.* of optim_trajectories.safetensors when that file is present):
  tensors, tensor id = index:  0 "w1" [64, 80], 1 "w2" [4396], 2 "b" [33], 3 "w3" [96, 128];
  i = row-major flat index.
  mix(z)      = splitmix64 finalizer (all mod 2^64):
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9; z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
                z = z ^ (z >> 31)
  h(tid,t,i)  = mix(tid * 0x9E3779B97F4A7C15 + t * 0xD1B54A32D192ED03 + i)
  u(tid,t,i)  = f32(h >> 40) / f32(2^23) - f32(1)        (in [-1, 1), every step exact in f32)
  p0[i]       = u(tid, 0, i) * f32(0.5)
  g_t[i]      = u(tid, t, i) * (f32(0.01) * f32(1 + i % 7))   for t = 1, 2, ...  (f32 products)
Gradients do not depend on the parameters.  Every configuration starts from p0 and runs 100 steps.

What is stored (little-endian safetensors, all F32, sorted by name):
  init.{name}, grad1.{name}          p0 and g_1
  {cfg}.step{k}.{name}               parameters after step k (k = 1, 10, 100; see snapshot_tensors())
  {cfg}.{state}.{name}               optimizer state after step 100 (names: STATE_NOTE below)
  schedulefree.x.{name}              eval-mode parameters x after step 100 (opt.eval(); p; opt.train())

The script also replays every anchor with a numpy float32 re-implementation of the op sequence
written down in README.md and prints how far each anchor is from it (stdout only).
"""

import json
import math
import sys
from importlib.metadata import version as dist_version
from pathlib import Path

import numpy as np
import torch
import safetensors
import transformers
import bitsandbytes
import bitsandbytes as bnb
import schedulefree
from transformers.optimization import Adafactor
from came_pytorch import CAME

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.dont_write_bytecode = True  # no __pycache__ beside the golden files
from gen_reference_optimizers import (TENSORS, NAMES, init_param, gradient,  # noqa: E402
                                      fma, write_safetensors)

OUT = HERE / "more_optimizers.safetensors"
SIBLING = HERE / "optim_trajectories.safetensors"
SIZE_LIMIT = 3_000_000  # bytes

STEPS = 100
STORE = (1, 10, 100)

f32 = np.float32
f64 = np.float64


# --------------------------------------------------------------------------- scenario
# (TENSORS, NAMES, init_param and gradient come from gen_reference_optimizers.py; the run checks
# them against optim_trajectories.safetensors)


class Scenario:
    """p0 and cached gradients, as arrays of the parameter's shape (f32)."""

    def __init__(self, max_step, tensors=TENSORS, first_tid=0):
        self.tensors = tensors
        self.p0 = [init_param(first_tid + k, math.prod(s)).reshape(s) for k, (_, s) in enumerate(tensors)]
        self.grads = {t: [gradient(first_tid + k, t, math.prod(s)).reshape(s) for k, (_, s) in enumerate(tensors)]
                      for t in range(1, max_step + 1)}

    def grad(self, t):
        return self.grads[t]


# --------------------------------------------------------------------------- configurations

ADAFACTOR_DEFAULTS = dict(lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                          weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False)
CAME_HP = dict(lr=2e-4, eps=(1e-30, 1e-16), clip_threshold=1.0, betas=(0.9, 0.999, 0.9999), weight_decay=0.01)
ADEMAMIX_HP = dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=0.01, optim_bits=32)
SF_HP = dict(lr=2.5e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, warmup_steps=10, r=0.0,
             weight_lr_power=2.0)  # foreach: the package default (True) is used


def configs():
    out = []
    for name, extra in (("adafactor_default", {}),
                        ("adafactor_warmup", dict(warmup_init=True)),
                        ("adafactor_beta1_wd", dict(lr=1e-3, relative_step=False, scale_parameter=False,
                                                    beta1=0.9, weight_decay=0.01, warmup_init=False))):
        hp = dict(ADAFACTOR_DEFAULTS, **extra)
        out.append(dict(name=name, kind="adafactor", hp=hp, make=lambda ps, hp=hp: Adafactor(ps, **hp)))
    out.append(dict(name="came", kind="came", hp=CAME_HP, make=lambda ps: CAME(ps, **CAME_HP)))
    for name, extra in (("ademamix", {}), ("ademamix_sched", dict(t_alpha=50, t_beta3=50))):
        hp = dict(dict(ADEMAMIX_HP, t_alpha=None, t_beta3=None), **extra)
        out.append(dict(name=name, kind="ademamix", hp=hp,
                        make=lambda ps, hp=hp: bnb.optim.AdEMAMix(ps, **hp)))
    out.append(dict(name="schedulefree", kind="schedulefree", hp=SF_HP,
                    make=lambda ps: schedulefree.AdamWScheduleFree(ps, **SF_HP)))
    return out


STATE_NOTE = {
    "adafactor": "exp_avg_sq_row/exp_avg_sq_col (2-D), exp_avg_sq (1-D), exp_avg (beta1 set)",
    "came": "exp_avg; exp_avg_sq_row/exp_avg_sq_col/exp_avg_res_row/exp_avg_res_col (2-D) or exp_avg_sq (1-D)",
    "ademamix": "m1 (= state1[0]), m2 (= state1[1]), nu (= state2)",
    "schedulefree": "z, exp_avg_sq; x = eval-mode parameters",
}


def snapshot_tensors(step, full):
    """Tensors stored after `step`: all four at the last step; at steps 1 and 10 all four if the
    file fits SIZE_LIMIT that way, else w2, b and w1 (the brief's fallback)."""
    if step == STEPS or full:
        return NAMES
    return ["w1", "w2", "b"]


# --------------------------------------------------------------------------- anchor runs


def state_tensors(kind, opt, params):
    """{state name: [f32 array or None per tensor]} after the run."""
    out = {}
    for k, p in enumerate(params):
        s = opt.state[p]
        if kind in ("adafactor", "came"):
            items = {key: s[key] for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col",
                                              "exp_avg_res_row", "exp_avg_res_col") if key in s}
        elif kind == "ademamix":
            items = dict(m1=s["state1"][0], m2=s["state1"][1], nu=s["state2"])
        elif kind == "schedulefree":
            items = dict(z=s["z"], exp_avg_sq=s["exp_avg_sq"])
        for key, v in items.items():
            assert v.dtype == torch.float32, (kind, key, v.dtype)
            out.setdefault(key, [None] * len(params))[k] = v.detach().numpy().astype(np.float32).copy()
    return out


def run_anchor(cfg, scen, steps=STEPS, store=STORE):
    """Run one configuration from p0; returns ({step: [params]}, states, extra)."""
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in scen.p0]
    opt = cfg["make"](params)
    extra = {}
    if cfg["kind"] == "schedulefree":
        opt.train()  # required before training (train_mode is False at construction)
    snaps = {}
    for t in range(1, steps + 1):
        for p, g in zip(params, scen.grad(t)):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
        if t in store:
            snaps[t] = [p.detach().numpy().copy() for p in params]
    states = state_tensors(cfg["kind"], opt, params)
    if cfg["kind"] == "schedulefree":
        opt.eval()
        states["x"] = [p.detach().numpy().copy() for p in params]
        opt.train()
        extra["y_after_eval_train"] = [p.detach().numpy().copy() for p in params]
    if cfg["kind"] == "adafactor":
        extra["RMS"] = [float(opt.state[p]["RMS"]) for p in params]
    extra["opt"] = opt
    return snaps, states, extra


# --------------------------------------------------------------------------- float32 primitives


def lerp(start, end, weight):
    """torch's f32 lerp_ with a Python-float weight (ATen/native/Lerp.h; the CPU kernel fuses).
    fma() is gen_reference_optimizers.py's correctly rounded f32 a*b + c."""
    w = f32(weight)
    d = (end - start).astype(f32)
    if abs(w) < f32(0.5):
        return fma(w, d, start)
    return fma(w - f32(1), d, end)


class TorchPrims:
    """Reductions and square roots done by torch itself (its summation order, its sqrt)."""
    label = "torch mean/norm/sqrt"

    @staticmethod
    def mean(x, axis, keepdims=False):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=f32)).mean(dim=axis, keepdim=keepdims).numpy()

    @staticmethod
    def norm(x):
        return f32(torch.from_numpy(np.ascontiguousarray(x, dtype=f32)).norm(2).item())

    @staticmethod
    def sqrt(x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=f32)).sqrt().numpy()


class ExactPrims:
    """What a straightforward implementation computes: sums accumulated in f64 and rounded once
    to f32 (mean = f32(sum) / f32(n) in f32, norm = f32(sqrt(f64 sum of squares))), correctly
    rounded f32 sqrt."""
    label = "f64-sum mean/norm, exact sqrt"

    @staticmethod
    def mean(x, axis, keepdims=False):
        s = np.asarray(x, f64).sum(axis=axis, keepdims=keepdims).astype(f32)
        return (s / f32(np.asarray(x).shape[axis])).astype(f32)

    @staticmethod
    def norm(x):
        return f32(math.sqrt(float((np.asarray(x, f64) ** 2).sum())))

    @staticmethod
    def sqrt(x):
        return np.sqrt(np.asarray(x, f32))


def rsqrt(x):
    """torch's f32 rsqrt on the CPU = 1 / correctly rounded sqrt, two roundings (checked on 10^6
    inputs, vector body and scalar tail)."""
    return (f32(1) / np.sqrt(np.asarray(x, f32))).astype(f32)


def rms(x, prims):
    """tensor.norm(2) / (tensor.numel() ** 0.5): 0-dim f32 tensor / Python float -> f32 division."""
    return f32(prims.norm(x) / f32(x.size ** 0.5))


def approx_sq_grad(row, col, prims):
    """_approx_sq_grad of Adafactor and CAME: rsqrt(row / mean(row, -1)) [..., :, None] * rsqrt(col) [..., None, :]."""
    r = rsqrt(row / prims.mean(row, -1, keepdims=True))
    c = rsqrt(col)
    return (r[..., :, None] * c[..., None, :]).astype(f32)


# --------------------------------------------------------------------------- replays


def replay_adafactor(scen, hp, prims, steps=STEPS, store=STORE):
    eps1, eps2 = hp["eps"]
    b1, wd, clip, decay = hp["beta1"], hp["weight_decay"], hp["clip_threshold"], hp["decay_rate"]
    ps = [p.copy() for p in scen.p0]
    st = []
    for p in ps:
        s = {}
        if b1 is not None:
            s["exp_avg"] = np.zeros_like(p)
        if p.ndim >= 2:
            s["exp_avg_sq_row"] = np.zeros(p.shape[:-1], f32)
            s["exp_avg_sq_col"] = np.zeros(p.shape[:-2] + p.shape[-1:], f32)
        else:
            s["exp_avg_sq"] = np.zeros_like(p)
        st.append(s)
    snaps = {}
    for t in range(1, steps + 1):
        beta2t = 1.0 - math.pow(t, decay)                          # double; 0.0 at t = 1
        for k, g in enumerate(scen.grad(t)):
            p, s = ps[k], st[k]
            # learning rate (_get_lr): lr is an f32 0-dim tensor when scale_parameter and RMS > eps2
            rel = hp["lr"]
            if hp["relative_step"]:
                min_step = 1e-6 * t if hp["warmup_init"] else 1e-2
                rel = min(min_step, 1.0 / math.sqrt(t))
            lr_is_f32 = False
            lr = rel
            if hp["scale_parameter"]:
                rms_p = rms(p, prims)                               # RMS of p before the update
                if rms_p > eps2:                                    # max(eps2, RMS) returns the tensor
                    lr, lr_is_f32 = f32(rms_p * f32(rel)), True
                else:
                    lr = eps2 * rel
            upd = (g * g + f32(eps1)).astype(f32)                   # grad**2 + eps1
            if p.ndim >= 2:
                s["exp_avg_sq_row"] = fma(prims.mean(upd, -1), f32(1.0 - beta2t), s["exp_avg_sq_row"] * f32(beta2t))
                s["exp_avg_sq_col"] = fma(prims.mean(upd, -2), f32(1.0 - beta2t), s["exp_avg_sq_col"] * f32(beta2t))
                u = (approx_sq_grad(s["exp_avg_sq_row"], s["exp_avg_sq_col"], prims) * g).astype(f32)
            else:
                s["exp_avg_sq"] = fma(upd, f32(1.0 - beta2t), s["exp_avg_sq"] * f32(beta2t))
                u = (rsqrt(s["exp_avg_sq"]) * g).astype(f32)
            u = (u / max(f32(rms(u, prims) / f32(clip)), f32(1.0))).astype(f32)
            u = (u * f32(lr)).astype(f32)
            if b1 is not None:
                s["exp_avg"] = fma(u, f32(1 - b1), s["exp_avg"] * f32(b1))
                u = s["exp_avg"]
            if wd != 0:
                alpha = f32(f32(-wd) * lr) if lr_is_f32 else f32(-wd * lr)
                p = fma(p, alpha, p)                                 # p.add_(p, alpha=-wd*lr)
            ps[k] = (p - u).astype(f32)                              # p.add_(-update)
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps, st


def replay_came(scen, hp, prims, steps=STEPS, store=STORE):
    eps1, eps2 = hp["eps"]
    b1, b2, b3 = hp["betas"]
    lr, wd, clip = hp["lr"], hp["weight_decay"], hp["clip_threshold"]
    ps = [p.copy() for p in scen.p0]
    st = []
    for p in ps:
        s = dict(exp_avg=np.zeros_like(p))
        if p.ndim >= 2:
            for key in ("exp_avg_sq", "exp_avg_res"):
                s[key + "_row"] = np.zeros(p.shape[:-1], f32)
                s[key + "_col"] = np.zeros(p.shape[:-2] + p.shape[-1:], f32)
        else:
            s["exp_avg_sq"] = np.zeros_like(p)
        st.append(s)
    snaps = {}
    for t in range(1, steps + 1):
        for k, g in enumerate(scen.grad(t)):
            p, s = ps[k], st[k]
            upd = (g * g + f32(eps1)).astype(f32)
            if p.ndim >= 2:
                s["exp_avg_sq_row"] = fma(prims.mean(upd, -1), f32(1.0 - b2), s["exp_avg_sq_row"] * f32(b2))
                s["exp_avg_sq_col"] = fma(prims.mean(upd, -2), f32(1.0 - b2), s["exp_avg_sq_col"] * f32(b2))
                u = (approx_sq_grad(s["exp_avg_sq_row"], s["exp_avg_sq_col"], prims) * g).astype(f32)
            else:
                s["exp_avg_sq"] = fma(upd, f32(1.0 - b2), s["exp_avg_sq"] * f32(b2))
                u = (rsqrt(s["exp_avg_sq"]) * g).astype(f32)
            u = (u / max(f32(rms(u, prims) / f32(clip)), f32(1.0))).astype(f32)
            s["exp_avg"] = m = fma(u, f32(1 - b1), s["exp_avg"] * f32(b1))
            res = ((u - m) * (u - m) + f32(eps2)).astype(f32)        # (update - exp_avg)**2 + eps2
            if p.ndim >= 2:
                s["exp_avg_res_row"] = fma(prims.mean(res, -1), f32(1.0 - b3), s["exp_avg_res_row"] * f32(b3))
                s["exp_avg_res_col"] = fma(prims.mean(res, -2), f32(1.0 - b3), s["exp_avg_res_col"] * f32(b3))
                u = (approx_sq_grad(s["exp_avg_res_row"], s["exp_avg_res_col"], prims) * m).astype(f32)
            else:
                u = m.copy()
            if wd != 0:
                p = fma(p, f32(-wd * lr), p)                         # p.add_(p, alpha=-wd*lr)
            ps[k] = (p - (u * f32(lr)).astype(f32)).astype(f32)      # update.mul_(lr); p.add_(-update)
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps, st


def ademamix_schedules(hp, t):
    """(alpha_t, beta3_t) as bitsandbytes computes them (doubles; ademamix.py:199-214)."""
    b1, _, b3 = hp["betas"]
    alpha, t_alpha, t_beta3 = hp["alpha"], hp["t_alpha"], hp["t_beta3"]
    alpha_t = min(t * alpha / t_alpha, alpha) if t_alpha else alpha
    if t_beta3:
        ln_b1, ln_b3 = math.log(b1), math.log(b3)
        s = t / t_beta3
        beta3_t = min(math.exp((ln_b1 * ln_b3) / (((1 - s) * ln_b3) + (s * ln_b1))), b3)
    else:
        beta3_t = b3
    return alpha_t, beta3_t


def replay_ademamix(scen, hp, prims, steps=STEPS, store=STORE):
    lr, (b1, b2, _), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    ps = [p.copy() for p in scen.p0]
    st = [dict(m1=np.zeros_like(p), m2=np.zeros_like(p), nu=np.zeros_like(p)) for p in ps]
    snaps = {}
    for t in range(1, steps + 1):
        alpha_t, beta3_t = ademamix_schedules(hp, t)
        c1 = 1.0 - b1**t                                             # doubles (cpu/ops.py:395-396)
        c2 = math.sqrt(1.0 - b2**t)
        for k, g in enumerate(scen.grad(t)):
            s, p = st[k], ps[k]
            s["m1"] = fma(g, f32(1.0 - b1), s["m1"] * f32(b1))       # mul_(b1).add_(g, alpha=1-b1)
            s["m2"] = fma(g, f32(1.0 - beta3_t), s["m2"] * f32(beta3_t))
            s["nu"] = fma(f32(1.0 - b2) * g, g, s["nu"] * f32(b2))   # mul_(b2).addcmul_(g, g, value=1-b2)
            if wd > 0.0:
                p = (p * f32(1.0 - lr * wd)).astype(f32)             # decay first (cpu/ops.py:398-399)
            mixed = (s["m1"] / f32(c1) + f32(alpha_t) * s["m2"]).astype(f32)
            adaptive = (prims.sqrt(s["nu"]) / f32(c2) + f32(eps)).astype(f32)
            ps[k] = fma((mixed / adaptive).astype(f32), f32(-lr), p)  # p.add_(mixed/adaptive, alpha=-lr)
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps, st


def replay_reference_ademamix(scen, hp, prims, steps=STEPS, store=STORE, compound=False):
    """bitsandbytes' own _ReferenceAdEMAMix (ademamix.py:11-104), for comparison only: decay
    enters the update as +wd*p after the adaptive division, p -= lr*(update + wd*p).
    compound=True reproduces its schedule bug: ademamix.py:76-87 reassign `alpha` and `beta3`
    inside the loop over the parameters, so each parameter's schedule starts from the previous
    parameter's scheduled values."""
    lr, (b1, b2, _), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    ps = [p.copy() for p in scen.p0]
    st = [dict(m1=np.zeros_like(p), m2=np.zeros_like(p), nu=np.zeros_like(p)) for p in ps]
    snaps = {}
    for t in range(1, steps + 1):
        alpha_t, beta3_t = ademamix_schedules(hp, t)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        cur = dict(hp)
        for k, g in enumerate(scen.grad(t)):
            if compound:
                alpha_t, beta3_t = ademamix_schedules(cur, t)
                cur["alpha"], cur["betas"] = alpha_t, (b1, b2, beta3_t)
            s, p = st[k], ps[k]
            s["m1"] = fma(g, f32(1 - b1), s["m1"] * f32(b1))
            s["m2"] = fma(g, f32(1 - beta3_t), s["m2"] * f32(beta3_t))
            s["nu"] = fma(f32(1 - b2) * g, g, s["nu"] * f32(b2))
            denom = (prims.sqrt(s["nu"]) / f32(bc2**0.5) + f32(eps)).astype(f32)
            u = ((s["m1"] / f32(bc1) + f32(alpha_t) * s["m2"]) / denom).astype(f32)
            u = fma(p, f32(wd), u)                                   # update.add_(p, alpha=wd)
            ps[k] = (p + f32(-lr) * u).astype(f32)                   # p.add_(-lr * update)
        if t in store:
            snaps[t] = [p.copy() for p in ps]
    return snaps, st


def replay_schedulefree(scen, hp, prims, steps=STEPS, store=STORE):
    lr0, (b1, b2), eps, decay = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    warmup, r, wlp = hp["warmup_steps"], hp["r"], hp["weight_lr_power"]
    ys = [p.copy() for p in scen.p0]
    st = [dict(z=p.copy(), exp_avg_sq=np.zeros_like(p)) for p in ys]   # z = clone(p) at the first step
    weight_sum, lr_max = 0.0, -1.0
    snaps = {}
    for t in range(1, steps + 1):
        k = t - 1                                                      # group['k'] before the step
        sched = (k + 1) / warmup if k < warmup else 1.0
        bc2 = 1 - b2 ** (k + 1)
        lr = lr0 * sched
        lr_max = max(lr, lr_max)
        weight = ((k + 1) ** r) * (lr_max ** wlp)
        weight_sum = weight_sum + weight
        ckp1 = weight / weight_sum
        for j, g in enumerate(scen.grad(t)):
            s, y = st[j], ys[j]
            s["exp_avg_sq"] = v = fma(f32(1 - b2) * g, g, s["exp_avg_sq"] * f32(b2))
            denom = (prims.sqrt((v / f32(bc2)).astype(f32)) + f32(eps)).astype(f32)
            gn = (g / denom).astype(f32)                               # grad.div_(denom): p.grad is overwritten
            if decay != 0:
                gn = fma(y, f32(decay), gn)                            # add_(y, alpha=decay)
            y = lerp(y, s["z"], ckp1)                                  # y.lerp_(z, ckp1)
            ys[j] = fma(gn, f32(lr * (b1 * (1 - ckp1) - 1)), y)        # y.add_(gn, alpha=lr*(b1*(1-ckp1)-1))
            s["z"] = fma(gn, f32(-lr), s["z"])                         # z.sub_(gn, alpha=lr)
        if t in store:
            snaps[t] = [p.copy() for p in ys]
    st_x = [lerp(y, s["z"], 1 - 1 / b1) for y, s in zip(ys, st)]      # eval(): p.lerp_(z, 1 - 1/b1)
    for s, x in zip(st, st_x):
        s["x"] = x
        s["y_after_eval_train"] = lerp(x, s["z"], 1 - b1)             # train(): p.lerp_(z, 1 - b1)
    return snaps, st


REPLAYS = dict(adafactor=replay_adafactor, came=replay_came, ademamix=replay_ademamix,
               schedulefree=replay_schedulefree)


# --------------------------------------------------------------------------- comparison


def ordered(x):
    """f32 -> integers ordered like the floats (adjacent floats differ by 1)."""
    i = np.asarray(x, f32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def diff_row(label, pairs):
    """One line: elements that differ, max ulp, max |d|, max relative |d| / max(|a|, 1e-30)."""
    n_diff = n_tot = max_ulp = 0
    max_abs = max_rel = 0.0
    for a, b in pairs:
        a, b = np.asarray(a, f32).reshape(-1), np.asarray(b, f32).reshape(-1)
        d = np.abs(ordered(a) - ordered(b))
        ad = np.abs(a.astype(f64) - b.astype(f64))
        n_diff += int((d != 0).sum())
        n_tot += a.size
        max_ulp = max(max_ulp, int(d.max()))
        max_abs = max(max_abs, float(ad.max()))
        max_rel = max(max_rel, float((ad / np.maximum(np.abs(a.astype(f64)), 1e-30)).max()))
    return (f"{label:<58} {n_diff:>6} of {n_tot:>5} differ, max {max_ulp:>7} ulp, "
            f"max |d| {max_abs:.3e}, max rel {max_rel:.3e}")


def compare_run(name, label, snaps, states, r_snaps, r_states):
    rows = []
    for t in sorted(snaps):
        rows.append(diff_row(f"{name} ({label}) step {t:>3}", zip(snaps[t], r_snaps[t])))
    for key in sorted(states):
        pairs = [(a, r[key]) for a, r in zip(states[key], r_states) if a is not None]
        rows.append(diff_row(f"{name} ({label}) {key}", pairs))
    return rows


# --------------------------------------------------------------------------- side checks (stdout)


def check_3d(rows):
    """Adafactor and CAME on a 3-D [3, 8, 10] and a 4-D [2, 3, 4, 5] tensor (tids 4, 5; not stored):
    the replays' factoring rule (row = mean over the last dim, col = mean over dim -2, leading dims
    are batch) must reproduce the anchors."""
    tensors = [("t3", (3, 8, 10)), ("t4", (2, 3, 4, 5))]
    scen = Scenario(10, tensors, first_tid=4)
    for kind, hp, make in (("adafactor", ADAFACTOR_DEFAULTS, lambda ps: Adafactor(ps, **ADAFACTOR_DEFAULTS)),
                           ("came", CAME_HP, lambda ps: CAME(ps, **CAME_HP))):
        snaps, states, _ = run_anchor(dict(kind=kind, make=make), scen, steps=10, store=(1, 10))
        r_snaps, r_states = REPLAYS[kind](scen, hp, TorchPrims, steps=10, store=(1, 10))
        shapes = {k: [None if a is None else list(a.shape) for a in v] for k, v in sorted(states.items())}
        rows.append(f"{kind} state shapes for [3, 8, 10], [2, 3, 4, 5]: {json.dumps(shapes)}")
        rows += compare_run(f"{kind} 3-D/4-D", "replay, torch prims", snaps, states, r_snaps, r_states)


def try_ademamix8bit(scen, ref_snaps):
    """AdEMAMix8bit on the CPU: does it run, and how far is it from the 32-bit run (not stored)."""
    try:
        params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in scen.p0]
        hp = {k: v for k, v in ADEMAMIX_HP.items() if k != "optim_bits"}
        opt = bnb.optim.AdEMAMix8bit(params, **hp)
        for t in range(1, 11):
            for p, g in zip(params, scen.grad(t)):
                p.grad = torch.from_numpy(g.copy())
            opt.step()
        keys = {n: sorted(f"{k}:{str(v.dtype).replace('torch.', '')}{list(v.shape)}" for k, v in opt.state[p].items()
                          if torch.is_tensor(v)) for n, p in zip(NAMES, params)}
        d = max(float(np.abs(p.detach().numpy() - r).max()) for p, r in zip(params, ref_snaps[10]))
        return f"runs; 10 steps; max |p_8bit - p_32bit| at step 10 = {d:.3e}; state: {json.dumps(keys)}"
    except Exception as e:  # noqa: BLE001 - report whatever happens
        return f"fails: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------- output


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)  # nothing here is random; set anyway
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "came-pytorch": dist_version("came-pytorch"),
        "schedulefree": dist_version("schedulefree"),
        "bitsandbytes": bitsandbytes.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }
    print("versions:", json.dumps(versions))

    scen = Scenario(STEPS)
    tensors = {}
    for k, name in enumerate(NAMES):
        tensors[f"init.{name}"] = scen.p0[k].copy()
        tensors[f"grad1.{name}"] = scen.grad(1)[k].copy()
    if SIBLING.exists():
        from safetensors.numpy import load_file
        sib = load_file(str(SIBLING))
        same = all(np.array_equal(tensors[k].view(np.uint32), sib[k].view(np.uint32))
                   for k in tensors)
        print(f"init.* / grad1.* equal those of {SIBLING.name} bit for bit: {same}")
        assert same

    rows, notes = [], []
    snapshots, cfg_meta = {}, {}
    for cfg in configs():
        name, kind, hp = cfg["name"], cfg["kind"], cfg["hp"]
        snaps, states, extra = run_anchor(cfg, scen)
        snapshots[name] = snaps
        for key, arrs in states.items():
            for a, tname in zip(arrs, NAMES):
                if a is not None:
                    tensors[f"{name}.{key}.{tname}"] = a
        cfg_meta[name] = dict({k: v for k, v in hp.items()}, anchor=kind, steps=STEPS, store=list(STORE),
                              states=sorted(states))
        if kind == "adafactor":
            notes.append(f"{name}: RMS(p) before step 100 per tensor: "
                         + ", ".join(f"{n}={v:.6f}" for n, v in zip(NAMES, extra["RMS"])))
        if kind == "schedulefree":
            nd = sum(int((a != b).sum()) for a, b in zip(extra["y_after_eval_train"], snaps[STEPS]))
            notes.append(f"{name}: eval() then train() changes y: {nd} of 21837 elements differ from y before eval()")

        for prims in (TorchPrims, ExactPrims):
            r_snaps, r_states = REPLAYS[kind](scen, hp, prims)
            rows += compare_run(name, "replay, " + prims.label, snaps, states, r_snaps, r_states)
            if kind == "schedulefree":
                rows.append(diff_row(f"{name} (replay, {prims.label}) y after eval()+train()",
                                     zip(extra["y_after_eval_train"], [s["y_after_eval_train"] for s in r_states])))
        if kind == "ademamix":
            r_snaps, _ = replay_reference_ademamix(scen, hp, TorchPrims)
            rows.append(diff_row(f"{name}: bnb _ReferenceAdEMAMix replay vs bnb CPU, step 100",
                                 zip(snaps[STEPS], r_snaps[STEPS])))
            ref = bnb.optim.ademamix._ReferenceAdEMAMix
            r_hp = {k: v for k, v in hp.items() if k != "optim_bits"}
            params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in scen.p0]
            ropt = ref(params, **r_hp)
            for t in range(1, STEPS + 1):
                for p, g in zip(params, scen.grad(t)):
                    p.grad = torch.from_numpy(g.copy())
                ropt.step()
            rows.append(diff_row(f"{name}: bnb _ReferenceAdEMAMix (run) vs bnb CPU, step 100",
                                 zip(snaps[STEPS], [p.detach().numpy() for p in params])))
            rows.append(diff_row(f"{name}: bnb _ReferenceAdEMAMix (run) vs its replay, step 100",
                                 zip([p.detach().numpy() for p in params], r_snaps[STEPS])))
            if hp["t_alpha"] or hp["t_beta3"]:
                c_snaps, _ = replay_reference_ademamix(scen, hp, TorchPrims, compound=True)
                rows.append(diff_row(f"{name}: bnb _ReferenceAdEMAMix (run) vs its replay with the "
                                     "compounding schedule, step 100",
                                     zip([p.detach().numpy() for p in params], c_snaps[STEPS])))
        if name == "schedulefree":
            # the package default foreach=True vs the per-tensor loop
            hp_nf = dict(SF_HP)
            sn2, st2, _ = run_anchor(dict(kind="schedulefree",
                                          make=lambda ps: schedulefree.AdamWScheduleFree(ps, foreach=False, **hp_nf)),
                                     scen)
            rows.append(diff_row(f"{name}: foreach=False vs foreach=True (default), step 100",
                                 zip(snaps[STEPS], sn2[STEPS])))

    check_3d(rows)
    notes.append("AdEMAMix8bit on the CPU: " + try_ademamix8bit(scen, snapshots["ademamix"]))

    # ----- what goes into the file
    full = True
    for attempt in (True, False):
        full = attempt
        trial = dict(tensors)
        for name, snaps in snapshots.items():
            for t, arrs in snaps.items():
                for a, tname in zip(arrs, NAMES):
                    if tname in snapshot_tensors(t, full):
                        trial[f"{name}.step{t}.{tname}"] = a
        size = 8 + sum(a.nbytes for a in trial.values()) + 200 * len(trial) + 6000  # header estimate
        if size < SIZE_LIMIT:
            break
    tensors = trial
    for name in cfg_meta:
        cfg_meta[name]["intermediate_tensors"] = snapshot_tensors(1, full)

    print("\nanchor vs float32 replay of the documented op sequence (all four tensors per row):")
    for row in rows:
        print("  ", row)
    print()
    for n in notes:
        print(n)

    metadata = {
        "generator": "gen_more_optimizers.py",
        "versions": json.dumps(versions, sort_keys=True),
        "tensors": json.dumps([[n, list(s)] for n, s in TENSORS]),
        "scenario": (
            "mix(z)=splitmix64 finalizer mod 2^64: z=(z^(z>>30))*0xBF58476D1CE4E5B9; z=(z^(z>>27))*0x94D049BB133111EB; "
            "z^(z>>31). h(tid,t,i)=mix(tid*0x9E3779B97F4A7C15 + t*0xD1B54A32D192ED03 + i). "
            "u=f32(h>>40)/f32(2^23)-f32(1). p0[i]=u(tid,0,i)*f32(0.5). "
            "g_t[i]=u(tid,t,i)*(f32(0.01)*f32(1+i%7)), t>=1; all f32 ops. tid = index in 'tensors', i = row-major flat index"
        ),
        "configs": json.dumps(cfg_meta, sort_keys=True),
        "states": json.dumps(STATE_NOTE, sort_keys=True),
    }
    write_safetensors(OUT, tensors, metadata)
    size = OUT.stat().st_size
    print(f"\nwrote {OUT.name}: {size} bytes, {len(tensors)} tensors "
          f"(steps 1 and 10 hold {', '.join(snapshot_tensors(1, full))})")
    assert size < SIZE_LIMIT, f"{OUT.name} is {size} bytes, over the {SIZE_LIMIT} byte budget"


if __name__ == "__main__":
    main()
