// src/comm/nccl_communicator.cc — the NCCL backend (CUDA builds with NCCL and MPI only).
// Bootstrap: MPI gives rank and world; rank 0 makes the ncclUniqueId and MPI_Bcast sends it.
// Collectives run on the communicator's own non-blocking CUDA stream; each async call records a
// CUDA event that its handle polls, checking ncclCommGetAsyncError while it waits.
// Failures are CommError naming the rank and the operation. A wait that exceeds the timeout
// (TIERMEM_NCCL_TIMEOUT_S, default 1800 s: a peer rank died or hangs) aborts the communicator
// (ncclCommAbort, which unblocks the kernels waiting on peers) and throws; every later call on it
// throws at once, and its destructor no longer waits for its stream.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "comm/mpi_runtime.h"
#include "tiermem/communicator.h"
#include "tiermem/env.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

#define TM_COMM_CUDA_CHECK(call)                                                              \
  do {                                                                                        \
    cudaError_t tm_e_ = (call);                                                               \
    if (tm_e_ != cudaSuccess)                                                                 \
      throw ::tiermem::CudaError(std::string(#call) + " failed: " + cudaGetErrorString(tm_e_) + \
                                 " (" __FILE__ ":" + std::to_string(__LINE__) + ")");        \
  } while (0)

#define TM_NCCL_CHECK(call)                                                                   \
  do {                                                                                        \
    ncclResult_t tm_r_ = (call);                                                              \
    if (tm_r_ != ncclSuccess)                                                                 \
      throw ::tiermem::CommError(std::string(#call) + " failed: " + ncclGetErrorString(tm_r_) + \
                                 " (" __FILE__ ":" + std::to_string(__LINE__) + ")");        \
  } while (0)

namespace tiermem {
namespace {

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::kF32: return ncclFloat32;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kU8: return ncclUint8;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU16: return ncclFloat16;  // moved as raw 16-bit elements (never reduced)
  }
  return ncclUint8;
}

// What the communicator and its requests share: the comm, this rank, the timeout, and whether
// the comm was aborted (then it must not be touched again).
struct NcclState {
  ncclComm_t comm = nullptr;
  int rank = 0;
  std::chrono::duration<double> timeout{1800.0};
  std::atomic<bool> aborted{false};
  std::mutex abort_mu;

  std::string where(const char* op) const {
    return "nccl: rank " + std::to_string(rank) + ": " + op;
  }
  void abort() noexcept {
    std::lock_guard<std::mutex> lock(abort_mu);
    if (!aborted.exchange(true) && comm != nullptr) ncclCommAbort(comm);
  }
};

double nccl_timeout_s() {
  const auto v = env_param("TIERMEM_NCCL_TIMEOUT_S");
  if (!v) return 1800.0;
  try {
    const double s = std::stod(*v);
    if (s > 0) return s;
  } catch (const std::exception&) {
  }
  throw ConfigError("TIERMEM_NCCL_TIMEOUT_S", *v, "expected seconds > 0");
}

class NcclRequest final : public detail::CommRequest {
 public:
  NcclRequest(NcclState* st, cudaEvent_t ev, const char* op)
      : st_(st), ev_(ev), op_(op), start_(std::chrono::steady_clock::now()) {}
  ~NcclRequest() override {
    if (!done_) {
      try {
        wait();
      } catch (...) {
      }
    }
    cudaEventDestroy(ev_);
  }
  bool test() override {
    if (done_) return true;
    if (st_->aborted.load()) {
      done_ = true;
      throw CommError(st_->where(op_) + " failed: the communicator was aborted (an earlier error "
                                        "or timeout on this rank)");
    }
    cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) {
      done_ = true;
      return true;
    }
    if (e != cudaErrorNotReady) {
      done_ = true;
      throw CommError(st_->where(op_) + ": cudaEventQuery failed: " + cudaGetErrorString(e));
    }
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(st_->comm, &async);
    if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      done_ = true;
      ncclResult_t bad = r != ncclSuccess ? r : async;
      st_->abort();
      throw CommError(st_->where(op_) + " failed asynchronously: " + ncclGetErrorString(bad) +
                      " (the communicator was aborted)");
    }
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start_;
    if (waited > st_->timeout) {
      done_ = true;
      st_->abort();
      throw CommError(st_->where(op_) + " timed out after " +
                      std::to_string(static_cast<long long>(waited.count())) +
                      " s (TIERMEM_NCCL_TIMEOUT_S): a peer rank stopped or hangs; the "
                      "communicator was aborted");
    }
    return false;
  }
  void wait() override {
    for (int spins = 0; !test(); ++spins) {
      if (spins > 64) std::this_thread::yield();
    }
  }

 private:
  NcclState* st_;
  cudaEvent_t ev_;
  const char* op_;
  std::chrono::steady_clock::time_point start_;
  bool done_ = false;
};

