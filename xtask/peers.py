"""CPU optimizer peers for `cargo xtask bench --peers`: torch fused AdamW (f32) and bitsandbytes
AdamW8bit (bf16 parameters), same sizes and thread count as the Rust cases, JSON out."""
import argparse
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """Records the aten ops that run, to prove which optimizer kernel is used."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def make_torch_fused(n):
    p = torch.randn(n) * 0.1
    p.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    with OpRecorder() as rec:  # confirm the fused CPU kernel is what actually runs
        opt.step()
    if "aten._fused_adamw_.default" not in rec.ops:
        raise RuntimeError(f"fused kernel not used; ops seen: {sorted(rec.ops)}")
    return opt


def make_bnb_8bit(n):
    import bitsandbytes as bnb
    p = torch.randn(n, dtype=torch.bfloat16) * 0.1
    p.grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    opt = bnb.optim.AdamW8bit([p], lr=1e-3)
    opt.step()
    if opt.state[p]["state1"].dtype != torch.uint8:
        raise RuntimeError("bnb kept 32-bit state (n below min_8bit_size?)")
    return opt


PEERS = {"torch_fused_adamw_f32": make_torch_fused, "bnb_adamw8bit_bf16": make_bnb_8bit}


def bench(opt, repeats):
    for _ in range(2):  # warm-up
        opt.step()
    times = []
    while True:
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        k = len(times)
        if repeats is not None:
            if k >= repeats:
                break
        elif k >= 20 or (k >= 3 and sum(times) >= 1.0):
            break
    return statistics.median(times), min(times), len(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1048576,16777216")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="result.json")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    try:
        import bitsandbytes
        bnb_version = bitsandbytes.__version__
    except Exception as e:
        bnb_version = f"unavailable: {type(e).__name__}: {e}"

    cases = []
    for n in (int(s) for s in args.sizes.split(",") if s.strip()):
        for peer, make in PEERS.items():
            case = {"peer": peer, "params": n}
            try:
                sec, best, k = bench(make(n), args.repeats)
                case.update(ns_per_param=sec * 1e9 / n, seconds_per_step=sec,
                            seconds_per_step_min=best, steps_timed=k)
            except Exception as e:
                case["error"] = f"{type(e).__name__}: {e}"
            cases.append(case)
            print(json.dumps(case), flush=True)

    result = {
        "torch_version": torch.__version__,
        "bitsandbytes_version": bnb_version,
        "threads": args.threads,
        "cpu": cpu_name(),
        "cases": cases,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
