#!/usr/bin/env python3
"""Public functions per crate in rustdoc JSON files (xtask/api/run.sh): free `pub fn`s and `pub`
inherent methods. With two directories, the change per crate and, for lpmm-optim, per type."""
import collections
import glob
import json
import os
import sys


def functions(path):
    """{owner type (or "(free fn)"): count} of one crate's public functions."""
    d = json.load(open(path))
    owner = {}
    for it in d["index"].values():
        imp = it.get("inner", {}).get("impl")
        if imp is None or imp.get("trait") is not None:
            continue
        name = imp.get("for", {}).get("resolved_path", {}).get("path", "?").split("::")[-1]
        for fid in imp.get("items", []):
            owner[str(fid)] = name
    counts = collections.Counter()
    for iid, it in d["index"].items():
        if it.get("crate_id") == 0 and "function" in it.get("inner", {}) and it.get("visibility") == "public":
            counts[owner.get(iid, "(free fn)")] += 1
    return counts


def crates(directory):
    return {os.path.basename(p)[:-5]: functions(p) for p in sorted(glob.glob(f"{directory}/*.json"))}


if len(sys.argv) == 2:
    for name, c in crates(sys.argv[1]).items():
        print(f"{name:15} {sum(c.values()):5}")
else:
    before, after = crates(sys.argv[1]), crates(sys.argv[2])
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name, collections.Counter()), after.get(name, collections.Counter())
        print(f"{name:15} {sum(b.values()):5} -> {sum(a.values()):5}")
    b, a = before["lpmm-optim"], after["lpmm-optim"]
    print("\nlpmm-optim by type (changed ones):")
    for k in sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k])):
        if a[k] != b[k]:
            print(f"  {k:20} {b[k]:4} -> {a[k]:4}")
