"""Quality of lpmm.torch's optimizers beside torch's and bitsandbytes': a character-level GPT
(chargpt.py) trained on Shakespeare by the same loop, only the optimizer line differing, one arm
per process run; the validation loss after training goes to a JSON line.

    python bench/quality.py --arm torch_adamw --seed 0 --out target/python-quality.jsonl

docs/PYTHON.md ("Quality") has the arms, the settings and the table this makes.
"""

import argparse
import json
import math
import resource
import time

import torch

from chargpt import CharGPT, batch, load_text, loss_of


def optimizer(arm, params, lr, seed):
    """The arm's optimizer: the only line that differs between arms."""
    if arm in ("torch_adamw", "torch_adamw_bf16"):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    if arm == "torch_sgdm":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if arm == "bnb_adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    import lpmm.torch

    if arm == "lpmm_adamw8bit_bf16_sr":  # bf16 model: parameters stepped in place with SR
        return lpmm.torch.AdamW8bit(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.1, seed=seed)
    if arm == "lpmm_adamw4bit":
        return lpmm.torch.AdamW4bit(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.1, seed=seed)
    if arm == "lpmm_sgdm":  # 8-bit parameters and momentum, stochastic rounding
        return lpmm.torch.LPMMSGDM(params, lr=lr, momentum=0.9, seed=seed)
    if arm == "lpmm_sgdm_f32_params":  # the 8-bit momentum alone: the parameters stay f32 tensors
        return lpmm.torch.LPMMSGDM(params, lr=lr, momentum=0.9, seed=seed, param_storage="auto")
    raise SystemExit(f"unknown arm {arm}")


BF16_ARMS = ("lpmm_adamw8bit_bf16_sr", "torch_adamw_bf16")
SGD_ARMS = ("torch_sgdm", "lpmm_sgdm", "lpmm_sgdm_f32_params")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--d", type=int, default=160)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-batches", type=int, default=40)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    train, val, vocab = load_text()
    model = CharGPT(vocab, a.block, d=a.d, layers=a.layers, heads=a.d // 32)
    if a.arm in BF16_ARMS:
        model = model.to(torch.bfloat16)
    lr = 0.5 if a.arm in SGD_ARMS else 2e-3
    opt = optimizer(a.arm, model.parameters(), lr, a.seed)
    warmup = max(1, a.steps // 16)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup)
        * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))),
    )
    gen = torch.Generator().manual_seed(1000 + a.seed)
    curve = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        x, y = batch(train, a.block, a.batch, gen)
        loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 50 == 0 or step == a.steps - 1:
            curve.append((step, round(loss.item(), 4)))
    seconds = time.perf_counter() - t0
    model.eval()
    vgen = torch.Generator().manual_seed(12345)  # the same validation batches for every arm
    with torch.no_grad():
        val_loss = sum(
            loss_of(model, *batch(val, a.block, a.batch, vgen)).item() for _ in range(a.eval_batches)
        ) / a.eval_batches
    row = {
        "arm": a.arm,
        "seed": a.seed,
        "steps": a.steps,
        "params": sum(p.numel() for p in model.parameters()),
        "val_loss": round(val_loss, 4),
        "train_curve": curve,
        "s_per_step": round(seconds / a.steps, 4),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(row))
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
