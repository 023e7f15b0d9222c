"""Same bits as the Rust crate: the same parameters and gradients stepped through lpmm.torch (torch's
tensors, stepped in place) and through lpmm-optim's Rust API (examples/reference.rs: parameters
held by lpmm, `Optimizer::save`), every bit of every parameter and state compared."""

import json
import os
import subprocess

import pytest
import torch

import lpmm.torch
from conftest import bits, read_safetensors

SHAPES = {"w1": (96, 64), "b1": (96,), "w2": (64, 96), "t3": (3, 5, 300)}

CASES = [
    # (preset, parameter dtype, param_storage, hyperparameters)
    ("adamw_8bit", torch.float32, "auto", {"weight_decay": 0.1, "betas": (0.9, 0.95)}),
    ("adamw_8bit", torch.bfloat16, "auto", {}),  # bf16 with stochastic rounding
    ("adamw_8bit", torch.bfloat16, "bf16_kahan", {}),
    ("adamw_4bit", torch.float32, "auto", {"eps": 1e-6}),
    ("lpmm_sgdm", torch.float32, "preset", {"nesterov": True}),  # 8-bit parameter held by lpmm
    ("lpmm_sgdm", torch.bfloat16, "auto", {"weight_decay": 1e-3}),
    ("lion_8bit", torch.bfloat16, "bf16", {}),
    ("came_8bit", torch.float32, "auto", {}),
    ("adafactor_8bit", torch.float32, "auto", {}),
    ("ademamix_8bit", torch.bfloat16, "split_f32", {}),
    ("schedule_free_adamw_8bit", torch.float32, "auto", {}),
    ("rmsprop_8bit", torch.bfloat16, "bf16_plus8_sr", {"momentum": 0.9}),
    ("adalomo_f32", torch.float32, "auto", {"weight_decay": 0.01}),
]

# Muon steps matrices only (its matrix phase: Newton–Schulz products on lpmm-optim's CPU GEMM).
MATRICES = {"w1": (96, 64), "w2": (64, 96), "s": (48, 48)}

MATRIX_CASES = [
    ("muon_8bit", torch.float32, "auto", {"adjust_lr": "MatchRmsAdamW"}),
    ("muon_8bit", torch.bfloat16, "auto", {}),  # bf16 with stochastic rounding
    ("muon_4bit", torch.float32, "auto", {"nesterov": False, "ns_steps": 3}),
]


@pytest.mark.parametrize("preset,dtype,storage,hyper", CASES, ids=lambda c: str(c).replace("torch.", ""))
def test_same_bits_as_lpmm_optim(preset, dtype, storage, hyper, tmp_path, reference_binary):
    same_bits_as_lpmm_optim(preset, dtype, storage, hyper, SHAPES, tmp_path, reference_binary)


@pytest.mark.parametrize(
    "preset,dtype,storage,hyper", MATRIX_CASES, ids=lambda c: str(c).replace("torch.", "")
)
def test_muon_same_bits_as_lpmm_optim(preset, dtype, storage, hyper, tmp_path, reference_binary):
    same_bits_as_lpmm_optim(preset, dtype, storage, hyper, MATRICES, tmp_path, reference_binary)


def same_bits_as_lpmm_optim(preset, dtype, storage, hyper, shapes, tmp_path, reference_binary):
    torch.manual_seed(3)
    params = {n: torch.nn.Parameter((torch.randn(s) * 0.5).to(dtype)) for n, s in shapes.items()}
    init = {n: p.detach().clone() for n, p in params.items()}
    opt = lpmm.torch.LpmmOptimizer(
        list(params.items()), preset, lr=3e-3, param_storage=storage, seed=11, **hyper
    )
    steps = 4
    gen = torch.Generator().manual_seed(5)
    files = {n: [] for n in params}
    for step in range(steps):
        for n, p in params.items():
            g = (torch.randn(p.shape, generator=gen) * 0.05).to(dtype)
            p.grad = g
            path = tmp_path / f"{n}.grad{step}"
            path.write_bytes(bytes(bits(g).tolist()))
            files[n].append(str(path))
        opt.step()
        assert not opt.last_report["skipped"]
    sd = opt.state_dict()
    spec_params = []
    entries = {}
    for k, (n, p) in enumerate(params.items()):
        entry = sd["state"][k]
        meta = json.loads(bytes(entry["lpmm"].tolist()))
        entries[n] = (entry, meta)
        init_path = tmp_path / f"{n}.init"
        init_path.write_bytes(bytes(bits(init[n]).tolist()))
        spec_params.append(
            {
                "name": n,
                "shape": list(p.shape),
                "config": meta["requested"],
                "init": str(init_path),
                "grads": files[n],
                "dtype": "bf16" if dtype == torch.bfloat16 else "f32",
            }
        )
    options = entries["w1"][1]["options"]
    assert options["seed"] == 11
    ckpt = tmp_path / "reference.safetensors"
    spec = {"options": options, "steps": steps, "checkpoint": str(ckpt), "params": spec_params}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([reference_binary, str(tmp_path / "spec.json")], check=True)
    ref = read_safetensors(ckpt)
    info = {i["name"]: i for i in opt.param_info()}
    compared = 0
    for n, p in params.items():
        entry, meta = entries[n]
        # The hyperparameters lpmm used are the param group's (here the constructor's).
        rule = next(iter(meta["requested"]["hyper"].values()))
        for key, value in hyper.items():
            assert rule[key] == (list(value) if isinstance(value, tuple) else value), key
        mine = {k: bytes(v.tolist()) for k, v in entry.items() if k not in ("step", "lpmm")}
        if info[n]["lent"]:
            mine["param"] = bytes(bits(p).tolist())  # the tensor is the parameter
        theirs = {name.split("/", 1)[1]: b for name, b in ref.items() if name.startswith(n + "/")}
        assert sorted(mine) == sorted(theirs), n
        for key in theirs:
            assert mine[key] == theirs[key], f"{preset} {n} {key}: bits differ"
            compared += 1
        if not info[n]["lent"]:
            # A parameter lpmm holds is written into the tensor after every step: the tensor holds
            # its value (decoded to the tensor's dtype).
            assert p.dtype == torch.float32
    assert compared >= 2 * len(params)
