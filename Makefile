# The two commands of the README:
#   make demo   set up, build, and run the main job (tiermem-train on its embedded default)
#   make test   set up, build, and run every test
# Other targets: build, bench, test-debug (ASan+UBSan), test-tsan, clean.
JOBS ?= $(shell nproc)
PRESET ?= default
BUILD := build/$(PRESET)

.PHONY: setup build demo test test-debug test-tsan bench clean

setup:
	scripts/setup.sh

build: setup
	cmake --preset $(PRESET) >/dev/null
	cmake --build --preset $(PRESET) -j $(JOBS)

demo: build
	$(BUILD)/examples/gpt/tiermem-train

test: build
	ctest --preset $(PRESET) -j $(JOBS) --output-on-failure

test-debug: setup
	cmake --preset debug >/dev/null
	cmake --build --preset debug -j $(JOBS)
	ctest --preset debug -j $(JOBS) --output-on-failure -L unit -LE "slow|soak|crash|bench"

test-tsan: setup
	cmake --preset tsan >/dev/null
	cmake --build --preset tsan -j $(JOBS)
	ctest --preset tsan -j $(JOBS) --output-on-failure -L concurrent

bench: build
	$(BUILD)/bench/tiermem-bench --help

clean:
	rm -rf build tiermem-swap
