#!/usr/bin/env bash
# Sanitizer runs for CI (issue 8). Builds only the test binaries each run needs, then runs them.
#   tests/sanitize.sh debug   ASan+UBSan (preset debug): every unit test of the library tiers
#                             (core, cpu, gpu, nvme, prefetch, runtime, comm, zero and its parts) and the fault
#                             tests; not the GPT/trainer tests (src/gpt, src/train, src/plan, tools/; slow at -O0) nor the soak.
#   tests/sanitize.sh tsan    ThreadSanitizer (preset tsan): the tests labelled `concurrent`
#                             (TensorStore, SimDevice, PinnedHostPool, io engine), zero_test and
#                             a 15 s soak.
# BUILD_DIR overrides the preset's binaryDir (e.g. BUILD_DIR=build-rel-debug); JOBS the -j.
# Exit status: non-zero when a build, a test or a sanitizer fails (sanitizers abort the test).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: tests/sanitize.sh debug|tsan}
jobs=${JOBS:-$(nproc)}
case "$kind" in
  debug)
    targets=(core_test cpu_test gpu_test nvme_extent_allocator_test io_engine_test swap_space_test
             nvme_fault_test runtime_test prefetch_test prefetch_store_test comm_test zero_test
             zero_parts_test adam_test fault_test)
    select=(-L unit -LE "slow|soak|crash|bench|gpt|train|mpi")
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
    # hwloc's PCI plugin (hwloc_pci.so -> libpciaccess) leaks ~1 KiB per topology load and is
    # dlclose'd before LeakSanitizer reports, so no suppression pattern can match its frames
    # (they print as <unknown module>). Not tiermem's leak (topology.cc destroys the topology):
    # keep the plugin out of these runs. numa_node_of_pci() then answers -1, which its test allows.
    export HWLOC_PLUGINS_BLACKLIST=${HWLOC_PLUGINS_BLACKLIST:-hwloc_pci}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
    ;;
  tsan)
    targets=(runtime_test gpu_test cpu_test io_engine_test soak_test zero_test)
    select=()  # the targets above (zero_test: the NVMe-pipelined optimizer over io_uring threads)
    export TIERMEM_SOAK_SECONDS=${TIERMEM_SOAK_SECONDS:-15}
    # tsan.supp: only libstdc++'s uninstrumented exception_ptr refcount (see the file).
    export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/sanitizers/tsan.supp}
    ;;
  *) echo "usage: tests/sanitize.sh debug|tsan" >&2; exit 2 ;;
esac
if [[ -n "${BUILD_DIR:-}" ]]; then
  cmake --preset "$kind" -B "$BUILD_DIR" >/dev/null
  build=$BUILD_DIR
else
  cmake --preset "$kind" >/dev/null
  build=build/$kind
fi
# Only targets that exist in this checkout (e.g. prefetch_store_test needs the runtime).
help=$(cmake --build "$build" --target help)
have=()
for t in "${targets[@]}"; do
  if grep -qx "\.\.\. $t" <<<"$help"; then have+=("$t"); fi
done
cmake --build "$build" -j "$jobs" --target "${have[@]}"
ctest --test-dir "$build" -j "$jobs" --output-on-failure ${select[@]+"${select[@]}"} \
  -R "^($(IFS='|'; echo "${have[*]}"))\$"
