#!/usr/bin/env python3
"""Generate bnb_blockwise.safetensors: golden data for 8-bit block-wise quantization.

Anchors: bitsandbytes 0.50.2 (the code maps) and an exact nearest-code rule (the codes).
See README.md beside this file for the pinned environment and the command line.

What is stored (all little-endian, safetensors):
  map.signed, map.unsigned        f32[256]  bitsandbytes.functional.create_dynamic_map(signed=...)
  input.{d}                       f32[n]    test vectors (d in INPUT_NAMES)
  codes.{d}.{m}.{B}               u8[n]     exact nearest code (rule below)
  absmax.{d}.{m}.{B}              f32[ceil(n/B)]
for m in {signed, unsigned} and B in {64, ..., 4096}.  For m = unsigned the quantized
vector is abs(input.{d}).

The exact rule (the Rust side implements the same):
  * blocks of B consecutive elements, the last one partial; absmax = max |x| over the block (f32);
  * y = x / absmax, one correctly rounded f32 division; if absmax == 0 then y = 0 for the block;
  * for j in 0..255, lo = map[j], hi = map[j+1], mid = (lo + hi) / 2 exactly (float64; exact for
    these maps, asserted below).  An exact midpoint goes to the code of LOWER MAGNITUDE
    (|lo| < |hi| -> lo, |hi| < |lo| -> hi, equal -> lo).  threshold_j is the smallest f32 that
    maps to hi: the smallest f32 >= mid when the tie goes to hi, else the smallest f32 > mid;
  * code = #{ j : threshold_j <= y }.

bitsandbytes' own CPU quantize_blockwise is NOT used for the codes (it goes through a
65,536-bin lookup table and is inexact); it is run on every case and compared: absmax must
agree bit for bit, and every code disagreement must be explained by bnb's table resolution
(see check_against_bnb).  The comparison table is printed to stdout.
"""

import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import bitsandbytes
import bitsandbytes.functional as F
import safetensors

HERE = Path(__file__).resolve().parent
OUT = HERE / "bnb_blockwise.safetensors"
REPO = HERE.parents[3]
# the reference map table lives in shared/spec/ (beside or inside the checkout)
SPEC_TSV_CANDIDATES = [
    REPO / "shared" / "spec" / "dynamic-map-8bit.tsv",
    REPO.parent / "shared" / "spec" / "dynamic-map-8bit.tsv",
]

SEED = 20240611
BLOCK_SIZES = [64, 128, 256, 512, 1024, 2048, 4096]
MAPS = ["signed", "unsigned"]
# Distance bound for a bnb disagreement: half a bin of a 65,536-bin table over [-1, 1],
# i.e. (2 / 65536) / 2 = 2**-16 = 1.52587890625e-05 (in units of absmax).
BOUND = 2.0**-16


# --------------------------------------------------------------------------- output