int local_rank() {
  for (const char* k : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK"}) {
    if (const char* v = std::getenv(k)) return std::atoi(v);
  }
  return 0;
}

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(int cuda_device) {
    detail::ensure_mpi_initialized();
    TM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    TM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_));
    int devices = 0;
    TM_COMM_CUDA_CHECK(cudaGetDeviceCount(&devices));
    if (devices <= 0) throw NotSupportedError("nccl: no CUDA device");
    device_ = cuda_device >= 0 ? cuda_device : local_rank() % devices;
    TM_COMM_CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId id;
    if (rank_ == 0) TM_NCCL_CHECK(ncclGetUniqueId(&id));
    TM_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
    state_.rank = rank_;
    state_.timeout = std::chrono::duration<double>(nccl_timeout_s());
    TM_NCCL_CHECK(ncclCommInitRank(&comm_, world_, id, rank_));
    state_.comm = comm_;
    TM_COMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TM_LOG_INFO("COMM", "nccl: rank {} of {} on CUDA device {}", rank_, world_, device_);
  }
  ~NcclCommunicator() override {
    if (state_.aborted.load()) {  // the comm is gone; the stream may never finish
      if (stream_) cudaStreamDestroy(stream_);
      return;
    }
    if (stream_) cudaStreamSynchronize(stream_);
    ncclResult_t async = ncclSuccess;
    if (comm_ && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async == ncclSuccess) {
      ncclCommDestroy(comm_);
    } else if (comm_) {
      ncclCommAbort(comm_);
    }
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string_view backend() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

  CommHandle all_gather_async(const void* send, void* recv, std::size_t count, DType dtype) override {
    return issue("ncclAllGather",
                 [&] { return ncclAllGather(send, recv, count, nccl_type(dtype), comm_, stream_); });
  }
  CommHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    check_reduce_dtype(dtype, "reduce_scatter");
    return issue("ncclReduceScatter", [&] {
      return ncclReduceScatter(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, stream_);
    });
  }
  CommHandle all_reduce_async(const void* send, void* recv, std::size_t count, DType dtype,
                              ReduceOp op) override {
    check_reduce_dtype(dtype, "all_reduce");
    return issue("ncclAllReduce", [&] {
      return ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, stream_);
    });
  }
  CommHandle broadcast_async(void* buf, std::size_t count, DType dtype, int root) override {
    if (root < 0 || root >= world_) {
      throw CommError(state_.where("broadcast") + ": root " + std::to_string(root) +
                      " is outside 0.." + std::to_string(world_ - 1));
    }
    return issue("ncclBroadcast",
                 [&] { return ncclBroadcast(buf, buf, count, nccl_type(dtype), root, comm_, stream_); });
  }
  void barrier() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      TM_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    TM_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  }
  void abort(int exit_code) noexcept override {
    state_.abort();  // unblocks kernels waiting on peers
    MPI_Abort(MPI_COMM_WORLD, exit_code);
  }

 private:
  static ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kAvg ? ncclAvg : ncclSum; }
  void check_reduce_dtype(DType dtype, const char* op) const {
    if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
      throw CommError(state_.where(op) + " of dtype " + std::string(dtype_name(dtype)) +
                      " is not supported (f32, bf16, f16)");
    }
  }
  template <typename Start>
  CommHandle issue(const char* op, Start&& start) {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.aborted.load())
      throw CommError(state_.where(op) + ": the communicator was aborted by an earlier error");
    TM_COMM_CUDA_CHECK(cudaSetDevice(device_));
    ncclResult_t r = start();
    if (r != ncclSuccess) {
      throw CommError(state_.where(op) + " failed: " + ncclGetErrorString(r));
    }
    cudaEvent_t ev;
    TM_COMM_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    TM_COMM_CUDA_CHECK(cudaEventRecord(ev, stream_));
    return CommHandle(std::make_unique<NcclRequest>(&state_, ev, op));
  }

  int rank_ = 0, world_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  NcclState state_;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(int cuda_device) {
  return std::make_unique<NcclCommunicator>(cuda_device);
}

}  // namespace tiermem
