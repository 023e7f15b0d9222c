#!/usr/bin/env bash
# The one-call GPU check of the specialized steps (issue 42's device measurements), run from the
# repository root on the GPU machine with what prepare.sh staged (.gpu, .gl, .whl carried):
#
#   run(command: "bash crates/lpmm-cuda/gpu/run.sh", carry: [".gpu", ".gl", ".whl"], timeout_s: 600)
#
# Writes under $OUT (at most 8 files): log.txt (everything), bandwidth.json (`bandwidth`: 8-bit
# and 4-bit AdamW, LPMM-SGDM, 8-bit Lion, f32 AdamW at 1e6-1e9, each beside a device copy),
# bandwidth_generic.json (8-bit AdamW at 1e8 and 1e9, the generic kernel beside the specialized),
# many.json (8-bit AdamW over 10,000 tensors of 4096 to 2^20 elements),
# peers.json (torch's fused AdamW f32/bf16, torchao's AdamW8bit/4bit, bitsandbytes' AdamW8bit,
# and torch's fused AdamW over the same 10,000 tensors), conformance.txt (lpmm-cuda's parity
# suite with LPMM_REQUIRE_CUDA=1: every preset on the GPU against the CPU, specialized steps on),
# wgpu.txt (the first step on NVIDIA's Vulkan driver, specialized and generic, driver cache off),
# ncu.txt (one profile of the 8-bit AdamW specialized step at 1e8).
# Each stage has its own time limit, all of them within 500 s (the setup before them takes
# seconds), most important first; a stage that fails or runs out is reported and the others still
# run (the JSON files are written after every row). Rerunnable: it writes nothing in the checkout.
set -u
OUT=${OUT:?run on the device machine, which sets OUT}
exec > >(tee "$OUT/log.txt") 2>&1
start=$(date +%s)
budget=${LPMM_GPU_BUDGET_S:-500}
bin=.gpu/bin

# Runs a stage with at most `cap` seconds, less where the budget has less left.
stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((budget - ($(date +%s) - start)))
  local limit=$((cap < left ? cap : left))
  echo
  echo "=== $name (limit ${limit} s; $(($(date +%s) - start)) s in) ==="
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

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
for b in parity bandwidth first_step; do
  [ -x "$bin/$b" ] || echo "MISSING $bin/$b: run crates/lpmm-cuda/gpu/prepare.sh first and carry .gpu"
done
if ls .gl/*.deb >/dev/null 2>&1; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1

# 1. lpmm's steps against a device copy (the targets: 8-bit AdamW >= 50% of copy at 1e8 and 1e9;
#    4-bit and LPMM-SGDM >= 45%), then 8-bit AdamW with the generic kernel beside them.
stage bandwidth 150 "$bin/bandwidth" --params 1e9,1e8,1e7,1e6 --iters 20 \
  --json "$OUT/bandwidth.json"
stage "bandwidth, generic beside specialized" 45 "$bin/bandwidth" --params 1e8,1e9 --cases adamw8 \
  --generic --iters 10 --json "$OUT/bandwidth_generic.json"
# 2. Many small tensors (target: <= 1.2x torch's multi-tensor fused AdamW).
stage "many tensors" 50 "$bin/bandwidth" --params 0 --many 10000 --cases adamw8 \
  --iters 10 --json "$OUT/many.json"
# 3. The peers: the largest sizes first, then torch's fused AdamW over the same 10,000 tensors.
stage peers 120 python3 crates/lpmm-cuda/examples/peers_cuda.py --sizes 1e9,1e8 \
  --many 10000 --iters 20 --out "$OUT/peers.json"
# 4. The conformance suite on the GPU (and its emulated half), specialized steps on.
stage conformance 70 env LPMM_REQUIRE_CUDA=1 "$bin/parity" --test-threads 8 >"$OUT/conformance.txt" 2>&1
tail -n 5 "$OUT/conformance.txt"
# 5. wgpu's first step on NVIDIA's Vulkan driver, its shader cache off (a cold start).
[ -e /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] &&
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
{
  stage "wgpu first step, specialized" 45 env __GL_SHADER_DISK_CACHE=0 "$bin/first_step"
  stage "wgpu first step, generic" 45 env __GL_SHADER_DISK_CACHE=0 "$bin/first_step" generic
} >"$OUT/wgpu.txt" 2>&1
cat "$OUT/wgpu.txt"
# 6. One profile of the best kernel (the 8-bit AdamW step at 1e8; the warm-up step is skipped).
if command -v ncu >/dev/null; then
  stage ncu 45 ncu --kernel-name 'regex:^lpmm_plan_adamw_8bit_bf16_acc$' --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
    --section WarpStateStats --section InstructionStats --clock-control none \
    "$bin/bandwidth" --params 1e8 --cases adamw8 --iters 2 >"$OUT/ncu.txt" 2>&1
  tail -n 40 "$OUT/ncu.txt"
else
  echo "no ncu on PATH" | tee "$OUT/ncu.txt"
fi
echo
echo "done in $(($(date +%s) - start)) s"