def write_safetensors(path, tensors, metadata):
    """Byte-reproducible safetensors writer (safetensors' own save() emits the metadata in
    hash order, so two runs differ).  tensors: name -> numpy array of f32 or u8.
    Header: "__metadata__" first, then tensors by (descending item size, name); data offsets
    are contiguous and every tensor stays aligned to its item size."""
    st_dtype = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, off = [], 0
    for k in order:
        a = np.ascontiguousarray(tensors[k])
        b = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[k] = {"dtype": st_dtype[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


# --------------------------------------------------------------------------- maps


def load_spec_hex():
    """Bit patterns of the reference maps from dynamic-map-8bit.tsv (None if not found)."""
    found = [p for p in SPEC_TSV_CANDIDATES if p.exists()]
    if not found:
        return None
    path = found[0]
    signed, unsigned = [], []
    for line in path.read_text().splitlines():
        if line.startswith("#") or line.startswith("index") or not line.strip():
            continue
        cols = line.split("\t")
        signed.append(int(cols[2], 16))
        unsigned.append(int(cols[4], 16))
    return {
        "signed": np.array(signed, dtype=np.uint32),
        "unsigned": np.array(unsigned, dtype=np.uint32),
    }


def thresholds(code):
    """f32 thresholds of the exact nearest-code rule (see module docstring).

    Returns (thr f32[255], mid f64[255]); code = count of thr <= y.
    """
    code = np.asarray(code, dtype=np.float32)
    assert np.all(np.diff(code.astype(np.float64)) > 0), "map must be strictly increasing"
    thr = np.empty(len(code) - 1, dtype=np.float32)
    mids = np.empty(len(code) - 1, dtype=np.float64)
    for j in range(len(code) - 1):
        lo, hi = np.float64(code[j]), np.float64(code[j + 1])
        mid = (lo + hi) / 2.0
        # the float64 midpoint must be exact (true for adjacent f32 map entries here)
        assert Fraction(mid) == (Fraction(lo) + Fraction(hi)) / 2, (j, lo, hi)
        tie_to_hi = abs(hi) < abs(lo)
        t = np.float32(mid)  # round to nearest f32, then fix up with exact f64 comparisons
        if np.float64(t) < mid:
            t = np.nextafter(t, np.float32(np.inf))
        # now t is the smallest f32 >= mid
        assert np.float64(np.nextafter(t, np.float32(-np.inf))) < mid <= np.float64(t)
        if not tie_to_hi and np.float64(t) == mid:
            t = np.nextafter(t, np.float32(np.inf))  # exact tie belongs to lo
        thr[j] = t
        mids[j] = mid
    return thr, mids


# --------------------------------------------------------------------------- quantizer


def block_absmax(x, B):
    n = len(x)
    nb = -(-n // B)
    pad = np.zeros(nb * B, dtype=np.float32)
    pad[:n] = np.abs(x)
    return pad.reshape(nb, B).max(axis=1).astype(np.float32)


def normalise(x, B, absmax):
    """y = x / absmax per block (one f32 division), y = 0 where absmax == 0."""
    scale = np.repeat(absmax, B)[: len(x)]
    with np.errstate(invalid="ignore", divide="ignore"):
        y = (x.astype(np.float32) / scale).astype(np.float32)
    y[scale == 0] = np.float32(0.0)
    return y


def quantize_exact(x, B, thr):
    absmax = block_absmax(x, B)
    y = normalise(x, B, absmax)
    # number of thresholds <= y (thr sorted ascending; compare in float64, exact for f32)
    codes = np.searchsorted(thr.astype(np.float64), y.astype(np.float64), side="right")
    assert codes.max() <= 255
    return codes.astype(np.uint8), absmax, y


def nearest_by_bruteforce(y, code):
    """Independent check of the rule: exact distances in float64 (exact for f32 inputs
    whose difference is representable; verified with Fractions for the ties)."""
    c = code.astype(np.float64)
    d = np.abs(y.astype(np.float64)[:, None] - c[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    # among equally near codes pick the lower magnitude, then the lower index
    mag = np.where(cand, np.abs(c)[None, :], np.inf)
    return np.argmin(mag, axis=1).astype(np.uint8)


# --------------------------------------------------------------------------- inputs


def make_inputs(rng):
    inputs = {}
    # standard normal, two full 4096-blocks
    inputs["normal"] = rng.standard_normal(8192).astype(np.float32)
    # heavy tailed: Student-t with 2 degrees of freedom; partial second 4096-block
    inputs["heavy"] = rng.standard_t(2.0, 6000).astype(np.float32)
    # tiny: a +-3.0 at every 64th position, all others +-(1e-7 .. 3e-7) * 3.0, so every block
    # of every size mixes a full-scale value with values around the smallest code midpoints
    n = 8192
    t = (rng.uniform(1e-7, 3e-7, n) * 3.0 * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    t[::64] = (3.0 * rng.choice([-1.0, 1.0], n // 64)).astype(np.float32)
    inputs["tiny"] = t
    # zeros: the first 4096 elements are exact zeros (aligned all-zero blocks of every size
    # 64..4096), ~3% scattered zeros in the rest (also -0.0), the rest normal
    n = 8960
    z = rng.standard_normal(n).astype(np.float32)
    z[:4096] = 0.0
    scattered = 4096 + rng.choice(n - 4096, size=(n - 4096) // 32, replace=False)
    z[scattered] = 0.0
    z[scattered[::2]] = -0.0
    inputs["zeros"] = z
    # ragged: normal, length not a multiple of 64
    inputs["ragged"] = rng.standard_normal(9229).astype(np.float32)
    return inputs


def make_ties(thr_by_map, mid_by_map):
    """Boundary cases of the rule: every f32-representable exact midpoint, every threshold and
    the f32 just below it, for both maps; a +-1.0 at every 64th position makes absmax == 1
    in every block of every size, so y == x exactly.  (A sixth input beyond the brief's five.)"""
    vals = []
    for m in MAPS:
        thr, mids = thr_by_map[m], mid_by_map[m]
        for t, mid in zip(thr, mids):
            if np.float64(np.float32(mid)) == mid:
                vals.append(np.float32(mid))
            vals.append(t)
            vals.append(np.nextafter(t, np.float32(-np.inf)))
    vals = np.array(vals, dtype=np.float32)
    vals = vals[np.abs(vals) <= 1.0]
    out = []
    k = 0
    i = 0
    while k < len(vals):
        if i % 64 == 0:
            out.append(np.float32(1.0) if (i // 64) % 2 == 0 else np.float32(-1.0))
        else:
            out.append(vals[k])
            k += 1
        i += 1
    return np.array(out, dtype=np.float32)


# --------------------------------------------------------------------------- bnb comparison


def bnb_quantize(x, code, B):
    q, st = F.quantize_blockwise(torch.from_numpy(x.copy()), code=torch.from_numpy(code.copy()), blocksize=B)
    return q.numpy().astype(np.uint8), st.absmax.numpy().astype(np.float32)


def check_against_bnb(name, x, code, mids, B, ours, absmax, y):
    """Compare with bitsandbytes' CPU path; returns a summary row (raises on a violation)."""
    theirs, their_absmax = bnb_quantize(x, code, B)
    assert np.array_equal(their_absmax.view(np.uint32), absmax.view(np.uint32)), f"{name}: absmax differs"
    zero_block = np.repeat(absmax == 0, B)[: len(x)]
    diff = (theirs != ours) & ~zero_block
    # all-zero blocks: bnb computes 0/0 = NaN and its table maps NaN to code 0
    zero_elems = int(zero_block.sum())
    zero_codes = sorted(set(theirs[zero_block].tolist())) if zero_elems else []
    idx = np.nonzero(diff)[0]
    max_dist = 0.0
    max_span = 0
    for i in idx:
        a, b = sorted((int(ours[i]), int(theirs[i])))
        crossed = mids[a:b]  # midpoints between codes a..b
        dist = float(np.max(np.abs(np.float64(y[i]) - crossed)))
        max_dist = max(max_dist, dist)
        max_span = max(max_span, b - a)
        assert dist <= BOUND, f"{name}[{i}]: y={y[i]!r} ours={ours[i]} bnb={theirs[i]} dist={dist}"
    return {
        "case": name,
        "n": len(x),
        "disagree": len(idx),
        "max_span": max_span,
        "max_dist": max_dist,
        "zero_block_elems": zero_elems,
        "bnb_zero_block_codes": zero_codes,
    }


# --------------------------------------------------------------------------- main


def main():
    rng = np.random.default_rng(SEED)
    versions = {
        "bitsandbytes": bitsandbytes.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
    }
    print("versions:", json.dumps(versions))

    maps = {
        "signed": F.create_dynamic_map(signed=True).numpy().astype(np.float32),
        "unsigned": F.create_dynamic_map(signed=False).numpy().astype(np.float32),
    }
    spec = load_spec_hex()
    for m in MAPS:
        assert maps[m].shape == (256,)
        if spec is None:
            print(f"map.{m}: dynamic-map-8bit.tsv not found, not compared")
        else:
            same = np.array_equal(maps[m].view(np.uint32), spec[m])
            print(f"map.{m}: equals dynamic-map-8bit.tsv bit for bit: {same}")
            assert same, f"map.{m} differs from the spec tsv"

    thr, mids = {}, {}
    for m in MAPS:
        thr[m], mids[m] = thresholds(maps[m])

    inputs = make_inputs(rng)
    inputs["ties"] = make_ties(thr, mids)

    tensors = {"map.signed": maps["signed"], "map.unsigned": maps["unsigned"]}
    rows = []
    for d, x in inputs.items():
        tensors[f"input.{d}"] = x
        for m in MAPS:
            xv = np.abs(x).astype(np.float32) if m == "unsigned" else x
            for B in BLOCK_SIZES:
                codes, absmax, y = quantize_exact(xv, B, thr[m])
                # cross-check the threshold rule against brute-force nearest with the tie rule
                assert np.array_equal(codes, nearest_by_bruteforce(y, maps[m])), (d, m, B)
                tensors[f"codes.{d}.{m}.{B}"] = codes
                tensors[f"absmax.{d}.{m}.{B}"] = absmax
                rows.append(check_against_bnb(f"{d}.{m}.{B}", xv, maps[m], mids[m], B, codes, absmax, y))

    # ----- summary table
    print()
    print(f"bnb CPU quantize_blockwise vs exact rule; bound on |y - mid| = 2**-16 = {BOUND!r}")
    print("disagree: elements in blocks with absmax > 0 whose bnb code differs from the exact one")
    print("span: max |code_bnb - code_exact|; max_dist: max over disagreements of the largest")
    print("|y - mid| over the midpoints crossed between the two codes (units of absmax)")
    print("zero-blk: elements in all-zero blocks (exact: code of 0.0; bnb: codes listed)")
    print()
    hdr = f"{'case':<24} {'n':>5} {'disagree':>8} {'span':>4} {'max_dist':>12} {'zero-blk':>8}  bnb-zero-blk-codes"
    print(hdr)
    print("-" * len(hdr))
    tot_n = tot_d = 0
    overall = 0.0
    for r in rows:
        tot_n += r["n"]
        tot_d += r["disagree"]
        overall = max(overall, r["max_dist"])
        print(
            f"{r['case']:<24} {r['n']:>5} {r['disagree']:>8} {r['max_span']:>4} {r['max_dist']:>12.6e} "
            f"{r['zero_block_elems']:>8}  {r['bnb_zero_block_codes'] or ''}"
        )
    print("-" * len(hdr))
    print(f"total: {tot_d} of {tot_n} codes differ ({100.0 * tot_d / tot_n:.3f}%), "
          f"max distance to a crossed midpoint {overall:.6e} <= {BOUND:.6e}")
    normal_rows = [r for r in rows if r["case"].startswith(("normal.", "ragged."))]
    nn = sum(r["n"] for r in normal_rows)
    nd = sum(r["disagree"] for r in normal_rows)
    print(f"normal data (normal + ragged): {nd} of {nn} ({100.0 * nd / nn:.3f}%)")

    metadata = {
        "bitsandbytes": versions["bitsandbytes"],
        "torch": versions["torch"],
        "numpy": versions["numpy"],
        "safetensors": versions["safetensors"],
        "seed": str(SEED),
        "generator": "gen_bnb_blockwise.py",
        "rule": (
            "blocks of B (last partial); absmax=max|x| f32; y=x/absmax (f32 division, y=0 if absmax==0); "
            "code=#{j: thr_j<=y}, thr_j=smallest f32 mapping to map[j+1] where the exact midpoint "
            "(map[j]+map[j+1])/2 ties to the lower-magnitude code; unsigned map quantizes abs(x)"
        ),
    }
    write_safetensors(OUT, tensors, metadata)
    print(f"\nwrote {OUT.name}: {OUT.stat().st_size} bytes, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
