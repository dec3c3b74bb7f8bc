# Collectives on one rank (single backend) and backend selection; multi-rank tests are in tests/mpi.
tiermem_test(NAME comm_test SOURCES comm_test.cc DEPS tiermem::comm TIMEOUT 30 LABELS comm)
