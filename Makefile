# The two commands of the README:
#   make demo   set up, build, and run the main job (tiermem-train on its embedded default)
#   make test   set up, build, and run every test
# Other targets: build, test-quick (main suite only), test-debug (ASan+UBSan), test-tsan,
# test-fuzz, bench, clean.
JOBS ?= $(shell nproc)
PRESET ?= default
BUILD := build/$(PRESET)

.PHONY: setup build demo test test-quick test-debug test-tsan test-fuzz bench clean

setup:
	scripts/setup.sh

build: setup
	cmake --preset $(PRESET) >/dev/null
	cmake --build --preset $(PRESET) -j $(JOBS)

demo: build
	$(BUILD)/examples/gpt/tiermem-train

# Every test: the whole suite (unit, mpi, fault, soak, crash loop, gpu = skipped without a GPU),
# then the library tiers under ASan+UBSan, the concurrent tests under ThreadSanitizer, and 30 s of
# each libFuzzer target (config and checkpoint manifest loaders).
test: build
	ctest --preset $(PRESET) -j $(JOBS) --output-on-failure
	tests/sanitize.sh debug
	tests/sanitize.sh tsan
	FUZZ_SECONDS=30 tests/fuzz/run.sh

# Only the main suite (no sanitizers, no fuzzing): the quick loop while developing.
test-quick: build
	ctest --preset $(PRESET) -j $(JOBS) --output-on-failure

test-debug: setup
	tests/sanitize.sh debug

test-tsan: setup
	tests/sanitize.sh tsan

test-fuzz: setup
	tests/fuzz/run.sh

bench: build
	$(BUILD)/bench/tiermem-bench --help

clean:
	rm -rf build tiermem-swap
