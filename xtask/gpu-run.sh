#!/usr/bin/env bash
# Runs the GPU bundle (`cargo xtask gpu-bundle`: xtask/src/gpu_bundle.rs) on a GPU machine without
# a Rust toolchain: every GPU test binary, then the GPT example's memory and quality runs.
# Everything it writes goes under $OUT (default: ./gpu-out); summary.txt lists each step's exit
# status and seconds.
#
#   bash xtask/gpu-run.sh target/gpu-bundle/bundle.tar.xz
#
# Libraries: the binaries link libcuda.so.1 (the driver's), and CUDA 13's libcudart, libcublas,
# libcublasLt, libcurand, libnvrtc and libnccl, found in PyTorch's site-packages (`nvidia/cu13/lib`,
# `nvidia/nccl/lib`) of the first python3 that imports torch, or in LPMM_CUDA_LIBS (a
# colon-separated list of directories). burn's CUDA backend compiles its kernels with NVRTC and
# the CUDA headers under CUDA_PATH: site-packages' `nvidia/cu13` where it has them, else the
# bundle's copy.
#
# Time (one device call: under 9 minutes in all): each step has its own limit, and the GPT quality
# run gets what is left of GPU_RUN_BUDGET_S (default 500 s) when it starts. Knobs:
# GPT_MEMORY_ARGS, GPT_QUALITY_STEPS (default 600), GPT_QUALITY_PARALLEL (default 7),
# GPT_QUALITY_ARGS, GPU_RUN_SKIP (space-separated step names to skip).
#
# Without a device (no nvidia-smi, or it lists no GPU; or LPMM_GPU_DRY=1) it is a dry run: every
# GPU step writes "skipped: no device" to its log and the summary, and the results' skeleton
# (summary.txt, nvidia-smi.txt, libraries.txt, one log per step) is still written; the bundle may
# then be left out (`bash xtask/gpu-run.sh`), and where it is given, each step's binary is checked
# to be in it. CI runs the dry run.
set -uo pipefail

dry=0
if [ "${LPMM_GPU_DRY:-0}" = 1 ] || ! command -v nvidia-smi >/dev/null ||
  ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  dry=1
fi
bundle=${1:-}
if [ -z "$bundle" ] && [ "$dry" = 0 ]; then
  echo "usage: gpu-run.sh BUNDLE.tar.xz" >&2
  exit 2
fi
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
start=$(date +%s)
budget=${GPU_RUN_BUDGET_S:-500}
work=$(mktemp -d)
mkdir -p "$work/bin"
if [ -n "$bundle" ]; then
  tar -xJf "$bundle" -C "$work" || { echo "cannot unpack $bundle" >&2; exit 1; }
  cp "$work/manifest.txt" "$OUT/manifest.txt"
fi
summary="$OUT/summary.txt"
: >"$summary"
[ "$dry" = 1 ] && echo "no device: a dry run (every GPU step skipped, the results' skeleton written)" | tee -a "$summary"

# The machine.
{ nvidia-smi || true; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true; } >"$OUT/nvidia-smi.txt" 2>&1

# Libraries and headers.
libs=${LPMM_CUDA_LIBS:-}
site=""
for py in python3 python; do
  if site=$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null); then
    break
  fi
  site=""
done
if [ -n "$site" ]; then
  for d in "$site"/nvidia/cu13/lib "$site"/nvidia/nccl/lib "$site"/nvidia/*/lib; do
    [ -d "$d" ] && libs="${libs:+$libs:}$d"
  done
fi
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -n "$site" ] && [ -f "$site/nvidia/cu13/include/cuda_fp16.h" ]; then
  export CUDA_PATH="$site/nvidia/cu13"
else
  export CUDA_PATH="$work"
fi
{
  echo "torch site-packages: ${site:-none}"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "CUDA_PATH=$CUDA_PATH"
  for b in "$work"/bin/*; do
    echo "== $(basename "$b")"
    ldd "$b" | grep -E 'cuda|cublas|curand|nvrtc|nccl|not found'
  done
} >"$OUT/libraries.txt" 2>&1

export LPMM_REQUIRE_CUDA=1 LPMM_REQUIRE_NCCL=1 RUST_BACKTRACE=1

skip() { case " ${GPU_RUN_SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }

# step NAME LIMIT_S COMMAND...: runs COMMAND with a time limit, its output in $OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  if skip "$name"; then
    echo "$name skipped" >>"$summary"
    return
  fi
  local t0 rc
  t0=$(date +%s)
  echo "== $name (limit ${limit}s): $*" >&2
  if [ "$dry" = 1 ]; then
    if [ -n "$bundle" ] && [ ! -x "$1" ]; then
      echo "$name MISSING $1 in the bundle" | tee -a "$summary" >&2
      echo "MISSING $1" >"$OUT/$name.log"
      return
    fi
    echo "skipped: no device" >"$OUT/$name.log"
    echo "$name skipped: no device" | tee -a "$summary" >&2
    return
  fi
  timeout --signal=KILL "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc seconds=$(($(date +%s) - t0))" | tee -a "$summary" >&2
  tail -n 3 "$OUT/$name.log" >&2
}

bin=$work/bin
step lpmm-cuda-parity 90 "$bin/lpmm-cuda-parity" --test-threads=1
step lpmm-candle-cuda 90 "$bin/lpmm-candle-cuda" --test-threads=1
step lpmm-burn-cuda 150 "$bin/lpmm-burn-burn" --test-threads=1 cuda::
step lpmm-dist-nccl 60 "$bin/lpmm-dist-nccl" --test-threads=1
# shellcheck disable=SC2086 # the knobs are word lists
step gpt-memory 180 "$bin/lpmm-candle-examples-gpt" --device cuda --size full --mode memory \
  --json "$OUT/gpt-memory.json" ${GPT_MEMORY_ARGS:-}
left=$((budget - ($(date +%s) - start)))
if [ "$left" -lt 60 ]; then left=60; fi
# shellcheck disable=SC2086
step gpt-quality "$left" "$bin/lpmm-candle-examples-gpt" --device cuda --size full --mode quality \
  --steps "${GPT_QUALITY_STEPS:-600}" --parallel "${GPT_QUALITY_PARALLEL:-7}" \
  --json "$OUT/gpt-quality.json" ${GPT_QUALITY_ARGS:-}
echo "total seconds=$(($(date +%s) - start))" | tee -a "$summary"
rm -rf "$work"
