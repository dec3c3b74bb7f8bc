#!/usr/bin/env bash
# tests/install/consumer_test.sh — tiermem as a framework outside this tree sees it (README "Link
# tiermem into your framework"). For the static library and for the shared one:
#   1. `cmake --install` into a new temporary prefix, then delete the build tree when this script
#      made it (and check that no installed text file names this tree);
#   2. configure examples/consumer (find_package(tiermem REQUIRED)) in a folder outside the tree,
#      beside an unchanged copy of examples/zero_mlp.cc; build it, run it: the loss must halve
#      and the binary must report the library it was meant to run on (tiermem::version_string());
#   3. compile the same file with one compiler line from `pkg-config --cflags --libs tiermem`,
#      run it, check the same;
# and check the shared library: SONAME libtiermem.so.<major>, no tiermem::detail symbol exported;
# and that the CMake snippet of the docs' "Link tiermem into your framework" is examples/consumer.
#
#   tests/install/consumer_test.sh [--static-from BUILD_DIR]
#     --static-from: install the static library from BUILD_DIR, already built (make test passes
#       build/default; it is not deleted); without it a static build is made here too.
#     The shared library is always built here: the library alone (-DBUILD_SHARED_LIBS=ON, no
#     tests, benches, tools or samples), CUDA off unless CONSUMER_SHARED_CUDA=AUTO|ON.
#   Environment: JOBS (build jobs, default nproc), TMPDIR, KEEP=1 (keep the temporary folder).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
JOBS=${JOBS:-$(nproc)}
static_from=""
if [[ "${1:-}" == "--static-from" ]]; then
  static_from=$(cd "$2" && pwd)
fi
major=$(sed -nE 's/^#define TIERMEM_VERSION_MAJOR ([0-9]+)$/\1/p' "$ROOT/include/tiermem/version.h")
work=$(mktemp -d "${TMPDIR:-/tmp}/tiermem-consumer.XXXXXX")
[[ "${KEEP:-0}" == 1 ]] || trap 'rm -rf "$work"' EXIT
echo "consumer_test: working in $work"
t0=$SECONDS

fail() { echo "FAIL: $*"; exit 1; }
step() { echo "== $* ($((SECONDS - t0)) s)"; }

