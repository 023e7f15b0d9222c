#!/usr/bin/env bash
# The one-call GPU check of the specialized steps (issue 57: the instruction budgets' device
# figures), run from the repository root on the GPU machine with what prepare.sh staged (.gpu,
# .gl, .whl carried):
#
#   run(command: "bash crates/lpmm-cuda/gpu/run.sh", carry: [".gpu", ".gl", ".whl"], timeout_s: 600)
#
# Writes under $OUT (at most 8 files): log.txt (everything); bandwidth.json (`bandwidth`: the
# budgeted kernels, 8-bit AdamW with nearest and stochastic rounding, 4-bit AdamW, LPMM-SGDM,
# 8-bit Lion, f32 AdamW, at 1e9, 1e8, 1e7 and 1e6 parameters, each beside a device-to-device copy
# of its bytes); peers.json (torch's fused AdamW with f32 and bf16 parameters and torchao's
# AdamW8bit at the same sizes, each beside a copy); calibration.json (calibrate.py: each case's
# warp instructions per step from the static counts, .gpu/static.json, the measured rate of
# warp instructions per second that recalibrates the issue-rate model, and each kernel's ratio
# to torch's fused f32 AdamW); conformance.txt (lpmm-cuda's parity suite on the GPU against the
# CPU, specialized steps on); ncu.txt (one profile of the 8-bit AdamW step at 1e8: issued IPC).
#
# Without a device (no nvidia-smi, or it lists no GPU; or LPMM_GPU_DRY=1) every GPU stage prints
# "skipped: no device" and calibration.json is still written, its figures null: a dry run checks
# the script end to end on a machine without a GPU (OUT=/tmp/gpu-dry bash .../run.sh).
#
# Each stage has its own time limit, all of them within 500 s (the setup before them takes
# seconds), most important first; a stage that fails or runs out is reported and the others still
# run (the JSON files are written after every row). Rerunnable: it writes nothing in the checkout.
set -u
OUT=${OUT:?run on the device machine, which sets OUT}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
start=$(date +%s)
budget=${LPMM_GPU_BUDGET_S:-500}
bin=.gpu/bin
here=crates/lpmm-cuda/gpu

device=1
if [ "${LPMM_GPU_DRY:-0}" = 1 ] || ! command -v nvidia-smi >/dev/null ||
  ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  device=0
fi

# Runs a stage with at most `cap` seconds, less where the budget has less left; without a
# device, a GPU stage (`gpu` first) is skipped.
stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((budget - ($(date +%s) - start)))
  local limit=$((cap < left ? cap : left))
  echo
  echo "=== $name (limit ${limit} s; $(($(date +%s) - start)) s in) ==="
  if [ "$1" = gpu ]; then
    shift
    if [ "$device" = 0 ]; then
      echo "skipped: no device"
      return 0
    fi
  fi
  if [ "$limit" -le 5 ]; then
    echo "SKIPPED: no time left"
    return 0
  fi
  local t0
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $(($(date +%s) - t0)) s$([ $rc -eq 124 ] && echo ' (TIMED OUT)') ==="
  return 0
}

if [ "$device" = 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
else
  echo "no device: a dry run (every GPU stage skipped, the results' skeleton written)"
fi
for b in parity bandwidth; do
  [ -x "$bin/$b" ] || echo "MISSING $bin/$b: run crates/lpmm-cuda/gpu/prepare.sh first and carry .gpu"
done
[ -s .gpu/static.json ] || echo "MISSING .gpu/static.json: prepare.sh writes it (cargo xtask kernels --json)"
if [ "$device" = 1 ] && ls .gl/*.deb >/dev/null 2>&1; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if [ "$device" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1

# 1. The budgeted kernels against a device copy, the largest sizes first.
stage bandwidth 170 gpu "$bin/bandwidth" --params 1e9,1e8,1e7,1e6 \
  --cases adamw8,adamw8sr,adamw4,sgdm,lion8,adamw32 --iters 20 --json "$OUT/bandwidth.json"
# 2. The peers at the same sizes: torch's fused AdamW (f32 and bf16 parameters), torchao's
#    AdamW8bit.
stage peers 130 gpu python3 crates/lpmm-cuda/examples/peers_cuda.py --sizes 1e9,1e8,1e7,1e6 \
  --peers torch_fused_adamw_f32,torch_fused_adamw_bf16,torchao_adamw8bit_bf16 --iters 20 \
  --out "$OUT/peers.json"
# 3. The model's calibration: the measured rate of warp instructions per second (runs without a
#    device too: the skeleton).
status=measured
[ "$device" = 0 ] && status="skipped: no device"
stage calibration 20 python3 "$here/calibrate.py" --static .gpu/static.json \
  --bandwidth "$OUT/bandwidth.json" --peers "$OUT/peers.json" --status "$status" \
  --out "$OUT/calibration.json"
# 4. The conformance suite on the GPU (and its emulated half), specialized steps on.
if [ "$device" = 1 ]; then
  stage conformance 80 gpu env LPMM_REQUIRE_CUDA=1 "$bin/parity" --test-threads 8 >"$OUT/conformance.txt" 2>&1
  tail -n 5 "$OUT/conformance.txt"
else
  stage conformance 80 gpu true
fi
# 5. One profile of the 8-bit AdamW step at 1e8 (the warm-up step is skipped): issued IPC, the
#    model's other constant.
if [ "$device" = 1 ] && command -v ncu >/dev/null; then
  stage ncu 60 gpu ncu --kernel-name 'regex:^lpmm_plan_adamw_8bit_bf16_acc$' --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section InstructionStats --section Occupancy --section WarpStateStats --clock-control none \
    "$bin/bandwidth" --params 1e8 --cases adamw8 --iters 2 >"$OUT/ncu.txt" 2>&1
  tail -n 40 "$OUT/ncu.txt"
elif [ "$device" = 1 ]; then
  echo "no ncu on PATH" | tee "$OUT/ncu.txt"
else
  stage ncu 60 gpu true
fi
echo
echo "done in $(($(date +%s) - start)) s"
