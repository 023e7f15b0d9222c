#!/usr/bin/env bash
# Public functions per crate, from rustdoc's JSON (a nightly toolchain: `rustup toolchain install
# nightly`). Usage, from the repository root: bash xtask/api/run.sh OUT_DIR; then
# python3 xtask/api/count.py OUT_DIR [OTHER_OUT_DIR] (two directories: the change per crate and,
# for lpmm-optim, per type). Counted: free `pub fn`s and `pub` inherent methods reachable from the
# crate's public API (trait declarations and trait impls are not).
set -euo pipefail
out=$1
mkdir -p "$out"
target=${CARGO_TARGET_DIR:-target/api-nightly}
for c in lpmm-formats lpmm-quant lpmm-optim lpmm-backend lpmm-act lpmm-wgpu lpmm-cuda lpmm-candle \
  lpmm-dist lpmm-burn lpmm-act-burn lpmm; do
  [ -d "crates/$c" ] || continue
  CARGO_TARGET_DIR=$target cargo +nightly rustdoc -q -p "$c" --lib -- -Z unstable-options --output-format json
  cp "$target/doc/${c//-/_}.json" "$out/$c.json"
done
