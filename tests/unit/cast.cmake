# Bulk fp32 <-> bf16/fp16 casts (src/cpu/cast*.cc): every ISA kernel against the scalar functions
# of tiermem/dtype.h, bit for bit.
tiermem_test(NAME cast_test SOURCES cast_test.cc DEPS tiermem::cpu TIMEOUT 120)
