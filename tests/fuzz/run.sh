#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan+UBSan) and runs each for FUZZ_SECONDS (default 30)
# from its seed corpus (tests/fuzz/corpus/<name>, copied so the repo is not modified).
# Exit status is non-zero if any fuzzer finds a crash, leak, timeout or sanitizer error; the
# reproducer is left in build/fuzz/artifacts/.
#   tests/fuzz/run.sh            # all fuzzers
#   FUZZ_SECONDS=5 tests/fuzz/run.sh config_fuzz
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${FUZZ_SECONDS:-30}
if ! command -v clang++ >/dev/null; then
  echo "fuzz: SKIPPED: clang++ not found (libFuzzer needs clang)"; exit 0
fi
cmake -S . -B build/fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DTIERMEM_BUILD_FUZZ=ON \
  -DTIERMEM_WITH_CUDA=OFF -DTIERMEM_BUILD_TESTS=OFF -DTIERMEM_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" >/dev/null
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=()
  for d in tests/fuzz/corpus/*/; do targets+=("$(basename "$d")_fuzz"); done
fi
cmake --build build/fuzz -j "$(nproc)" --target "${targets[@]}" >/dev/null
mkdir -p build/fuzz/artifacts
status=0
for t in "${targets[@]}"; do
  name=${t%_fuzz}
  work=build/fuzz/corpus-$name
  rm -rf "$work"; mkdir -p "$work"; cp tests/fuzz/corpus/$name/* "$work"/
  log=build/fuzz/$t.log
  if build/fuzz/tests/fuzz/$t "$work" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
       -artifact_prefix=build/fuzz/artifacts/ >"$log" 2>&1; then
    runs=$(grep -Eo 'Done [0-9]+ runs' "$log" | awk '{print $2}')
    echo "fuzz: $t: ${runs:-?} executions in ${seconds}s, no failures"
  else
    echo "fuzz: $t: FAILED (see $log; reproducer in build/fuzz/artifacts/)"; tail -20 "$log"; status=1
  fi
done
exit $status
