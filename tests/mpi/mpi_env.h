// tests/mpi/mpi_env.h — the one communicator every MPI test of the process shares.
#pragma once

#include <memory>

#include "tiermem/communicator.h"

namespace tiermem::testing {
inline Communicator& world_comm() {
  static std::unique_ptr<Communicator> c = make_communicator();
  return *c;
}
}  // namespace tiermem::testing
