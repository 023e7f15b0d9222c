"""Time of one optimizer step per parameter on the CPU: lpmm.torch's optimizers beside torch's fused
AdamW, bitsandbytes' AdamW8bit and torchao's AdamW8bit, in one process, the same tensors' sizes and
thread count for all (one tensor of N parameters with a gradient, as a model's largest weight).

    python bench/step_time.py --sizes 1048576,16777216,67108864 --threads 2 --out step_time.json

Each case: one warm-up step, then steps until `--seconds` have passed (at least `--min-steps`);
the median per step divided by N. A benchmark, never a test: the figures are reported, not checked.
"""

import argparse
import gc
import json
import statistics
import time

import torch


def make(arm, n):
    """The arm's parameter, gradient and optimizer for `n` parameters."""
    dtype = torch.bfloat16 if arm.endswith("_bf16") else torch.float32
    p = torch.nn.Parameter((torch.randn(n) * 0.1).to(dtype).reshape(n // 1024, 1024))
    p.grad = (torch.randn(n) * 1e-3).to(dtype).reshape(p.shape)
    if arm.startswith("torch_fused_adamw"):
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    elif arm.startswith("bnb_adamw8bit"):
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit([p], lr=1e-3)
    elif arm.startswith("torchao_adamw8bit"):
        from torchao.optim import AdamW8bit

        opt = AdamW8bit([p], lr=1e-3)
    else:
        import lpmm.torch

        if arm == "lpmm_adamw8bit_skip_elements":  # without the non-finite pre-pass
            return p, lpmm.torch.AdamW8bit([p], lr=1e-3, non_finite="skip_elements")
        cls = {
            "lpmm_adamw8bit": lpmm.torch.AdamW8bit,
            "lpmm_adamw4bit": lpmm.torch.AdamW4bit,
            "lpmm_lion8bit": lpmm.torch.Lion8bit,
            "lpmm_sgdm": lpmm.torch.LPMMSGDM,
        }[arm.removesuffix("_bf16")]
        opt = cls([p], lr=1e-3)
    return p, opt


def state_kind(opt, p):
    """What the optimizer holds for `p` (checks that the peers really keep 8-bit states)."""
    state = opt.state.get(p, {})
    return {k: f"{type(v).__name__}:{getattr(v, 'dtype', '')}" for k, v in state.items() if hasattr(v, "dtype")}


def bench(arm, n, seconds, min_steps):
    p, opt = make(arm, n)
    opt.step()
    kind = state_kind(opt, p)
    times = []
    start = time.perf_counter()
    while len(times) < min_steps or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    del opt, p
    gc.collect()
    return statistics.median(times), len(times), kind


ARMS = [
    "torch_fused_adamw_f32",
    "torch_fused_adamw_bf16",
    "bnb_adamw8bit_f32",
    "bnb_adamw8bit_bf16",
    "torchao_adamw8bit_f32",
    "torchao_adamw8bit_bf16",
    "lpmm_adamw8bit_f32",
    "lpmm_adamw8bit_bf16",
    "lpmm_adamw8bit_skip_elements_f32",
    "lpmm_adamw4bit_f32",
    "lpmm_adamw4bit_bf16",
    "lpmm_lion8bit_f32",
    "lpmm_sgdm_f32",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1048576,16777216,67108864")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--min-steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for n in map(int, a.sizes.split(",")):
        for arm in a.arms.split(","):
            arm_name = arm.removesuffix("_f32")
            try:
                t, steps, kind = bench(arm_name, n, a.seconds, a.min_steps)
            except Exception as e:  # a peer that does not run here is reported, not fatal
                rows.append({"arm": arm, "n": n, "error": f"{type(e).__name__}: {e}"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            rows.append({"arm": arm, "n": n, "ns_per_param": round(t / n * 1e9, 3), "steps": steps, "state": kind})
            print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump({"threads": a.threads, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
