// src/comm/mpi_communicator.cc — the MPI backend: nonblocking collectives on a duplicate of
// MPI_COMM_WORLD, host buffers. Calls into MPI are serialised by one mutex per communicator
// (enough for MPI_THREAD_SERIALIZED); waiting polls MPI_Test so other threads can issue
// collectives meanwhile.
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "comm/mpi_runtime.h"
#include "tiermem/communicator.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {
namespace detail {

namespace {
std::once_flag g_mpi_once;
bool g_we_initialized = false;

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}
}  // namespace

std::string mpi_error_message(const char* what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  return std::string(what) + " failed: " + std::string(text, static_cast<std::size_t>(len)) +
         " (MPI error " + std::to_string(code) + ")";
}

void ensure_mpi_initialized() {
  std::call_once(g_mpi_once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      TM_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
      g_we_initialized = true;
      std::atexit(finalize_at_exit);
    }
  });
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_SERIALIZED) {
    throw CommError("MPI was initialised with thread level " + std::to_string(provided) +
                    "; tiermem needs MPI_THREAD_SERIALIZED or better (call MPI_Init_thread)");
  }
}

}  // namespace detail

namespace {

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kU8: return MPI_UINT8_T;
    case DType::kF16:
    case DType::kBF16:
    case DType::kU16: return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

class MpiRequest final : public detail::CommRequest {
 public:
  MpiRequest(std::mutex* mu, MPI_Request req, const char* op, float* avg_buf, std::size_t avg_count,
             float avg_scale)
      : mu_(mu), req_(req), op_(op), avg_buf_(avg_buf), avg_count_(avg_count), avg_scale_(avg_scale) {}
  ~MpiRequest() override {
    if (!done_) {
      try {
        wait();
      } catch (...) {
      }
    }
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    int rc;
    {
      std::lock_guard<std::mutex> lock(*mu_);
      rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) {
      done_ = true;
      throw CommError(detail::mpi_error_message(op_, rc));
    }
    if (flag) finish();
    return flag != 0;
  }
  void wait() override {
    // Poll rather than MPI_Wait so that the mutex is not held while blocked.
    for (int spins = 0; !test(); ++spins) {
      if (spins > 64) std::this_thread::yield();
    }
  }

 private:
  void finish() {
    done_ = true;
    if (avg_buf_) {
      for (std::size_t i = 0; i < avg_count_; ++i) avg_buf_[i] *= avg_scale_;
    }
  }
  std::mutex* mu_;
  MPI_Request req_;
  const char* op_;
  float* avg_buf_;
  std::size_t avg_count_;
  float avg_scale_;
  bool done_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    detail::ensure_mpi_initialized();
    TM_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    TM_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    TM_MPI_CHECK(MPI_Comm_size(comm_, &world_));
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    set_log_rank(rank_);  // messages every rank would say alike: rank 0 only (tiermem/log.h)
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string_view backend() const override { return "mpi"; }
  bool device_buffers() const override { return false; }

  CommHandle all_gather_async(const void* send, void* recv, std::size_t count, DType dtype) override {
    int n = checked_count(count, "all_gather");
    const void* s = send;
    if (send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * count * dtype_size(dtype)) {
      s = MPI_IN_PLACE;
    }
    return issue("MPI_Iallgather", nullptr, 0, [&](MPI_Request* r) {
      return MPI_Iallgather(s, n, mpi_type(dtype), recv, n, mpi_type(dtype), comm_, r);
    });
  }

  CommHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    int n = checked_count(count, "reduce_scatter");
    check_reduce_dtype(dtype, "reduce_scatter");
    return issue("MPI_Ireduce_scatter_block", op == ReduceOp::kAvg ? static_cast<float*>(recv) : nullptr, count,
                 [&](MPI_Request* r) {
                   return MPI_Ireduce_scatter_block(send, recv, n, MPI_FLOAT, MPI_SUM, comm_, r);
                 });
  }

  CommHandle all_reduce_async(const void* send, void* recv, std::size_t count, DType dtype,
                              ReduceOp op) override {
    int n = checked_count(count, "all_reduce");
    check_reduce_dtype(dtype, "all_reduce");
    const void* s = send == recv ? MPI_IN_PLACE : send;
    return issue("MPI_Iallreduce", op == ReduceOp::kAvg ? static_cast<float*>(recv) : nullptr, count,
                 [&](MPI_Request* r) { return MPI_Iallreduce(s, recv, n, MPI_FLOAT, MPI_SUM, comm_, r); });
  }

  CommHandle broadcast_async(void* buf, std::size_t count, DType dtype, int root) override {
    int n = checked_count(count, "broadcast");
    if (root < 0 || root >= world_) {
      throw CommError("mpi: broadcast root " + std::to_string(root) + " is outside 0.." + std::to_string(world_ - 1));
    }
    return issue("MPI_Ibcast", nullptr, 0,
                 [&](MPI_Request* r) { return MPI_Ibcast(buf, n, mpi_type(dtype), root, comm_, r); });
  }

  void barrier() override {
    issue("MPI_Ibarrier", nullptr, 0, [&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); }).wait();
  }

  void abort(int exit_code) noexcept override { MPI_Abort(MPI_COMM_WORLD, exit_code); }

 private:
  template <typename Start>
  CommHandle issue(const char* op, float* avg_buf, std::size_t avg_count, Start&& start) {
    MPI_Request req;
    int rc;
    {
      std::lock_guard<std::mutex> lock(mu_);
      rc = start(&req);
    }
    if (rc != MPI_SUCCESS) throw CommError(detail::mpi_error_message(op, rc));
    return CommHandle(std::make_unique<MpiRequest>(&mu_, req, op, avg_buf, avg_count,
                                                   1.0f / static_cast<float>(world_)));
  }
  static int checked_count(std::size_t count, const char* op) {
    if (count > static_cast<std::size_t>(INT_MAX)) {
      throw CommError(std::string("mpi: ") + op + " of " + std::to_string(count) +
                      " elements exceeds MPI's int count (" + std::to_string(INT_MAX) + "); split it");
    }
    return static_cast<int>(count);
  }
  static void check_reduce_dtype(DType dtype, const char* op) {
    if (dtype != DType::kF32) {
      throw CommError(std::string("mpi: ") + op + " of dtype " + std::string(dtype_name(dtype)) +
                      " is not supported; the MPI backend reduces f32 only");
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, world_ = 1;
  std::mutex mu_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiCommunicator>(); }

}  // namespace tiermem
