# CPU Lion and Adagrad (src/cpu/optim_kernels*.cc): every ISA kernel bit for bit against the scalar
# twin, the scalar twin against a double-precision evaluation of the formulas.
tiermem_test(NAME optim_kernels_test SOURCES optim_kernels_test.cc DEPS tiermem::cpu TIMEOUT 60)
