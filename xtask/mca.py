"""The CPU step's hot loops through llvm-mca on CPUs this machine is not (docs/BENCHMARKS.md,
"Other microarchitectures"): each case profiles `step_profile` on one thread at one SIMD level
(`perf record`), takes the innermost loop around the hottest instruction of the named function
(`closes_loop`), keeps the basic blocks the profile saw run often (`MIN_BLOCK`) and drops the
branches (a straight line: both sides of a branch taken often are counted, so an estimate errs
high) and asks llvm-mca for the cycles one iteration takes on each CPU model.

    cargo build --release -p lpmm-optim --example step_profile
    python3 xtask/mca.py            # every case below, every CPU below, a markdown table
    python3 xtask/mca.py --list     # the cases

Needs `perf` and `llvm-mca-19` (Debian's llvm-19 package). The figures are models, not
measurements: read them as how the same loop compares across CPUs.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

# name: (preset, SIMD level, function, elements one iteration of its hot loop handles)
CASES = {
    "AdamW rule, AVX-512 (f32 AdamW)": ("adamw_f32", "vbmi", "lpmm_optim::rule::apply_chunk_lean::avx512", 16),
    "AdamW rule, AVX2 (f32 AdamW)": ("adamw_f32", "avx2", "lpmm_optim::rule::apply_chunk_lean::avx2", 8),
    "nearest 8-bit code, VBMI (8-bit AdamW)": (
        "adamw_8bit_bf16", "vbmi",
        "lpmm_formats::codemap::vbmi::<impl lpmm_formats::codemap::CodeMap>::nearest_scaled_vbmi", 64),
    "nearest 8-bit code, AVX-512 word tables (8-bit AdamW)": (
        "adamw_8bit_bf16", "avx512",
        "lpmm_formats::codemap::words::<impl lpmm_formats::codemap::CodeMap>::nearest_scaled_words", 32),
    "nearest 8-bit code, AVX2 scalar reads (8-bit AdamW)": (
        "adamw_8bit_bf16", "avx2",
        "lpmm_formats::codemap::avx2::<impl lpmm_formats::codemap::CodeMap>::nearest_scaled_avx2", 8),
    "decode 8-bit code, VBMI (8-bit AdamW)": (
        "adamw_8bit_bf16", "vbmi",
        "lpmm_formats::codemap::vbmi::<impl lpmm_formats::codemap::CodeMap>::decode_scaled_vbmi", 64),
    "decode 8-bit code, AVX2 scalar reads (8-bit AdamW)": (
        "adamw_8bit_bf16", "avx2",
        "lpmm_formats::codemap::avx2::<impl lpmm_formats::codemap::CodeMap>::decode_scaled_avx2", 8),
    "decode 8-bit code, AVX-512 word tables (8-bit AdamW)": (
        "adamw_8bit_bf16", "avx512",
        "lpmm_formats::codemap::avx512::<impl lpmm_formats::codemap::CodeMap>::decode_blocks_avx512", 32),
    "grid stochastic rounding, AVX-512 (LPMM-SGDM)": (
        "lpmm_sgdm", "avx512",
        "lpmm_formats::codemap::avx512::<impl lpmm_formats::codemap::CodeMap>::stochastic_blocks_avx512", 64),
    "grid stochastic rounding, AVX2 (LPMM-SGDM)": (
        "lpmm_sgdm", "avx2",
        "lpmm_formats::codemap::avx2::<impl lpmm_formats::codemap::CodeMap>::stochastic_blocks_avx2", 8),
}

AVX512_CPUS = ["znver4", "znver5", "skylake-avx512", "icelake-server", "sapphirerapids"]
AVX2_CPUS = AVX512_CPUS + ["alderlake"]
# Skylake-SP (and Cascade Lake) have AVX-512 without VBMI.
VBMI_CPUS = ["znver4", "znver5", "icelake-server", "sapphirerapids"]
MIN_BODY = 12
# A basic block is on the path the step runs if it holds at least this share (%) of the
# function's samples: a rare path's block (a fallback taken once in thousands of iterations)
# holds less, and a block that runs every iteration more. (Any sample at all made the line
# depend on which rare block a run happened to sample.)
MIN_BLOCK = 1.0

LINE = re.compile(r"^\s*([0-9.]+)\s*:\s+([0-9a-f]+):\s+(.*)$")
JUMP = re.compile(r"^(j[a-z]+)\s+([0-9a-f]+)")


def profile(binary, preset, level, params, steps):
    data = tempfile.NamedTemporaryFile(suffix=".data", delete=False).name
    env = dict(os.environ, LPMM_SIMD=level, RAYON_NUM_THREADS="1")
    # A sample every 0.1 ms of CPU time (`-c` in ns): enough that the blocks kept do not change
    # from run to run.
    subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-c", "100000", "-o", data,
                    binary, preset, str(params), str(steps)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return data


def listing(data, symbol):
    """(address, samples %, instruction) of every instruction of `symbol`."""
    out = subprocess.run(["perf", "annotate", "-i", data, "--stdio", "-s", symbol],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            rows.append((int(m.group(2), 16), float(m.group(1)), m.group(3).split("#")[0].strip()))
    if not rows:
        sys.exit(f"no samples in {symbol}")
    return rows


def closes_loop(rows, span, hot):
    """Whether the backward jump at `span[1]` to `span[0]` closes a loop through `hot`: from
    `span[0]`, following fall-through and jumps without leaving the span, both `hot` and the jump
    are reached. (Not so where the jump is the exit of an inner loop laid out rotated: the code
    before it belongs to the enclosing loop and leaves the span by an unconditional jump.)"""
    inside = [(a, ins) for a, _, ins in rows if span[0] <= a <= span[1]]
    index = {a: i for i, (a, _) in enumerate(inside)}
    seen, todo = set(), [0]
    while todo:
        i = todo.pop()
        if i in seen or i >= len(inside):
            continue
        seen.add(i)
        addr, ins = inside[i]
        if re.match(r"(ret|ud2)\b", ins):
            continue
        m = JUMP.match(ins)
        if m and addr != span[1]:
            target = int(m.group(2), 16)
            if target in index:
                todo.append(index[target])
            if m.group(1) == "jmp":
                continue
        if addr != span[1]:
            todo.append(i + 1)
    reached = {inside[i][0] for i in seen}
    return hot in reached and span[1] in reached


def hot_loop(rows):
    """The instructions of the innermost loop (a backward jump's range) of at least `MIN_BODY`
    instructions around the hottest one that is in such a loop (a shorter one is a loop inside
    the step's loop, e.g. the nearest search's scan, which runs once per group with the shipped
    maps; a hot instruction outside every loop is the kernel's setup or a sample's skid)."""
    best = None
    for hot, _, _ in sorted(rows, key=lambda r: -r[1])[:20]:
        for addr, _, ins in rows:
            m = JUMP.match(ins)
            if m and int(m.group(2), 16) <= hot <= addr:
                span = (int(m.group(2), 16), addr)
                size = sum(1 for a, _, _ in rows if span[0] <= a <= span[1])
                if size >= MIN_BODY and closes_loop(rows, span, hot) and (
                    best is None or span[1] - span[0] < best[1] - best[0]
                ):
                    best = span
        if best is not None:
            break
    if best is None:
        sys.exit("none of the hottest instructions is in a loop")
    inside = [r for r in rows if best[0] <= r[0] <= best[1]]
    # Basic blocks (cut after each jump and at each jump target); those below `MIN_BLOCK` are
    # paths this profile took rarely or not at all (e.g. the unrolled copies of a search loop
    # that runs once per group), left out so that the straight line is the path the step runs.
    targets = {int(m.group(2), 16) for _, _, ins in inside if (m := JUMP.match(ins))}
    blocks, block = [], []
    for addr, pct, ins in inside:
        if block and addr in targets:
            blocks.append(block)
            block = []
        block.append((pct, ins))
        if JUMP.match(ins):
            blocks.append(block)
            block = []
    if block:
        blocks.append(block)
    return [ins for b in blocks if sum(p for p, _ in b) >= MIN_BLOCK
            for _, ins in b if ins and not JUMP.match(ins)]


def mca(body, cpu):
    asm = "\n".join(body) + "\n"
    out = subprocess.run(["llvm-mca-19", "-mtriple=x86_64-unknown-linux-gnu", f"-mcpu={cpu}",
                          "-iterations=200"], input=asm, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    total = re.search(r"Total Cycles:\s+(\d+)", out.stdout)
    return int(total.group(1)) / 200 if total else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default="target/release/examples/step_profile")
    ap.add_argument("--params", type=int, default=1 << 22)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("cases", nargs="*", help="case names (default: all)")
    args = ap.parse_args()
    if args.list:
        print("\n".join(CASES))
        return
    names = args.cases or list(CASES)
    cpus = AVX2_CPUS
    print("| loop | instructions | " + " | ".join(cpus) + " |")
    print("|---|---|" + "---|" * len(cpus))
    for name in names:
        preset, level, symbol, lanes = CASES[name]
        data = profile(args.binary, preset, level, args.params, args.steps)
        try:
            body = hot_loop(listing(data, symbol))
        finally:
            os.unlink(data)
        has = AVX2_CPUS
        if any("zmm" in ins for ins in body):
            has = AVX512_CPUS
        if any(re.match(r"vperm[it]?2?b\b|vpermb\b|vpmultishiftqb\b", ins) for ins in body):
            has = VBMI_CPUS
        cells = []
        for cpu in cpus:
            c = mca(body, cpu) if cpu in has else None
            cells.append("-" if c is None else f"{c / lanes:.2f}")
        print(f"| {name} | {len(body)} | " + " | ".join(cells) + " |")
    print("\ncycles per element (one iteration's cycles ÷ the elements it handles), llvm-mca-19")


if __name__ == "__main__":
    main()
