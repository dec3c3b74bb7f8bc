#!/usr/bin/env bash
# scripts/gpu-check.sh without a GPU (the machines CI runs on): what it does when nvidia-smi finds
# none (one line, exit 3, nothing built), --probe-only with one, a bad argument (exit 2), and that
# a failed build still prints the whole table and valid JSON (exit 1), using fake nvidia-smi and
# cmake programs first on PATH. Never builds, never touches a GPU; about a second.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
mkdir -p "$T/nogpu" "$T/gpu"
printf '#!/bin/sh\necho "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver" >&2\nexit 9\n' >"$T/nogpu/nvidia-smi"
printf '#!/bin/sh\necho "NVIDIA H200"\n' >"$T/gpu/nvidia-smi"
printf '#!/bin/sh\necho "fake cmake: configure failed" >&2\nexit 1\n' >"$T/gpu/cmake"
chmod +x "$T"/*/*

# 1. No GPU: one line naming the reason, exit 3, nothing else.
out=$(PATH="$T/nogpu:$PATH" "$ROOT/scripts/gpu-check.sh" 2>&1); rc=$?
[[ $rc == 3 ]] || fail "no GPU: exit $rc, want 3: $out"
[[ $(printf '%s\n' "$out" | wc -l) == 1 ]] || fail "no GPU: not one line: $out"
[[ $out == *"no GPU on this machine"* ]] || fail "no GPU: message: $out"
[[ ! -e $T/out.json ]] || fail "no GPU: wrote JSON"

# 2. --probe-only with a GPU: one line, exit 0.
out=$(PATH="$T/gpu:$PATH" "$ROOT/scripts/gpu-check.sh" --probe-only 2>&1); rc=$?
[[ $rc == 0 && $out == "gpu-check: GPU present: NVIDIA H200" ]] || fail "probe: exit $rc: $out"

# 3. A bad argument: exit 2.
PATH="$T/nogpu:$PATH" "$ROOT/scripts/gpu-check.sh" --bogus >/dev/null 2>&1
[[ $? == 2 ]] || fail "bad argument: want exit 2"

# 4. A GPU, but the build fails: every later step is listed as skipped, JSON written, exit 1.
out=$(PATH="$T/gpu:$PATH" BUILD_DIR="$T/build" OUT_JSON="$T/out.json" LOG_DIR="$T/logs" \
      BUDGET_S=60 "$ROOT/scripts/gpu-check.sh" 2>&1); rc=$?
[[ $rc == 1 ]] || fail "failed build: exit $rc, want 1: $out"
[[ $out == *"==== gpu-check: NVIDIA H200"* ]] || fail "failed build: no table: $out"
for row in build "gpu unit tests" "bench h2d" "bench d2h" "bench gemm" "bench pipeline" "train gpt2" offload overlap \
           "tiermem.torch on CUDA"; do
  printf '%s\n' "$out" | grep -q "^$row " || fail "failed build: no row '$row': $out"
done
[[ $(printf '%s\n' "$out" | grep -c ' SKIP ') == 9 ]] || fail "failed build: want 9 SKIP rows: $out"
[[ -s $T/out.json ]] || fail "failed build: no JSON"
if command -v python3 >/dev/null; then
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
assert d['gpu'] == 'NVIDIA H200' and d['failed'] == 1, d
assert [c['status'] for c in d['checks']] == ['FAIL'] + ['SKIP'] * 9, d
assert 'fake cmake' in d['checks'][0]['detail'], d
" "$T/out.json" || fail "failed build: bad JSON: $(cat "$T/out.json")"
fi
# 5. A GPU and a build whose programs (fakes here) print what the real ones do: every check's
#    output is parsed, the table is all ok, the JSON carries the figures, exit 0. Then a CUDA loss
#    curve that strays from the CPU's fails its row (exit 1).
FB=$T/fakebuild
mkdir -p "$FB/bin" "$T/gpu2"
cp "$T/gpu/nvidia-smi" "$T/gpu2/"
printf '#!/bin/sh
exit 0
' >"$T/gpu2/cmake"
printf '#!/bin/sh
echo "[       OK ] GptCuda.CudaBackendMatchesCpuBackend (5 ms)"
echo "100%% tests passed, 0 tests failed out of 3"
' >"$T/gpu2/ctest"
cat >"$FB/bin/tiermem-bench" <<'FAKE'
#!/bin/sh
case $1 in
  h2d|d2h) echo "{\"bench\":\"$1\",\"gbps\":50.5,\"cudamemcpy_gbps\":52.0,\"ratio_to_cudamemcpy\":0.971}" ;;
  gemm) echo '{"bench":"gemm","tflops":702.3}' ;;
  pipeline) echo '{"bench":"pipeline","gbps":11.2,"ratio_to_slowest_stage":0.95,"slowest_stage":"nvme_read","slowest_stage_gbps":11.8,"write_ratio_to_slowest_stage":0.93}' ;;
  train-offload) echo '{"bench":"train-offload","resident_step_s":0.05,"io_only_step_s":0.4,"offloaded_step_s":0.42,"overlap_efficiency":0.9523}' ;;
esac
FAKE
cat >"$FB/bin/tiermem-train" <<'FAKE'
#!/bin/sh
steps=2; shift_=0
while [ $# -gt 0 ]; do
  case $1 in --steps) steps=$2 ;; --device) [ "$2" = cuda ] && shift_=${FAKE_LOSS_SHIFT:-0.001} ;; esac
  shift
done
i=1
while [ $i -le $steps ]; do
  echo "{\"step\":$i,\"loss\":$(echo "5.5 - 0.1 * $i + $shift_" | bc -l)}"
  i=$((i + 1))
done
echo '{"summary":{"gflops":123456.0,"tokens_per_s":50000.0,"stall_seconds":1.5,"seconds":10.0}}'
FAKE
# A Python with a CUDA torch, as step 7 asks of it: the probe, pip and pytest.
cat >"$T/gpu2/fakepy" <<'FAKE'
#!/bin/sh
case "$1 $2" in
  "-m pytest") echo "test_torch_cuda.py ...."; echo "4 passed in 12.3s" ;;
esac
exit 0
FAKE
chmod +x "$T"/gpu2/* "$FB/bin/tiermem-bench" "$FB/bin/tiermem-train"
if command -v bc >/dev/null && command -v python3 >/dev/null; then
  out=$(PATH="$T/gpu2:$PATH" BUILD_DIR="$FB" OUT_JSON="$T/ok.json" LOG_DIR="$T/logs2" NVME_DIR="$T" \
        TORCH_PYTHON="$T/gpu2/fakepy" BUDGET_S=120 "$ROOT/scripts/gpu-check.sh" 2>&1); rc=$?
  [[ $rc == 0 ]] || fail "all ok: exit $rc: $out"
  [[ $(printf '%s\n' "$out" | grep -cE ' (FAIL|SKIP|TIMEOUT) ') == 0 ]] || fail "all ok: a row failed: $out"
  [[ $out == *"0.971 (ok >= 0.9)"* && $out == *"702.3 TFLOP/s"* && $out == *"ratio to slowest stage 0.95"* ]] \
    || fail "all ok: figures missing: $out"
  [[ $out == *"123.46 TFLOP/s, 0.18 of the GEMM peak"* && $out == *"stall 15.0 %"* ]] \
    || fail "all ok: train figures missing: $out"
  [[ $out == *"overlap efficiency 0.952 (goal >= 0.9, reported)"* ]] || fail "all ok: overlap figure missing: $out"
  printf '%s\n' "$out" | grep -E '^tiermem.torch on CUDA \(pytest\) +ok .*4 passed' >/dev/null \
    || fail "all ok: no torch row: $out"
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
assert d['failed'] == 0 and all(c['status'] == 'ok' for c in d['checks']), d
m = {c['name'].split(' (')[0]: c['metrics'] for c in d['checks']}
assert m['bench gemm']['tflops'] == 702.3 and m['train gpt2 --device cuda']['tflops'] == 123.46, m
assert m['bench train-offload gpt2']['overlap_efficiency'] == 0.952, m
" "$T/ok.json" || fail "all ok: bad JSON: $(cat "$T/ok.json")"
  out=$(PATH="$T/gpu2:$PATH" FAKE_LOSS_SHIFT=0.5 BUILD_DIR="$FB" OUT_JSON="$T/bad.json" LOG_DIR="$T/logs3" \
        NVME_DIR="$T" TORCH_PYTHON=/nonexistent/python BUDGET_S=120 "$ROOT/scripts/gpu-check.sh" 2>&1); rc=$?
  [[ $rc == 1 ]] || fail "stray loss curve: exit $rc: $out"
  printf '%s\n' "$out" | grep -E '^train gpt2 --device cuda +FAIL .*max \|diff\| 0.5000' >/dev/null \
    || fail "stray loss curve: no failed row: $out"
  # No Python with a CUDA torch: the torch row says SKIP and why (not ok: nothing was checked).
  printf '%s\n' "$out" | grep -E '^tiermem.torch on CUDA \(pytest\) +SKIP .*no Python with a CUDA-enabled torch' \
    >/dev/null || fail "no CUDA torch: no SKIP row: $out"
  # 6. PREBUILT=1: the build made elsewhere is used as it is (the failing fake cmake is never
  #    called); without ctest's files it is refused; the torch row says why it is not run.
  out=$(PATH="$T/gpu:$PATH" PREBUILT=1 BUILD_DIR="$FB" OUT_JSON="$T/pre0.json" LOG_DIR="$T/logs4" \
        NVME_DIR="$T" BUDGET_S=60 "$ROOT/scripts/gpu-check.sh" 2>&1); rc=$?
  [[ $rc == 1 ]] || fail "prebuilt without CTestTestfile: exit $rc: $out"
  printf '%s\n' "$out" | grep -E '^build +FAIL .*PREBUILT=1 but .* lacks CTestTestfile.cmake' >/dev/null \
    || fail "prebuilt without CTestTestfile: no failed build row: $out"
  touch "$FB/CTestTestfile.cmake"
  cp "$T/gpu2/ctest" "$T/gpu/ctest"
  out=$(PATH="$T/gpu:$PATH" PREBUILT=1 BUILD_DIR="$FB" OUT_JSON="$T/pre.json" LOG_DIR="$T/logs5" \
        NVME_DIR="$T" BUDGET_S=120 "$ROOT/scripts/gpu-check.sh" 2>&1); rc=$?
  [[ $rc == 1 ]] || fail "prebuilt: exit $rc (want 1: the torch row is a SKIP): $out"
  printf '%s\n' "$out" | grep -E '^build +ok .*prebuilt' >/dev/null || fail "prebuilt: no ok build row: $out"
  [[ $(printf '%s\n' "$out" | grep -cE ' (FAIL|TIMEOUT) ') == 0 ]] || fail "prebuilt: a row failed: $out"
  printf '%s\n' "$out" | grep -E '^tiermem.torch on CUDA \(pytest\) +SKIP .*PREBUILT=1' >/dev/null \
    || fail "prebuilt: no torch SKIP row: $out"
fi
[[ -n ${GPU_CHECK_TEST_SHOW:-} ]] && printf "%s\n" "$out"
echo "gpu_check_test: ok"
