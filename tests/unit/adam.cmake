# CPU AdamW (src/cpu/adam*.cc): every ISA kernel against a double-precision reference.
tiermem_test(NAME adam_test SOURCES adam_test.cc DEPS tiermem::cpu TIMEOUT 60)
