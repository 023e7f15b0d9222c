"""Helpers of the lpmm.torch tests: small models, bit views, the Rust reference."""

import json
import os
import struct
import subprocess

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))


def bits(t):
    """A tensor's bytes (exact comparison of floats, NaN included)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).clone() if t.dtype != torch.uint8 else t.clone()


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


def mlp(dtype=torch.float32, seed=0, width=96):
    """A small MLP whose weights are above the 4096-element quantization threshold."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, 64), torch.nn.LayerNorm(64)
    )
    return m.to(dtype)


def train(model, opt, steps, seed=0, closure=False, scheduler=None):
    """`steps` steps on fixed random data; returns the losses."""
    gen = torch.Generator().manual_seed(1000 + seed)
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen).to(dtype)
        y = torch.randn(16, 64, generator=gen).to(dtype)

        def loss_fn():
            opt.zero_grad()
            loss = (model(x).float() - y.float()).pow(2).mean()
            loss.backward()
            return loss

        if closure:
            loss = opt.step(loss_fn)
        else:
            loss = loss_fn()
            opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def read_safetensors(path):
    """A safetensors file's tensors as {name: bytes} (the format: an 8-byte header length, a JSON
    header of dtype/shape/offsets, the data)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = data[a:b]
    return out


@pytest.fixture(scope="session")
def reference_binary():
    """The Rust reference (examples/reference.rs): $LPMM_REFERENCE, or built with cargo."""
    path = os.environ.get("LPMM_REFERENCE")
    if path:
        return path
    subprocess.run(
        ["cargo", "build", "--release", "-p", "lpmm-python", "--example", "reference"],
        cwd=REPO,
        check=True,
    )
    return os.path.join(REPO, "target", "release", "examples", "reference")
