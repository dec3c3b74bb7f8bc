// tiermem/communicator.h — collectives across ranks: all-gather, reduce-scatter, all-reduce,
// broadcast, barrier; each with an async form that returns a handle to wait on.
//
// Backends (chosen by make_communicator, or made directly):
//   single — one rank, plain copies; needs no launcher and no MPI.
//   mpi    — OpenMPI (host buffers), nonblocking collectives (MPI_Iallgather, ...). MPI is
//            initialised once per process with MPI_Init_thread(MPI_THREAD_SERIALIZED or better)
//            unless the program already did; it is finalised at exit only if tiermem started it.
//   nccl   — NCCL (device buffers, CUDA builds only), bootstrapped over MPI (the unique id is
//            broadcast by rank 0), on its own CUDA stream; async NCCL errors are polled with
//            ncclCommGetAsyncError and raised as CommError naming the rank and the operation; a
//            wait longer than TIERMEM_NCCL_TIMEOUT_S (default 1800 s) aborts the communicator
//            (ncclCommAbort) and raises CommError, as does every later call on it.
//
// Buffers: counts are in ELEMENTS of `dtype`. The caller owns every buffer; it must stay valid
// and untouched (send: not written; recv: not read or written) until the handle's wait()
// returns. The mpi/single backends take host pointers; nccl takes device pointers.
// Reductions (sum, avg) support DType::kF32 on every backend (nccl also kBF16/kF16);
// all_gather and broadcast move any dtype as raw elements.
//
// Thread-safety: a Communicator may be used from several threads; calls are serialised inside
// the backend, and every rank must issue the same collectives in the same order (as in MPI).
// CommHandle is movable, not thread-safe itself; wait() on a handle from one thread at a time.
//
// Errors: a failing collective throws CommError (backend, operation, error string); a missing
// backend throws NotSupportedError; wrong arguments (count too large for the backend, an
// unsupported dtype) throw CommError before anything is sent.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "tiermem/dtype.h"
#include "tiermem/export.h"

namespace tiermem {

enum class ReduceOp { kSum, kAvg };  // kAvg: the sum divided by world_size

namespace detail {
// One in-flight collective. test() polls (true = done); wait() blocks until done. Both throw
// CommError on failure (once; later calls return true / return).
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual bool test() = 0;
  virtual void wait() = 0;
};
}  // namespace detail

// The handle of an async collective. A default-constructed handle is already complete.
// Destroying a handle that was not waited on waits (errors are then logged, not thrown).
class TIERMEM_API CommHandle {
 public:
  CommHandle() = default;
  explicit CommHandle(std::unique_ptr<detail::CommRequest> req) : req_(std::move(req)) {}
  CommHandle(CommHandle&&) noexcept = default;
  CommHandle& operator=(CommHandle&& other) noexcept;
  ~CommHandle();

  // Blocks until the collective completed; its buffers may then be reused. Throws CommError.
  void wait();
  // Non-blocking: true once complete (then wait() returns at once). Throws CommError.
  bool test();
  // True while the collective may still be running.
  bool pending() const { return req_ != nullptr; }

 private:
  std::unique_ptr<detail::CommRequest> req_;
};

class TIERMEM_API Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string_view backend() const = 0;  // "single" | "mpi" | "nccl"
  // True when buffers must be device (CUDA) pointers (nccl); false for host pointers.
  virtual bool device_buffers() const = 0;

  // recv[r*count .. (r+1)*count) = rank r's send[0..count). recv holds world_size*count
  // elements. In place is allowed: send == recv + rank*count.
  virtual CommHandle all_gather_async(const void* send, void* recv, std::size_t count, DType dtype) = 0;
  // recv[0..count) = op over ranks of send[rank*count .. (rank+1)*count). send holds
  // world_size*count elements. send and recv must not overlap.
  virtual CommHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype,
                                          ReduceOp op) = 0;
  // recv[0..count) = op over ranks of send[0..count). In place: send == recv.
  virtual CommHandle all_reduce_async(const void* send, void* recv, std::size_t count, DType dtype,
                                      ReduceOp op) = 0;
  // buf[0..count) on every rank = root's buf.
  virtual CommHandle broadcast_async(void* buf, std::size_t count, DType dtype, int root) = 0;
  // Returns when every rank has called barrier().
  virtual void barrier() = 0;

  // Ends every rank of the job with `exit_code` (MPI_Abort); for a failure on one rank that the
  // others would otherwise wait for forever inside their next collective. Does not return on
  // mpi/nccl; a no-op for the single-rank backend (the caller exits normally). Never throws.
  virtual void abort(int exit_code) noexcept { (void)exit_code; }

  // Blocking forms: the async call followed by wait().
  void all_gather(const void* send, void* recv, std::size_t count, DType dtype) {
    all_gather_async(send, recv, count, dtype).wait();
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) {
    reduce_scatter_async(send, recv, count, dtype, op).wait();
  }
  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) {
    all_reduce_async(send, recv, count, dtype, op).wait();
  }
  void broadcast(void* buf, std::size_t count, DType dtype, int root) {
    broadcast_async(buf, count, dtype, root).wait();
  }
};

struct TIERMEM_API CommOptions {
  // "auto" | "single" | "mpi" | "nccl". auto: nccl when device_buffers and built with NCCL, mpi
  // when launched by mpirun (OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK set) or when
  // WORLD_SIZE > 1, else single. The environment variable TIERMEM_COMM overrides "auto".
  std::string backend = "auto";
  bool device_buffers = false;  // the caller's buffers live on the CUDA device
  int cuda_device = -1;         // nccl: device to use; -1 = local rank modulo device count
};

// Makes the communicator for this process. Throws NotSupportedError when the chosen backend is
// not built (e.g. mpi without MPI, nccl without CUDA/NCCL), CommError when the launch is
// inconsistent (WORLD_SIZE=4 but MPI sees one rank: not launched with mpirun).
TIERMEM_API std::unique_ptr<Communicator> make_communicator(const CommOptions& options = {});

// The single-rank backend (always available).
TIERMEM_API std::unique_ptr<Communicator> make_single_communicator();
// The MPI backend over a duplicate of MPI_COMM_WORLD. Throws NotSupportedError without MPI.
TIERMEM_API std::unique_ptr<Communicator> make_mpi_communicator();
// The NCCL backend (bootstrapped over MPI). Throws NotSupportedError without CUDA+NCCL.
TIERMEM_API std::unique_ptr<Communicator> make_nccl_communicator(int cuda_device = -1);

// True when this build includes the backend ("single", "mpi", "nccl").
TIERMEM_API bool communicator_backend_built(std::string_view backend);

}  // namespace tiermem
