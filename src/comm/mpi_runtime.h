// src/comm/mpi_runtime.h — process-wide MPI initialisation shared by the MPI and NCCL backends.
#pragma once

#include <mpi.h>

#include <string>

namespace tiermem::detail {

// Initialises MPI once (MPI_Init_thread asking for MPI_THREAD_MULTIPLE, accepting SERIALIZED)
// unless the program already did; registers MPI_Finalize at exit only in the first case.
// Throws CommError when MPI gives less than MPI_THREAD_SERIALIZED.
void ensure_mpi_initialized();

// "MPI_Iallgather failed: <MPI error string> (code N)".
std::string mpi_error_message(const char* what, int code);

}  // namespace tiermem::detail

// TM_MPI_CHECK(call): throws CommError naming the call and MPI's error string.
#define TM_MPI_CHECK(call)                                                            \
  do {                                                                                \
    int tm_mpi_rc_ = (call);                                                          \
    if (tm_mpi_rc_ != MPI_SUCCESS)                                                    \
      throw ::tiermem::CommError(::tiermem::detail::mpi_error_message(#call, tm_mpi_rc_)); \
  } while (0)
