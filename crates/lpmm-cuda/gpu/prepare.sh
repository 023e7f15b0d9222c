#!/usr/bin/env bash
# Prepares the one-call GPU check of the specialized steps (run.sh, beside this file), on a
# machine without a GPU: the GPU machine has no Rust toolchain and reaches no registry, so this
# builds what run.sh runs and stages it in ignored folders that the call carries.
#
#   crates/lpmm-cuda/gpu/prepare.sh [--no-wheels]
#
# - .gpu/bin/: the release binaries, stripped: lpmm-cuda's conformance test (tests/parity.rs, the
#   GPU half included when a device is present) and its `bandwidth` example.
# - .gpu/static.json: the specialized steps' static figures (`cargo xtask kernels --json`: fast-path
#   SASS instructions per element of every plan on sm_80 and sm_90, from the committed PTX and
#   the pinned CUDA wheels, which LPMM_CUDA_WHEELS or python3 must find), from which
#   calibrate.py turns the measured times into the issue-rate model's rate.
# - .whl/: the torchao wheel for Python 3.12 (the image has torch, not torchao), if it fits the
#   call's 64 MiB with the working tree; run.sh reports a peer it lacks.
#
# Then, from the repository root, one call of the device tool (about 8 minutes of GPU time):
#   run(command: "bash crates/lpmm-cuda/gpu/run.sh", carry: [".gpu", ".whl"], timeout_s: 600)
# and, without a device, the same script's dry run: OUT=/tmp/gpu-dry bash crates/lpmm-cuda/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
wheels=1
[ "${1:-}" = "--no-wheels" ] && wheels=0

mkdir -p .gpu/bin
# The test binary's path comes from cargo's JSON messages (its name carries a hash).
artifact() {
  python3 -c '
import json, sys
want = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == want and m.get("executable"):
        print(m["executable"])
' "$1"
}
parity=$(cargo test --release --locked -p lpmm-cuda --test parity --no-run --message-format=json-render-diagnostics | artifact parity)
bandwidth=$(cargo build --release --locked -p lpmm-cuda --example bandwidth --message-format=json-render-diagnostics | artifact bandwidth)
for b in "$parity" "$bandwidth"; do
  [ -x "$b" ] || { echo "no binary built: $b" >&2; exit 1; }
done
cp "$parity" .gpu/bin/parity
cp "$bandwidth" .gpu/bin/bandwidth
strip .gpu/bin/*
cargo xtask kernels --check --json .gpu/static.json

size() { du -sk "$@" 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'; }
if [ "$wheels" = 1 ]; then
  mkdir -p .whl
  platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
  for w in torchao==0.18.0; do
    dir=$(mktemp -d)
    # shellcheck disable=SC2086
    if python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp $platforms -d "$dir" "$w"; then
      tree=$(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1)
      total=$((tree + $(size .gpu .whl) + $(size "$dir")))
      if [ "$total" -lt $((62 * 1024)) ]; then
        mv "$dir"/*.whl .whl/
      else
        echo "$w left out: the call would carry ${total} KiB (limit 64 MiB)" >&2
      fi
    else
      echo "$w: no wheel downloaded" >&2
    fi
    rm -rf "$dir"
  done
fi
tree=$(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1)
echo "staged: $(ls .gpu/bin | tr '\n' ' ')| $(ls .gpu/static.json) | $(ls .whl 2>/dev/null | tr '\n' ' ')"
echo "the call carries about $(( (tree + $(size .gpu .whl)) / 1024 )) MiB (limit 64)"
echo 'run(command: "bash crates/lpmm-cuda/gpu/run.sh", carry: [".gpu", ".whl"], timeout_s: 600)'
