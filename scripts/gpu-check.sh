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

# ---- Checks of other subsystems: add a function here and its name to CHECKS below. ----------
# check_adam_gpu()   { ... }   # GPU Adam kernel vs CPU Adam
# check_gpt_kernels(){ ... }   # GPT CUDA kernels vs CPU kernels (their gtests carry label gpu)
# check_train_cuda() { ... }   # tiermem-train --device cuda, a few steps, loss decreases

CHECKS=(check_gpu_tests "check_copy_bench h2d" "check_copy_bench d2h" check_pipeline_bench)

start=$(date +%s)
if check_build; then
  for c in "${CHECKS[@]}"; do $c; done
fi
echo
echo "==== gpu-check summary ($(( $(date +%s) - start )) s, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)) ===="
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
