"""Process memory of a real torch training run per optimizer: the character-level GPT of
chargpt.py at a larger size, a few training steps, each arm in a process of its own (this script
runs one arm; `--all` runs every arm as a subprocess and prints the table).

    python bench/memory.py --all --out memory.json

Steady RSS: the process's resident memory after the last step (gradients freed by zero_grad);
peak RSS: its high-water mark (VmHWM), which includes the step's gradients.
"""

import argparse
import json
import os
import subprocess
import sys

import torch

from chargpt import CharGPT, batch, load_text, loss_of

ARMS = [
    "none",
    "torch_adamw",
    "torch_adamw_bf16",
    "bnb_adamw8bit",
    "torchao_adamw8bit",
    "lpmm_adamw8bit",
    "lpmm_adamw8bit_bf16",
    "lpmm_adamw8bit_bf16_release",
    "lpmm_adamw4bit",
    "lpmm_sgdm",
]


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class NoOptimizer:
    """The baseline: the same forward and backward passes, no optimizer step."""

    def __init__(self, params):
        self.params = list(params)

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def optimizer(arm, params):
    if arm == "none":
        return NoOptimizer(params)
    if arm.startswith("torch_adamw"):
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if arm == "bnb_adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-3)
    if arm == "torchao_adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=1e-3)
    import lpmm.torch

    if arm == "lpmm_adamw8bit" or arm == "lpmm_adamw8bit_bf16":
        return lpmm.torch.AdamW8bit(params, lr=1e-3)
    if arm == "lpmm_adamw8bit_bf16_release":
        return lpmm.torch.AdamW8bit(params, lr=1e-3, grad_release=True)
    if arm == "lpmm_adamw4bit":
        return lpmm.torch.AdamW4bit(params, lr=1e-3)
    if arm == "lpmm_sgdm":
        return lpmm.torch.LPMMSGDM(params, lr=0.1)
    raise SystemExit(f"unknown arm {arm}")


def run(arm, a):
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    train, _, vocab = load_text()
    model = CharGPT(vocab, a.block, d=a.d, layers=a.layers, heads=a.d // 64)
    if "bf16" in arm:
        model = model.to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = optimizer(arm, model.parameters())
    gen = torch.Generator().manual_seed(0)
    for _ in range(a.steps):
        x, y = batch(train, a.block, a.batch, gen)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "arm": arm,
        "params": n,
        "model_mb": round(model_bytes / 2**20, 1),
        "steady_rss_mb": round(status("VmRSS") / 2**20, 1),
        "peak_rss_mb": round(status("VmHWM") / 2**20, 1),
        "loss": round(loss_of(model, x, y).item(), 4),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    if not a.all:
        print(json.dumps(run(a.arm, a)))
        return
    rows = []
    here = os.path.dirname(os.path.abspath(__file__))
    forward = [f"--{k}={getattr(a, k)}" for k in ("d", "layers", "block", "batch", "steps", "threads")]
    for arm in ARMS:
        out = subprocess.run(
            [sys.executable, os.path.join(here, "memory.py"), "--arm", arm, *forward],
            capture_output=True,
            text=True,
        )
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        row = json.loads(line[-1]) if line else {"arm": arm, "error": out.stderr[-500:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"torch": torch.__version__, "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
