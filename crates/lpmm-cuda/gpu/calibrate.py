"""The issue-rate model's calibration from a device run (crates/lpmm-cuda/gpu/run.sh).

    python3 crates/lpmm-cuda/gpu/calibrate.py --static .gpu/static.json \
        --bandwidth $OUT/bandwidth.json --peers $OUT/peers.json --out $OUT/calibration.json

Inputs: the static figures (`cargo xtask kernels --json`: each specialized step's fast-path SASS
instructions per element, per architecture), the measured steps (`bandwidth --json`: seconds per
step of each case, with the plan kernel that ran it) and the peers (`peers_cuda.py`: torch's fused
AdamW and torchao's AdamW8bit). For every measured case: the warp instructions of one step
(instructions per element x parameters / 32), the measured rate (warp instructions per second),
the model's time at its default rate (132 SMs x 4 schedulers x 0.53 issued per scheduler-cycle x
1.98 GHz, an H200) and the ratio to torch's fused f32 AdamW measured in the same run. The
calibrated rate is the median rate of the cases at 1e8 parameters and above (where launch and
read-back overheads are small): `cargo xtask kernels --report --calibration calibration.json`
prints the estimates with it.

Any input may be missing (a dry run without a device, a stage that failed): the file is still
written, with null figures and the reason, so the results' shape is the same either way.
"""
import argparse
import json
import os
import statistics

DEFAULT_RATE = 132 * 4 * 0.53 * 1.98e9

# What run.sh measures: `bandwidth`'s cases (the plan each one runs) and sizes, and the peers: the
# rows of a run without figures (a dry run, a stage that failed) have these, their figures null.
CASES = {
    "adamw 8-bit": "lpmm_plan_adamw_8bit_bf16_acc",
    "adamw 8-bit sr": "lpmm_plan_adamw_8bit_bf16_sr_acc",
    "adamw 4-bit": "lpmm_plan_adamw_4bit_bf16_acc",
    "lpmm-sgdm": "lpmm_plan_lpmm_sgdm_acc",
    "lion 8-bit": "lpmm_plan_lion_8bit_acc",
    "adamw f32": "lpmm_plan_adamw_f32_acc",
}
SIZES = [10**9, 10**8, 10**7, 10**6]


def load(path):
    if not path or not os.path.exists(path):
        return None, f"missing: {path}"
    try:
        with open(path) as f:
            return json.load(f), None
    except Exception as e:  # a file cut short by a stage that ran out of time
        return None, f"unreadable: {path}: {type(e).__name__}: {e}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--static", required=True)
    ap.add_argument("--bandwidth", required=True)
    ap.add_argument("--peers", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--status", default="measured", help="what the run was (a dry run says why)")
    args = ap.parse_args()
    static, static_err = load(args.static)
    bw, bw_err = load(args.bandwidth)
    peers, peers_err = load(args.peers)
    arch = (bw or {}).get("arch", "sm_90")
    per_element = {}
    for k in (static or {}).get("kernels", []):
        if k.get("arch") == arch:
            per_element[k["kernel"]] = k["per_element"]
    torch_f32 = {}
    for r in (peers or {}).get("rows", []):
        if r.get("peer") == "torch_fused_adamw_f32" and "seconds_per_step" in r:
            torch_f32[r["params"]] = r["seconds_per_step"]
    rows = [r for r in (bw or {}).get("rows", []) if r.get("kernel") == "specialized"]
    measured = {(r.get("case"), r.get("params")) for r in rows}
    for name, plan in CASES.items():
        for n in SIZES:
            if (name, n) not in measured:
                rows.append({"case": name, "plan": plan, "params": n, "step_s": None})
    cases = []
    for r in rows:
        plan = r.get("plan")
        per = per_element.get(plan)
        params = r["params"]
        step_s = r.get("step_s")
        warp = per * params / 32 if per is not None else None
        rate = warp / step_s if warp is not None and step_s else None
        torch_s = torch_f32.get(params)
        cases.append(
            {
                "case": r.get("case"),
                "plan": plan,
                "params": params,
                "step_ms": step_s * 1e3 if step_s else None,
                "copy_ratio": r.get("ratio"),
                "sass_per_element": per,
                "warp_instructions": warp,
                "rate_warp_instructions_per_s": rate,
                "model_ms_default_rate": warp / DEFAULT_RATE * 1e3 if warp is not None else None,
                "torch_fused_f32_ms": torch_s * 1e3 if torch_s else None,
                "vs_torch_fused_f32": torch_s / step_s if torch_s and step_s else None,
            }
        )
    # The rate of the issue-bound cases: 1e8 parameters and above, and at least 1.5 times the
    # copy of their bytes (a memory-bound step says nothing of the issue rate).
    rates = [
        c["rate_warp_instructions_per_s"]
        for c in cases
        if c["params"] >= 1e8
        and c["rate_warp_instructions_per_s"]
        and c["copy_ratio"] is not None
        and c["copy_ratio"] <= 1 / 1.5
    ]
    rate = statistics.median(rates) if rates else None
    # The same kernels' estimates at 1e9 at the calibrated (else default) rate.
    estimates = [
        {
            "kernel": name,
            "sass_per_element": per,
            "model_ms_1e9": per * 1e9 / 32 / (rate or DEFAULT_RATE) * 1e3,
            "rate": "measured" if rate else "default (estimate)",
        }
        for name, per in sorted(per_element.items())
    ]
    out = {
        "status": args.status if (bw and static) else f"{args.status}; no figures",
        "device": (bw or {}).get("device"),
        "arch": arch,
        "inputs": {
            "static": static_err or args.static,
            "bandwidth": bw_err or args.bandwidth,
            "peers": peers_err or args.peers,
        },
        "default_rate_warp_instructions_per_s": DEFAULT_RATE,
        "rate_warp_instructions_per_s": rate,
        "rate_vs_default": rate / DEFAULT_RATE if rate else None,
        "cases": cases,
        "estimates": estimates,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    timed = sum(1 for c in cases if c["step_ms"] is not None)
    print(f"wrote {args.out}: {timed} of {len(cases)} cases measured, rate {rate}")


if __name__ == "__main__":
    main()
