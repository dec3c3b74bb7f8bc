# Frozen values at rest (src/cpu/quantize*.cc): int8 round-trip bounds, AVX-512 against scalar.
tiermem_test(NAME quantize_test SOURCES quantize_test.cc DEPS tiermem::cpu TIMEOUT 60)
