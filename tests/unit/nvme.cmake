# Tests of the NVMe tier (src/nvme). Swap files go to a temp dir under $TMPDIR or /tmp (must support
# O_DIRECT); /dev/shm is used to check the tmpfs (no O_DIRECT) error.
tiermem_test(NAME nvme_extent_allocator_test SOURCES nvme_extent_allocator_test.cc
  DEPS tiermem::nvme LABELS nvme TIMEOUT 60)
tiermem_test(NAME io_engine_test SOURCES io_engine_test.cc
  DEPS tiermem::nvme LABELS nvme concurrent TIMEOUT 120)
tiermem_test(NAME swap_space_test SOURCES swap_space_test.cc
  DEPS tiermem::nvme LABELS nvme TIMEOUT 120)
tiermem_test(NAME nvme_fault_test SOURCES nvme_fault_test.cc
  DEPS tiermem::nvme LABELS nvme TIMEOUT 120)
tiermem_test(NAME checksum_test SOURCES checksum_test.cc
  DEPS tiermem::nvme LABELS nvme TIMEOUT 60)
tiermem_test(NAME device_limits_test SOURCES device_limits_test.cc
  DEPS tiermem::nvme LABELS nvme TIMEOUT 60)
tiermem_test(NAME made_dirs_test SOURCES made_dirs_test.cc
  DEPS tiermem::nvme LABELS nvme TIMEOUT 60)
