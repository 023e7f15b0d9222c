#!/usr/bin/env python3
"""Generate torch_casts.safetensors: golden data for f32 -> bf16 / f16 / fp8 casts and small maps.

Anchors: torch (CPU casts, float8 decode) and bitsandbytes 0.50.2 (4-bit / linear maps).
See README.md beside this file for the pinned environment and the command line.

What is stored (little-endian safetensors; dtypes are safetensors' own names):
  x               F32[N]     test values (see make_x)
  bf16_rne        BF16[N]    torch: x.to(torch.bfloat16)
  f16_rne         F16[N]     torch: x.to(torch.float16)
  e4m3fn_rne      F8_E4M3[N] torch: x.to(torch.float8_e4m3fn)
  e5m2_rne        F8_E5M2[N] torch: x.to(torch.float8_e5m2)
  e4m3fn_decode   F32[256]   torch: code 0..255 viewed as float8_e4m3fn, .float()
  e5m2_decode     F32[256]   torch: code 0..255 viewed as float8_e5m2, .float()
  map.de4_signed  F32[16]    bnb create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4),
                             the 240 padding zeros removed
  map.nf4         F32[16]    bnb get_4bit_type("nf4", device="cpu")
  map.nf4_constructed F32[16] bnb create_normal_map() (scipy), the 240 padding zeros removed
  map.linear_signed8  F32[256] bnb create_linear_map(signed=True)

Besides writing the file it checks torch against an exact reference rounding (round to nearest,
ties to even, with an unbounded exponent, then overflow) and prints every deviation it finds,
so the quirks listed in README.md can be re-derived.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import bitsandbytes
import bitsandbytes.functional as F
import safetensors
import scipy

HERE = Path(__file__).resolve().parent
OUT = HERE / "torch_casts.safetensors"
SEED = 20240612

# Format parameters: mantissa bits, min normal exponent, max finite value, overflow result
# ("inf" or "nan": e4m3fn has no infinity).
FORMATS = {
    "bf16": dict(mbits=7, emin=-126, maxf=float.fromhex("0x1.fep127"), ovf="inf", torch=torch.bfloat16),
    "f16": dict(mbits=10, emin=-14, maxf=65504.0, ovf="inf", torch=torch.float16),
    "e4m3fn": dict(mbits=3, emin=-6, maxf=448.0, ovf="nan", torch=torch.float8_e4m3fn),
    "e5m2": dict(mbits=2, emin=-14, maxf=57344.0, ovf="inf", torch=torch.float8_e5m2),
}

F32_MAX = float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------- helpers


def f32_bits(v):
    return int(np.array(v, dtype=np.float32).view(np.uint32))


def from_bits(bits):
    return np.array(bits, dtype=np.uint32).view(np.float32)


def f32_exact(v):
    """float64 v as f32 if exactly representable (and finite), else None."""
    if not np.isfinite(v) or abs(v) > F32_MAX:
        return None
    f = np.float32(v)
    return f if float(f) == v else None


def positive_grid(fmt):
    """All positive finite values of a format, ascending, as float64 (via torch decode)."""
    t = FORMATS[fmt]["torch"]
    if fmt in ("bf16", "f16"):
        codes = torch.arange(0, 0x8000, dtype=torch.int32).to(torch.int16).view(t)
    else:
        codes = torch.arange(0, 0x80, dtype=torch.int32).to(torch.uint8).view(t)
    v = codes.double().numpy()
    v = v[np.isfinite(v)]
    assert np.all(np.diff(v) > 0)
    return v  # starts with 0.0


# --------------------------------------------------------------------------- test values


def pair_points(a, b, rich):
    """Points around the adjacent pair a < b (float64, both non-negative) of a format grid.

    Always: a, a +- 1 f32 ulp, the exact midpoint and the f32 values just around it.
    rich (fp8): also mid +- ulp*2^-5 (under half a bf16 ulp), +- ulp*2^-9 (exactly half an f16
    ulp of e5m2: an f16 tie), +- ulp*2^-10 (under half an f16 ulp) -- the offsets that expose a
    cast that double-rounds through bf16 or f16.
    """
    pts = [a]
    fa = f32_exact(a)
    if fa is not None:
        pts += [float(np.nextafter(fa, np.float32(np.inf))), float(np.nextafter(fa, np.float32(-np.inf)))]
    mid = (a + b) / 2.0
    fm = f32_exact(mid)
    if fm is not None:
        pts += [mid, float(np.nextafter(fm, np.float32(np.inf))), float(np.nextafter(fm, np.float32(-np.inf)))]
    if rich:
        u = b - a
        for k in (5, 9, 10):
            pts += [mid + u * 2.0**-k, mid - u * 2.0**-k]
    return [p for p in pts if f32_exact(p) is not None and p >= 0]


def grid_points(fmt, rng, pairs_random, rich):
    g = positive_grid(fmt)
    n = len(g)
    big = float(2.0 ** (np.floor(np.log2(FORMATS[fmt]["maxf"])) + 1))  # first value past max
    if rich:  # fp8: every adjacent pair, plus (max, next power of two) for the overflow region
        idx = list(range(n - 1))
    else:  # 16-bit: near zero, around the subnormal/normal boundary, near max, and random pairs
        sub_end = int(np.searchsorted(g, 2.0 ** FORMATS[fmt]["emin"]))
        idx = list(range(0, 48)) + list(range(sub_end - 24, sub_end + 24)) + list(range(n - 49, n - 1))
        idx += sorted(rng.choice(n - 1, size=pairs_random, replace=False).tolist())
    pts = []
    for i in sorted(set(idx)):
        pts += pair_points(g[i], g[i + 1], rich)
    pts += pair_points(g[-1], big, True)
    return pts


def make_x(rng):
    # 1. specials
    specials = [0.0, -0.0, np.inf, -np.inf]
    # 2. random normals at every decimal scale 1e-45 .. 1e38, both signs
    rnd = []
    for k in range(-45, 39):
        z = rng.standard_normal(40) * 10.0**k
        rnd += [v for v in z if abs(v) <= F32_MAX]
    # 3. grid neighbours, midpoints (ties) and double-rounding probes of every format
    grid = []
    for fmt, rich in (("e4m3fn", True), ("e5m2", True), ("f16", False), ("bf16", False)):
        grid += grid_points(fmt, rng, 300, rich)
    # 4. around each format's max finite value and the overflow boundaries
    edges = [
        448, 449, 456, 460, 463.99997, 464, 464.00003, 465, 470, 479.99997, 480, 480.00003, 500, 512,
        57344, 57345, 61439.996, 61440, 61440.004, 65535, 65536, 65536.01, 1e5,
        65504, 65519.996, 65520, 65520.004, 1e6, 1e30, 1e38,
    ]
    edges = [float(np.float32(e)) for e in edges]
    # bf16 max region in f32 bits: max bf16, its tie to 2^128, and the f32 max
    edge_bits = [0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7FFFFF, 0x7F7EFFFF, 0x7F7E8000]
    # 5. f32 subnormals: extremes and random bit patterns
    sub_bits = [0x00000001, 0x00000002, 0x00000003, 0x007FFFFF, 0x00800000, 0x00400000, 0x00008000,
                0x00018000, 0x00010000]
    sub_bits += rng.integers(1, 0x00800000, 200).tolist()
    # NaNs: quiet, negative quiet, signalling, with payloads
    nan_bits = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF,
                0x7FA00000, 0x7F810000]

    bits = []
    for v in specials + edges + grid:
        bits.append(f32_bits(v))
        bits.append(f32_bits(-v))
    for b in edge_bits + sub_bits:
        bits += [b, b | 0x80000000]
    for v in rnd:
        bits.append(f32_bits(v))  # random values carry their own sign
    bits += nan_bits
    # deduplicate, keep the first occurrence (the order groups the cases as above)
    seen, uniq = set(), []
    for b in bits:
        if b not in seen:
            seen.add(b)
            uniq.append(b)
    return from_bits(uniq)


# --------------------------------------------------------------------------- references


def round_exact(x, fmt, ovf=None):
    """Reference cast: exact RNE with an unbounded exponent, then |q| > max -> overflow value
    ("inf", "nan", or "sat" = +-max; Inf input -> the overflow value too).

    Returns float64 values."""
    p = FORMATS[fmt]
    ovf = ovf or p["ovf"]
    over = {"inf": np.inf, "nan": np.nan, "sat": p["maxf"]}[ovf]
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    for i, v in enumerate(x):
        if np.isnan(v):
            out[i] = np.nan
            continue
        if np.isinf(v):
            out[i] = np.copysign(over, v)
            continue
        a = abs(v)
        if a == 0:
            out[i] = v
            continue
        e = max(int(np.frexp(a)[1]) - 1, p["emin"])
        ulp = 2.0 ** (e - p["mbits"])
        q = float(np.rint(a / ulp)) * ulp  # exact: scaling by a power of two; rint ties to even
        if q > p["maxf"]:
            q = over
        out[i] = np.copysign(q, v)
    return out


def same_value(a, b):
    """Elementwise equality of float64 arrays treating NaN == NaN and -0 != +0."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    eq = (a == b) & (np.signbit(a) == np.signbit(b))
    return both_nan | eq


