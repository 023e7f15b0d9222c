"""GPU peers of lpmm-cuda's `bandwidth` example: PyTorch's fused AdamW (f32 and bf16 parameters),
torchao's AdamW8bit / AdamW4bit and bitsandbytes' AdamW8bit (bf16 parameters), with a
device-to-device copy measured in the same run as the reference, JSON out; with `--many N`, also
torch's fused AdamW over N tensors of 4096 to 2^20 elements in one step (its multi-tensor apply),
the sizes of `bandwidth --many N`.

    python crates/lpmm-cuda/examples/peers_cuda.py --sizes 1e8,1e9 --many 10000 --out peers.json

Bytes moved per step are counted as each optimizer's tensors read and written once (parameter,
gradient read-only, states), so the figures compare with `bandwidth`'s. `--device cpu` runs the
same code on the CPU (a smoke test of the script, not a GPU figure).
"""
import argparse
import json
import time

import torch


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, iters):
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def state_bytes(opt):
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if hasattr(v, "codes") and hasattr(v, "scale"):
                # torchao's quantized state: packed codes and block scales (the small constant
                # code map is not counted).
                total += sum(t.numel() * t.element_size() for t in (v.codes, v.scale))
            elif torch.is_tensor(v) and v.numel() > 1:
                total += v.numel() * v.element_size()
    return total


def many_sizes(n):
    """`bandwidth --many N`'s sizes: 4096 * 256^u elements, u = ((i * 7919) mod N) / (N - 1),
    rounded down to a multiple of 16."""
    out = []
    for i in range(n):
        u = ((i * 7919) % n) / (n - 1) if n > 1 else 0.0
        out.append(int(4096.0 * 256.0**u) // 16 * 16)
    return out


def make(peer, sizes, device):
    dtype = torch.float32 if peer == "torch_fused_adamw_f32" else torch.bfloat16
    ps = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, device=device, dtype=dtype) * 0.1)
        p.grad = torch.randn(n, device=device, dtype=dtype) * 1e-3
        ps.append(p)
    if peer.startswith("torch_fused"):
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    elif peer == "bnb_adamw8bit_bf16":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(ps, lr=1e-3)
    else:
        from torchao.optim import AdamW4bit, AdamW8bit

        opt = (AdamW8bit if peer == "torchao_adamw8bit_bf16" else AdamW4bit)(ps, lr=1e-3)
    opt.step()
    pb = sum(p.numel() * p.element_size() for p in ps)
    moved = 2 * pb + pb + 2 * state_bytes(opt)  # param r+w, grad r, states r+w
    # What the optimizer really holds (torchao keeps plain tensors below its minimum size).
    kinds = sorted({f"{type(v).__name__}:{getattr(v, 'dtype', '')}" for st in opt.state.values() for v in st.values()})
    return opt, moved, kinds


PEERS = [
    "torch_fused_adamw_f32",
    "torch_fused_adamw_bf16",
    "torchao_adamw8bit_bf16",
    "torchao_adamw4bit_bf16",
    "bnb_adamw8bit_bf16",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1e8,1e9")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--many", type=int, default=0, help="also N small tensors (torch's fused AdamW)")
    ap.add_argument("--peers", default=",".join(PEERS), help="which peers, comma-separated")
    ap.add_argument("--out", default="peers_cuda.json")
    args = ap.parse_args()
    info = {"torch": torch.__version__, "device": args.device}
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except Exception as e:  # reported, the torch peers still run
        info["torchao"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        import bitsandbytes

        info["bitsandbytes"] = bitsandbytes.__version__
    except Exception as e:
        info["bitsandbytes"] = f"unavailable: {type(e).__name__}: {e}"
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    peers = [p for p in args.peers.split(",") if p]
    work = [(f"n={n}", [n], peers) for n in (int(float(s)) for s in args.sizes.split(",") if s.strip()) if n > 0]
    if args.many > 0:
        work.append((f"{args.many} tensors", many_sizes(args.many), [p for p in peers if p.startswith("torch_fused")]))
    rows = []
    for what, sizes, which in work:
        n = sum(sizes)
        for peer in which:
            row = {"peer": peer, "workload": what, "tensors": len(sizes), "params": n}
            try:
                opt, moved, kinds = make(peer, sizes, args.device)
                sec = timed(opt.step, args.device, args.iters)
                src = torch.empty(moved // 2, dtype=torch.uint8, device=args.device)
                dst = torch.empty_like(src)
                copy = timed(lambda: dst.copy_(src), args.device, args.iters)
                row.update(
                    state=kinds,
                    seconds_per_step=sec,
                    bytes_moved=moved,
                    step_gbps=moved / sec / 1e9,
                    copy_gbps=moved / copy / 1e9,
                    ratio=copy / sec,
                )
                del opt, src, dst
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            if args.device == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            # Written after every row, so that a run cut short keeps what it measured.
            with open(args.out, "w") as f:
                json.dump({"info": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