# The CMake snippet README.md and docs/architecture.md show is the consumer built below (their sh
# snippets run in tests/python/test_doc_commands.py).
want=$(grep -v '^#' "$ROOT/examples/consumer/CMakeLists.txt")
for doc in README.md docs/architecture.md; do
  got=$(awk '/^## Link tiermem into your framework/ { s = 1 } s && /^```cmake/ { c = 1; next }
             c && /^```/ { exit } c' "$ROOT/$doc")
  [[ "$got" == "$want" ]] ||
    fail "$doc: the cmake block of 'Link tiermem into your framework' is not examples/consumer/CMakeLists.txt"
done

# build_library <kind> <build dir> <cmake options...>: configure and build the installed targets.
build_library() {
  local kind=$1 dir=$2
  shift 2
  step "$kind: configure and build the library in $dir"
  cmake -S "$ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DTIERMEM_BUILD_TESTS=OFF \
    -DTIERMEM_BUILD_BENCH=OFF -DTIERMEM_BUILD_EXAMPLES=OFF "$@" >"$dir.configure.log" ||
    { cat "$dir.configure.log"; fail "$kind: configure"; }
  cmake --build "$dir" -j "$JOBS" >"$dir.build.log" 2>&1 || { tail -50 "$dir.build.log"; fail "$kind: build"; }
}

# check_run <what> <expected kind> <binary>: runs zero_mlp; the loss halves (the check of
# tests/unit/examples_test.sh) and its first line names the library kind it runs on.
check_run() {
  local what=$1 kind=$2 bin=$3
  local out
  out=$("$ROOT/tests/unit/examples_test.sh" zero_mlp "$bin") || { echo "$out"; fail "$what: zero_mlp"; }
  grep -q "^tiermem [0-9.]* ($kind;" <<<"$out" || { echo "$out"; fail "$what: no 'tiermem <version> ($kind; ...' line"; }
  echo "$what: $(grep '^tiermem ' <<<"$out"); $(grep '^loss ' <<<"$out" | cut -d';' -f1)"
}

# consume <kind> <prefix>: the two consumers against the install in <prefix>.
consume() {
  local kind=$1 prefix=$2
  local libdir
  libdir=$(dirname "$(find "$prefix" -name tiermem.pc -path '*/pkgconfig/*')")/..
  libdir=$(cd "$libdir" && pwd)
  if grep -rIl -e "$ROOT" "$prefix"; then
    fail "$kind: the installed text files above name the source tree $ROOT"
  fi

  step "$kind: find_package(tiermem) in a project outside the tree"
  local app=$work/$kind-cmake
  mkdir -p "$app"
  cp "$ROOT/examples/consumer/CMakeLists.txt" "$ROOT/examples/zero_mlp.cc" "$app/"
  cmake -S "$app" -B "$app/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
    >"$app/configure.log" || { cat "$app/configure.log"; fail "$kind: consumer configure"; }
  local found
  found=$(sed -nE 's/^tiermem_DIR:PATH=(.*)$/\1/p' "$app/build/CMakeCache.txt")
  [[ "$(cd "$found" && pwd)" == "$libdir/cmake/tiermem" ]] || fail "$kind: find_package found $found, not $libdir/cmake/tiermem"
  cmake --build "$app/build" >"$app/build.log" 2>&1 || { cat "$app/build.log"; fail "$kind: consumer build"; }
  check_run "$kind, CMake" "$kind" "$app/build/zero_mlp"

  step "$kind: one compiler line from pkg-config"
  local flags
  flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs tiermem) || fail "$kind: pkg-config"
  echo "pkg-config --cflags --libs tiermem: $flags"
  # shellcheck disable=SC2086  # the flags are words
  c++ -std=c++20 -O2 "$app/zero_mlp.cc" -o "$work/$kind-pc-zero_mlp" $flags || fail "$kind: pkg-config build"
  if [[ $kind == shared ]]; then
    LD_LIBRARY_PATH="$libdir" ldd "$work/$kind-pc-zero_mlp" | grep -q "libtiermem.so.$major => $libdir/" ||
      fail "$kind: not linked to $libdir/libtiermem.so.$major"
    LD_LIBRARY_PATH="$libdir" check_run "$kind, pkg-config" "$kind" "$work/$kind-pc-zero_mlp"
  else
    ! ldd "$work/$kind-pc-zero_mlp" | grep -q libtiermem || fail "$kind: a static consumer needs libtiermem.so"
    check_run "$kind, pkg-config" "$kind" "$work/$kind-pc-zero_mlp"
  fi
}

# The static library.
if [[ -n $static_from ]]; then
  step "static: install $static_from"
  cmake --install "$static_from" --prefix "$work/static" >/dev/null
else
  build_library static "$work/build-static"
  cmake --install "$work/build-static" --prefix "$work/static" >/dev/null
  rm -rf "$work/build-static"
fi
[[ -n $(find "$work/static" -name libtiermem.a) ]] || fail "static: no libtiermem.a installed"
for tool in tiermem-train tiermem-plan tiermem-bench; do  # those the build made (no bench: none)
  if [[ -x $work/static/bin/$tool ]]; then
    "$work/static/bin/$tool" --help >/dev/null || fail "static: the installed $tool --help"
    echo "static: bin/$tool installed, --help runs"
  elif [[ -n $static_from && -x $static_from/bin/$tool ]]; then
    fail "static: $tool was built but not installed"
  fi
done
consume static "$work/static"

# The shared library.
build_library shared "$work/build-shared" -DBUILD_SHARED_LIBS=ON -DTIERMEM_BUILD_TOOLS=OFF \
  -DTIERMEM_WITH_CUDA="${CONSUMER_SHARED_CUDA:-OFF}"
cmake --install "$work/build-shared" --prefix "$work/shared" >/dev/null
rm -rf "$work/build-shared"
so=$(find "$work/shared" -name "libtiermem.so.$major" -type l -o -name "libtiermem.so.$major" -type f | head -1)
[[ -n $so ]] || fail "shared: no libtiermem.so.$major installed"
soname=$(readelf -d "$so" | sed -nE 's/.*\(SONAME\).*\[(.*)\]/\1/p')
[[ $soname == "libtiermem.so.$major" ]] || fail "shared: SONAME is '$soname', not libtiermem.so.$major"
exported=$(nm -DC --defined-only "$so" | grep -c ' tiermem::' || true)
detail=$(nm -DC --defined-only "$so" | grep -c 'tiermem::detail' || true)
echo "shared: $so: SONAME $soname, $exported tiermem:: symbols exported, $detail of tiermem::detail"
[[ $detail == 0 ]] || { nm -DC --defined-only "$so" | grep 'tiermem::detail' | head; fail "shared: tiermem::detail symbols exported"; }
consume shared "$work/shared"

step "PASS: static and shared installs, each linked by CMake and by pkg-config"