# --------------------------------------------------------------------------- output


ST_NAME = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def tensor_bytes(t):
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes()  # little-endian host (x86-64)


def write_safetensors(path, tensors, metadata):
    """Byte-reproducible safetensors writer (safetensors' save() emits the metadata in hash
    order).  tensors: name -> torch tensor.  Header: "__metadata__" first, then tensors by
    (descending item size, name), contiguous data, every tensor aligned to its item size."""
    assert sys.byteorder == "little"
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, off = [], 0
    for k in order:
        t = tensors[k]
        b = tensor_bytes(t)
        header[k] = {"dtype": ST_NAME[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
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


def strip_padding_zeros(m, n=16):
    """bnb pads sub-8-bit maps to 256 entries with zeros; keep the n real values (one zero)."""
    v = m.float().numpy()
    nz = v[v != 0]
    assert len(nz) == n - 1, len(nz)
    out = np.sort(np.concatenate([nz, np.zeros(1, np.float32)])).astype(np.float32)
    return torch.from_numpy(out)


def hexs(t):
    return " ".join(f"{b:08x}" for b in t.numpy().view(np.uint32).tolist())


# --------------------------------------------------------------------------- main


def main():
    rng = np.random.default_rng(SEED)
    versions = {
        "bitsandbytes": bitsandbytes.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
    }
    print("versions:", json.dumps(versions))
    capability = torch.backends.cpu.get_cpu_capability()
    print("torch cpu capability:", capability)
    if capability == "DEFAULT":
        print("WARNING: scalar CPU kernels: bf16 NaN bits and map.linear_signed8 will differ from the committed file")

    x_np = make_x(rng)
    x = torch.from_numpy(x_np.copy())
    print(f"N = {len(x_np)} test values")

    tensors = {"x": x}
    casts = {}
    for fmt, p in FORMATS.items():
        y = x.to(p["torch"])
        casts[fmt] = y
        tensors[f"{fmt}_rne"] = y
        # the same cast one element at a time (scalar path) must agree with the vectorized one
        one = torch.cat([x[i : i + 1].to(p["torch"]) for i in range(len(x))])
        vb = y.view(torch.uint8).numpy() if y.element_size() == 1 else y.view(torch.int16).numpy()
        ob = one.view(torch.uint8).numpy() if y.element_size() == 1 else one.view(torch.int16).numpy()
        print(f"{fmt}: vectorized vs element-wise cast bit-identical: {np.array_equal(vb, ob)}")

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    tensors["e4m3fn_decode"] = codes.view(torch.float8_e4m3fn).float()
    tensors["e5m2_decode"] = codes.view(torch.float8_e5m2).float()

    # ----- compare torch with the exact reference
    print("\n== torch vs exact RNE with an unbounded exponent, then overflow ==")
    print("   (overflow: Inf for bf16/f16/e5m2; for e4m3fn two policies: NaN, or saturate to +-448)")
    with np.errstate(invalid="ignore"):
        xd = x_np.astype(np.float64)
    policies = [(fmt, None) for fmt in FORMATS] + [("e4m3fn", "sat")]
    for fmt, ovf in policies:
        got = casts[fmt].double().numpy()
        ref = round_exact(xd, fmt, ovf)
        bad = np.nonzero(~same_value(got, ref))[0]
        label = f"{fmt} (overflow -> {ovf or FORMATS[fmt]['ovf']})"
        print(f"{label}: {len(bad)} deviations")
        if len(bad):
            fin = np.isfinite(xd[bad])
            ab = np.abs(xd[bad][fin])
            print(f"   deviating inputs: {int((~fin).sum())} non-finite, finite |x| in "
                  f"[{ab.min()!r}, {ab.max()!r}]; torch gives {sorted(set(np.abs(got[bad]).tolist()))}")
        for i in bad[:6]:
            print(f"   x={x_np[i]!r} (0x{f32_bits(x_np[i]):08x}) torch={got[i]!r} ref={ref[i]!r}")
    # double rounding models: what a cast through f16 / bf16 would have given
    print("\n== deviations of torch from double-rounding models fmt(f16(x)), fmt(bf16(x)) ==")
    print("   (non-zero counts mean torch does NOT double-round through that format)")
    f16_of_x = round_exact(xd, "f16")
    bf16_of_x = round_exact(xd, "bf16")
    for fmt, ovf in (("e5m2", None), ("e4m3fn", "sat")):
        got = casts[fmt].double().numpy()
        for via, mid in (("f16", f16_of_x), ("bf16", bf16_of_x)):
            ref2 = round_exact(mid, fmt, ovf)
            n2 = int((~same_value(got, ref2)).sum())
            print(f"{fmt} vs {fmt}({via}(x)): {n2} deviations")
    # spec formula for bf16 RNE
    xb = x_np.view(np.uint32).astype(np.uint64)
    spec_bf16 = ((xb + 0x7FFF + ((xb >> 16) & 1)) >> 16).astype(np.uint16)
    tb = casts["bf16"].view(torch.int16).numpy().view(np.uint16)
    fin = np.isfinite(x_np)
    print(f"bf16 bits == (bits + 0x7FFF + lsb) >> 16 on all non-NaN x: {np.array_equal(spec_bf16[~np.isnan(x_np)], tb[~np.isnan(x_np)])}")
    with np.errstate(over="ignore"):
        np16 = x_np[fin].astype(np.float16).view(np.uint16)
    print(f"f16 bits == numpy astype(float16) on finite x: "
          f"{np.array_equal(np16, casts['f16'].view(torch.int16).numpy().view(np.uint16)[fin])}")

    # ----- NaN / overflow behaviour in bits
    print("\n== NaN and overflow bit patterns ==")
    probe = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000,
             0x7F800000, 0xFF800000]
    probe += [f32_bits(v) for v in (448, 460, 464, 464.00003, 470, 479.99997, 480, 1e30, -470, -480,
                                    57344, 61439.996, 61440, 65504, 65519.996, 65520)]
    probe += [0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF]
    print(f"{'x':>26} {'bits':>10} {'bf16':>6} {'f16':>6} {'e4m3fn':>6} {'e5m2':>6}")
    for b in probe:
        v = from_bits([b])
        t = torch.from_numpy(v)
        outs = [
            f"{int(t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)[0]):04x}",
            f"{int(t.to(torch.float16).view(torch.int16).numpy().view(np.uint16)[0]):04x}",
            f"{int(t.to(torch.float8_e4m3fn).view(torch.uint8)[0]):02x}",
            f"{int(t.to(torch.float8_e5m2).view(torch.uint8)[0]):02x}",
        ]
        print(f"{v[0]!r:>26} {b:>10x} {outs[0]:>6} {outs[1]:>6} {outs[2]:>6} {outs[3]:>6}")

    # ----- maps
    de4 = strip_padding_zeros(F.create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4))
    nf4 = F.get_4bit_type("nf4", device="cpu").float().contiguous()
    assert nf4.shape == (16,)
    nf4c = strip_padding_zeros(F.create_normal_map())
    lin = F.create_linear_map(signed=True).float().contiguous()
    assert lin.shape == (256,)
    tensors["map.de4_signed"] = de4
    tensors["map.nf4"] = nf4
    tensors["map.nf4_constructed"] = nf4c
    tensors["map.linear_signed8"] = lin
    print("\n== maps (f32 hex) ==")
    print("map.de4_signed      :", hexs(de4))
    print("                     ", de4.tolist())
    print("map.nf4             :", hexs(nf4))
    print("                     ", nf4.tolist())
    print("map.nf4_constructed :", hexs(nf4c))
    same = np.array_equal(nf4.numpy().view(np.uint32), nf4c.numpy().view(np.uint32))
    print(f"nf4 == nf4_constructed bit for bit: {same}")
    if not same:
        d = np.nonzero(nf4.numpy().view(np.uint32) != nf4c.numpy().view(np.uint32))[0]
        for i in d:
            ulps = int(nf4c.numpy().view(np.int32)[i]) - int(nf4.numpy().view(np.int32)[i])
            print(f"   index {i}: nf4 {nf4[i].item()!r} constructed {nf4c[i].item()!r} ({ulps:+d} ulp)")
    print("map.linear_signed8  :")
    h = lin.numpy().view(np.uint32)
    for r in range(0, 256, 8):
        print("   " + " ".join(f"{b:08x}" for b in h[r : r + 8]))
    print(f"   zeros at {np.nonzero(lin.numpy() == 0)[0].tolist()}, entries 126..129 = {lin[126:130].tolist()}")

    metadata = {
        "bitsandbytes": versions["bitsandbytes"],
        "torch": versions["torch"],
        "numpy": versions["numpy"],
        "scipy": versions["scipy"],
        "safetensors": versions["safetensors"],
        "seed": str(SEED),
        "torch_cpu_capability": capability,
        "generator": "gen_torch_casts.py",
        "note": "*_rne = torch CPU x.to(dtype); *_decode = uint8 codes viewed as float8, .float(); maps from bnb",
    }
    write_safetensors(OUT, tensors, metadata)
    print(f"\nwrote {OUT.name}: {OUT.stat().st_size} bytes, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
