# The two commands of the README:
#   make demo   set up, build only tiermem-train (and what it links) and run the main job on its
#               embedded default: the `demo` preset (build/demo), no tests, benches or samples,
#               CUDA only when a GPU is visible (nvidia-smi -L)
#   make test   set up, build everything (CUDA too whenever nvcc is there), and run every test
# Other targets: build, build-cuda (the cuda preset: CUDA required), test-quick (main suite only), test-debug (ASan+UBSan), test-tsan,
# test-fuzz, test-install (the installed package linked from outside the tree), test-python (the
# Python package: pip install . into the cached venv, then pytest), bench, clean.
JOBS ?= $(shell nproc)
PRESET ?= default
BUILD := build/$(PRESET)
# The Python environment scripts/setup.sh --python makes once, outside the clone.
TIERMEM_VENV ?= $(HOME)/.cache/tiermem/venv
export TIERMEM_VENV

.PHONY: setup setup-python build build-cuda demo test test-quick test-debug test-tsan test-fuzz test-install test-python bench clean

setup:
	scripts/setup.sh

setup-python:
	scripts/setup.sh --python

build: setup
	cmake --preset $(PRESET) >/dev/null
	cmake --build --preset $(PRESET) -j $(JOBS)

# CUDA in the demo only when a GPU is there to run it (the default preset's AUTO otherwise
# compiles the kernels whenever nvcc exists).
DEMO_CUDA = $(shell nvidia-smi -L >/dev/null 2>&1 && echo AUTO || echo OFF)

# A tree that already has the full build (make test made it) builds the demo's one target there
# instead of configuring a second build.
demo: setup
	@if [ -f build/default/CMakeCache.txt ]; then \
	  echo "demo: building tiermem-train in the existing build/default"; \
	  cmake --build build/default -j $(JOBS) --target tiermem-train && build/default/bin/tiermem-train; \
	else \
	  cmake --preset demo -DTIERMEM_WITH_CUDA=$(DEMO_CUDA) >/dev/null && \
	  cmake --build --preset demo -j $(JOBS) && build/demo/bin/tiermem-train; \
	fi

build-cuda: setup
	cmake --preset cuda >/dev/null
	cmake --build --preset cuda -j $(JOBS)

# Every test: the whole suite (unit, mpi, fault, soak, crash loop, gpu = skipped without a GPU),
# the installed package linked from outside the tree, then the library tiers under ASan+UBSan, the
# concurrent tests under ThreadSanitizer, and 30 s of each libFuzzer target (config and checkpoint
# manifest loaders), then the Python package's tests.
test: build
	ctest --preset $(PRESET) -j $(JOBS) --output-on-failure
	JOBS=$(JOBS) tests/install/consumer_test.sh --static-from $(BUILD)
	tests/sanitize.sh debug
	tests/sanitize.sh tsan
	FUZZ_SECONDS=30 tests/fuzz/run.sh
	$(MAKE) test-python

# The Python package: built from this clone by pip (scikit-build-core; the CMake build is kept in
# build/python, so a rebuild is incremental) into the cached venv, offline, then pytest.
# OMP_WAIT_POLICY=PASSIVE: tiermem's OpenMP and torch's own copy do not spin against each other.
test-python: setup-python
	$(TIERMEM_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps --no-index .
	cd tests/python && OMP_WAIT_POLICY=PASSIVE $(TIERMEM_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider .

# Only the main suite (no sanitizers, no fuzzing): the quick loop while developing.
test-quick: build
	ctest --preset $(PRESET) -j $(JOBS) --output-on-failure

test-debug: setup
	tests/sanitize.sh debug

test-tsan: setup
	tests/sanitize.sh tsan

test-fuzz: setup
	tests/fuzz/run.sh

# `cmake --install` of this build (static) and of a shared build made for it, each linked by
# examples/consumer (find_package) and by a pkg-config compiler line, outside the tree.
test-install: build
	JOBS=$(JOBS) tests/install/consumer_test.sh --static-from $(BUILD)

# The Google Benchmark micro-benches (bench/*_bench.cc: AdamW per ISA, casts, checksum, each with
# a same-run STREAM triad); tiermem-bench's own subcommands are listed by its --help.
bench: build
	$(BUILD)/bin/tiermem-bench --help
	for b in adam cast checksum; do $(BUILD)/bench/tiermem-$$b-bench --benchmark_min_time=0.2 || exit 1; done

clean:
	rm -rf build tiermem-swap
