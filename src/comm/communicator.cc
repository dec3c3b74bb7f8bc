// src/comm/communicator.cc — CommHandle, backend choice (make_communicator) and the single-rank
// backend (plain copies).
#include "tiermem/communicator.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "tiermem/env.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {

CommHandle& CommHandle::operator=(CommHandle&& other) noexcept {
  if (this != &other) {
    if (req_) {
      try {
        req_->wait();
      } catch (const std::exception& e) {
        TM_LOG_ERROR("COMM", "collective dropped without wait() failed: {}", e.what());
      }
    }
    req_ = std::move(other.req_);
  }
  return *this;
}

CommHandle::~CommHandle() {
  if (!req_) return;
  try {
    req_->wait();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("COMM", "collective dropped without wait() failed: {}", e.what());
  }
}

void CommHandle::wait() {
  if (!req_) return;
  auto r = std::move(req_);
  r->wait();
}

bool CommHandle::test() {
  if (!req_) return true;
  if (req_->test()) {
    auto r = std::move(req_);
    r->wait();  // completes bookkeeping (e.g. the avg scaling); returns at once
    return true;
  }
  return false;
}

namespace {

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string_view backend() const override { return "single"; }
  bool device_buffers() const override { return false; }

  CommHandle all_gather_async(const void* send, void* recv, std::size_t count, DType dtype) override {
    copy(send, recv, count * dtype_size(dtype));
    return {};
  }
  CommHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp) override {
    check_reduce_dtype(dtype, "reduce_scatter");
    copy(send, recv, count * dtype_size(dtype));  // sum and avg over one rank are the identity
    return {};
  }
  CommHandle all_reduce_async(const void* send, void* recv, std::size_t count, DType dtype,
                              ReduceOp) override {
    check_reduce_dtype(dtype, "all_reduce");
    copy(send, recv, count * dtype_size(dtype));
    return {};
  }
  CommHandle broadcast_async(void*, std::size_t, DType, int root) override {
    if (root != 0) throw CommError("single: broadcast root " + std::to_string(root) + " is not rank 0 of 1");
    return {};
  }
  void barrier() override {}

 private:
  static void copy(const void* src, void* dst, std::size_t bytes) {
    if (src != dst && bytes > 0) std::memmove(dst, src, bytes);
  }
  static void check_reduce_dtype(DType dtype, const char* op) {
    if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
      throw CommError(std::string("single: ") + op + " of dtype " + std::string(dtype_name(dtype)) +
                      " is not supported (f32, bf16, f16)");
    }
  }
};

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

int env_world_size() {
  const char* w = std::getenv("WORLD_SIZE");
  return w ? std::atoi(w) : 0;
}

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() { return std::make_unique<SingleCommunicator>(); }

bool communicator_backend_built(std::string_view backend) {
  if (backend == "single") return true;
#ifdef TIERMEM_HAVE_MPI
  if (backend == "mpi") return true;
#endif
#ifdef TIERMEM_HAVE_NCCL
  if (backend == "nccl") return true;
#endif
  return false;
}

#ifndef TIERMEM_HAVE_MPI
std::unique_ptr<Communicator> make_mpi_communicator() {
  throw NotSupportedError("communicator backend 'mpi' is not built (MPI was not found at configure time)");
}
#endif
#ifndef TIERMEM_HAVE_NCCL
std::unique_ptr<Communicator> make_nccl_communicator(int) {
  throw NotSupportedError("communicator backend 'nccl' is not built (needs CUDA and NCCL at configure time)");
}
#endif

std::unique_ptr<Communicator> make_communicator(const CommOptions& options) {
  std::string backend = options.backend;
  if (backend == "auto") {
    if (auto e = env_param("TIERMEM_COMM")) backend = *e;
  }
  if (backend == "auto") {
    bool multi = launched_by_mpi() || env_world_size() > 1;
    if (options.device_buffers && communicator_backend_built("nccl")) backend = "nccl";
    else if (multi) backend = "mpi";
    else backend = "single";
  }
  std::unique_ptr<Communicator> c;
  if (backend == "single") c = make_single_communicator();
  else if (backend == "mpi") c = make_mpi_communicator();
  else if (backend == "nccl") c = make_nccl_communicator(options.cuda_device);
  else throw NotSupportedError("communicator backend '" + backend + "' is unknown (auto|single|mpi|nccl)");
  int want = env_world_size();
  if (want > 0 && !launched_by_mpi() && want != c->world_size()) {
    throw CommError("WORLD_SIZE=" + std::to_string(want) + " but the " + std::string(c->backend()) +
                    " communicator has " + std::to_string(c->world_size()) +
                    " rank(s); launch the ranks with mpirun -np " + std::to_string(want));
  }
  TM_LOG_DEBUG("COMM", "communicator {}: rank {} of {}", c->backend(), c->rank(), c->world_size());
  return c;
}

}  // namespace tiermem
