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
for row in build "gpu unit tests" "bench h2d" "bench d2h" "bench gemm" "bench pipeline" "train gpt2" offload; do
  printf '%s\n' "$out" | grep -q "^$row " || fail "failed build: no row '$row': $out"
done
[[ $(printf '%s\n' "$out" | grep -c ' SKIP ') == 7 ]] || fail "failed build: want 7 SKIP rows: $out"
[[ -s $T/out.json ]] || fail "failed build: no JSON"
if command -v python3 >/dev/null; then
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
assert d['gpu'] == 'NVIDIA H200' and d['failed'] == 1, d
assert [c['status'] for c in d['checks']] == ['FAIL'] + ['SKIP'] * 7, d
assert 'fake cmake' in d['checks'][0]['detail'], d
" "$T/out.json" || fail "failed build: bad JSON: $(cat "$T/out.json")"
fi
echo "gpu_check_test: ok"
