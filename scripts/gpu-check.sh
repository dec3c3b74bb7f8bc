#!/usr/bin/env bash
# gpu-check.sh — the GPU machine's one-call check (< 8 minutes): build with CUDA (preset cuda),
# run the GPU tests (ctest -L gpu) and tiermem-bench h2d / d2h / pipeline on the GPU, print one
# summary. Other subsystems append their checks as functions below (see "Checks of other
# subsystems") and list them in CHECKS.
#
#   scripts/gpu-check.sh            # from the repository root; exit status 0 when all passed
#   BUILD_DIR=build/cuda JOBS=16 scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build/cuda}
JOBS=${JOBS:-$(nproc)}
BENCH=$BUILD_DIR/bench/tiermem-bench
NVME_DIR=${NVME_DIR:-/tmp}
declare -a SUMMARY=()
FAILED=0

record() {  # record <name> <status> <detail>
  SUMMARY+=("$(printf '%-28s %-5s %s' "$1" "$2" "$3")")
  [[ $2 == ok ]] || FAILED=1
}
last_json() { grep '^{' "$1" | tail -1; }
field() { python3 -c "import json,sys; d=json.loads(sys.argv[1]); print(d.get(sys.argv[2], ''))" "$1" "$2" 2>/dev/null; }

check_build() {
  if cmake --preset cuda >/tmp/gpu-check-configure.log 2>&1 &&
     cmake --build --preset cuda -j "$JOBS" >/tmp/gpu-check-build.log 2>&1; then
    record build ok "$BUILD_DIR"
  else
    record build FAIL "see /tmp/gpu-check-configure.log /tmp/gpu-check-build.log"
    tail -30 /tmp/gpu-check-build.log /tmp/gpu-check-configure.log 2>/dev/null
    return 1
  fi
}

check_gpu_tests() {
  if (cd "$BUILD_DIR" && timeout 300 ctest -L gpu --output-on-failure >/tmp/gpu-check-ctest.log 2>&1); then
    record "ctest -L gpu" ok "$(grep -E 'tests passed' /tmp/gpu-check-ctest.log | tail -1)"
  else
    record "ctest -L gpu" FAIL "$(grep -E 'tests passed|Failed' /tmp/gpu-check-ctest.log | tail -1)"
  fi
  if grep -q "no CUDA device" /tmp/gpu-check-ctest.log; then
    record "gpu tests ran" FAIL "some tests skipped with 'no CUDA device'"
  fi
}

check_copy_bench() {  # h2d | d2h
  local out=/tmp/gpu-check-$1.log
  if timeout 120 "$BENCH" "$1" --device cuda --max-size 1G --reps 3 --json >"$out" 2>&1; then
    record "bench $1" ok "pinned $(field "$(last_json "$out")" gbps) GB/s at 1 GiB"
  else
    record "bench $1" FAIL "$(tail -1 "$out")"
  fi
}

check_pipeline_bench() {
  local out=/tmp/gpu-check-pipeline.log
  if timeout 180 "$BENCH" pipeline --device cuda --path "$NVME_DIR" --tensor-size 64M --tensors 4 --reps 3 --json >"$out" 2>&1; then
    local j; j=$(last_json "$out")
    local r; r=$(field "$j" ratio_to_slowest_stage)
    local status=ok
    python3 -c "import sys; sys.exit(0 if float('$r') >= 0.9 else 1)" || status=FAIL
    record "bench pipeline" "$status" "$(field "$j" gbps) GB/s, ratio_to_slowest_stage $r ($(field "$j" slowest_stage)), write ratio $(field "$j" write_ratio_to_slowest_stage)"
  else
    record "bench pipeline" FAIL "$(tail -1 "$out")"
  fi
}

# ---- Checks of other subsystems. The GPU Adam kernel (gpu_adam_test) and the GPT CUDA kernels
# (gpt_cuda_test) are gtests with label gpu, so check_gpu_tests runs them. ----------------------

# tiermem-train with the CUDA device: parameters + optimizer state paged through NVMe and host
# into a device budget 8x smaller (the default), then the same with everything resident.
# The GPT model computes on the CPU (its CUDA kernels are tested separately), so this checks the
# CUDA device tier under the trainer, and reports tokens/s of both runs.
check_train_cuda() {
  local train=$BUILD_DIR/examples/gpt/tiermem-train out=/tmp/gpu-check-train.log
  local swap; swap=$(mktemp -d "$NVME_DIR/tiermem-gpu-check.XXXX")
  if timeout 240 "$train" --device cuda --model mini --steps 20 --swap-dir "$swap" --json >"$out" 2>&1; then
    local j; j=$(last_json "$out")
    local s; s=$(python3 -c "import json,sys; d=json.loads(sys.argv[1])['summary']; print(d['initial_loss'], d['final_loss'], d['device_peak_bytes'], d['device_budget_bytes'], d.get('tokens_per_s',''))" "$j" 2>/dev/null)
    read -r l0 l1 peak budget tps <<<"$s"
    local status=ok
    python3 -c "import sys; sys.exit(0 if float('$l1') < float('$l0') and int('$peak') <= int('$budget') else 1)" || status=FAIL
    record "train --device cuda" "$status" "loss $l0 -> $l1, device peak $peak <= budget $budget, $tps tok/s"
  else
    record "train --device cuda" FAIL "$(tail -1 "$out")"
  fi
  if timeout 240 "$train" --device cuda --model mini --steps 20 --offload none --json >"$out.resident" 2>&1; then
    record "train resident" ok "$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['summary'].get('tokens_per_s',''), 'tok/s')" "$(last_json "$out.resident")" 2>/dev/null)"
  else
    record "train resident" FAIL "$(tail -1 "$out.resident")"
  fi
  rm -rf "$swap"
}

CHECKS=(check_gpu_tests "check_copy_bench h2d" "check_copy_bench d2h" check_pipeline_bench check_train_cuda)

start=$(date +%s)
if check_build; then
  for c in "${CHECKS[@]}"; do $c; done
fi
echo
echo "==== gpu-check summary ($(( $(date +%s) - start )) s, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)) ===="
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
