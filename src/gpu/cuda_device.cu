// cuda_device.cu — CudaDevice: HBM through a caching allocator over cudaMalloc, separate H2D, D2H
// and D2D streams and an event per operation. Compiled only when the build has CUDA.
#include <cuda_runtime_api.h>

#include <string>

#include "gpu/caching_allocator.h"
#include "tiermem/cuda_device.h"
#include "tiermem/error.h"
#include "gpu/gpu_log.h"

#ifndef TM_CUDA_CHECK
#define TM_CUDA_CHECK(expr)                                                                     \
  do {                                                                                          \
    cudaError_t tm_err_ = (expr);                                                               \
    if (tm_err_ != cudaSuccess) {                                                               \
      throw ::tiermem::CudaError(std::string(#expr) + ": " + cudaGetErrorString(tm_err_) +      \
                                 " (" + __FILE__ + ":" + std::to_string(__LINE__) + ")");      \
    }                                                                                           \
  } while (0)
#endif

namespace tiermem {
namespace {

class CudaEventState final : public detail::DeviceEventState {
 public:
  CudaEventState(int device, cudaStream_t stream) : device_(device) {
    TM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    TM_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  ~CudaEventState() override { cudaEventDestroy(event_); }
  bool ready() override {
    cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) return false;
    if (rc != cudaSuccess) {
      record_error(rc, "cudaEventQuery");
    }
    return true;
  }
  void wait() override {
    cudaError_t rc = cudaEventSynchronize(event_);
    if (rc != cudaSuccess) record_error(rc, "cudaEventSynchronize");
    std::lock_guard lock(mu_);
    if (error_) std::rethrow_exception(error_);
  }
  std::exception_ptr error() override {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  void record_error(cudaError_t rc, const char* what) {
    std::lock_guard lock(mu_);
    if (!error_) {
      error_ = std::make_exception_ptr(CudaError(std::string(what) + " on device " +
                                                 std::to_string(device_) + ": " +
                                                 cudaGetErrorString(rc)));
    }
  }
  int device_;
  cudaEvent_t event_{};
  std::mutex mu_;
  std::exception_ptr error_;  // guarded by mu_
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::uint64_t budget_bytes) : ordinal_(ordinal) {
    TM_CUDA_CHECK(cudaSetDevice(ordinal_));
    cudaDeviceProp prop{};
    TM_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal_));
    name_ = "cuda:" + std::to_string(ordinal_) + " (" + prop.name + ")";
    if (budget_bytes == 0) {
      std::size_t free_b = 0, total_b = 0;
      TM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      budget_bytes = static_cast<std::uint64_t>(static_cast<double>(free_b) * 0.95);
    }
    for (cudaStream_t* s : {&h2d_, &d2h_, &d2d_, &compute_}) {
      TM_CUDA_CHECK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    }
    int dev = ordinal_;
    alloc_ = std::make_unique<detail::CachingAllocator>(
        budget_bytes,
        [dev](std::uint64_t bytes) -> void* {
          cudaSetDevice(dev);
          void* p = nullptr;
          if (cudaMalloc(&p, bytes) != cudaSuccess) {
            cudaGetLastError();
            return nullptr;
          }
          return p;
        },
        [dev](void* p, std::uint64_t) {
          cudaSetDevice(dev);
          cudaFree(p);
        });
  }

  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    cudaDeviceSynchronize();
    alloc_.reset();
    for (cudaStream_t s : {h2d_, d2h_, d2d_, compute_}) cudaStreamDestroy(s);
  }

  DeviceKind kind() const noexcept override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }
  bool host_addressable() const noexcept override { return false; }
  std::uint64_t budget_bytes() const noexcept override { return alloc_->budget(); }
  std::uint64_t allocation_size(std::uint64_t bytes) const noexcept override {
    return detail::CachingAllocator::round(bytes);
  }

  void* try_allocate(std::uint64_t bytes) noexcept override { return alloc_->try_allocate(bytes); }
  void* allocate(std::uint64_t bytes) override {
    void* p = alloc_->try_allocate(bytes);
    if (p == nullptr) {
      throw OutOfMemoryError(Tier::kDevice, allocation_size(bytes), alloc_->available(),
                             name_ + " budget " + format_bytes(alloc_->budget()));
    }
    return p;
  }
  void free(void* ptr) noexcept override {
    if (ptr != nullptr && !alloc_->free(ptr)) {
      detail::gpu_log_error("CudaDevice::free of an unknown pointer");
    }
  }
  void empty_cache() override { alloc_->empty_cache(); }

  DeviceEvent copy_h2d_async(void* dst, const void* src, std::uint64_t bytes) override {
    return copy(dst, src, bytes, cudaMemcpyHostToDevice, h2d_, stats_.h2d_bytes, stats_.h2d_copies);
  }
  DeviceEvent copy_d2h_async(void* dst, const void* src, std::uint64_t bytes) override {
    return copy(dst, src, bytes, cudaMemcpyDeviceToHost, d2h_, stats_.d2h_bytes, stats_.d2h_copies);
  }
  DeviceEvent copy_d2d_async(void* dst, const void* src, std::uint64_t bytes) override {
    return copy(dst, src, bytes, cudaMemcpyDeviceToDevice, d2d_, stats_.d2d_bytes, stats_.d2d_copies);
  }
  DeviceEvent memset_async(void* dst, int value, std::uint64_t bytes) override {
    if (bytes == 0) return {};
    TM_CUDA_CHECK(cudaSetDevice(ordinal_));
    TM_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, d2d_));
    return DeviceEvent(std::make_shared<CudaEventState>(ordinal_, d2d_));
  }
  DeviceEvent adam_step_async(const AdamParams& params, const DeviceAdamTensor* tensors,
                              std::size_t count, DType half_dtype) override {
    if (count > 0 && tensors == nullptr) throw Error("CudaDevice::adam_step_async: null tensor array");
    bool any_half = false;
    for (std::size_t i = 0; i < count; ++i) any_half = any_half || (tensors[i].half != nullptr && tensors[i].n > 0);
    // gpu_adam_step checks the dtype even when nothing is copied out.
    const DType dt = any_half ? half_dtype : DType::kBF16;
    TM_CUDA_CHECK(cudaSetDevice(ordinal_));
    gpu_adam_step(params, tensors, count, dt, compute_);
    return DeviceEvent(std::make_shared<CudaEventState>(ordinal_, compute_));
  }
  void synchronize() override {
    TM_CUDA_CHECK(cudaSetDevice(ordinal_));
    for (cudaStream_t s : {h2d_, d2h_, d2d_, compute_}) TM_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  bool register_host(void* base, std::uint64_t bytes) override {
    cudaError_t rc = cudaHostRegister(base, bytes, cudaHostRegisterDefault);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      detail::gpu_log_warn("cudaHostRegister(" + format_bytes(bytes) + ") failed: " +
                           cudaGetErrorString(rc) + "; copies from it will be staged");
      return false;
    }
    return true;
  }
  void unregister_host(void* base) override {
    if (cudaHostUnregister(base) != cudaSuccess) cudaGetLastError();
  }
  void* compute_stream() const noexcept override { return compute_; }

  DeviceStats stats() const override {
    DeviceStats s;
    {
      std::lock_guard lock(stats_mu_);
      s = stats_;
    }
    alloc_->fill_stats(s);
    return s;
  }

 private:
  DeviceEvent copy(void* dst, const void* src, std::uint64_t bytes, cudaMemcpyKind kind,
                   cudaStream_t stream, std::uint64_t& byte_counter, std::uint64_t& copy_counter) {
    if (bytes == 0) return {};
    TM_CUDA_CHECK(cudaSetDevice(ordinal_));
    TM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    {
      std::lock_guard lock(stats_mu_);
      byte_counter += bytes;
      ++copy_counter;
    }
    return DeviceEvent(std::make_shared<CudaEventState>(ordinal_, stream));
  }

  int ordinal_;
  std::string name_;
  cudaStream_t h2d_{}, d2h_{}, d2d_{}, compute_{};
  std::unique_ptr<detail::CachingAllocator> alloc_;
  mutable std::mutex stats_mu_;
  DeviceStats stats_;  // guarded by stats_mu_ (copy counters only)
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int ordinal, std::uint64_t budget_bytes) {
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess || n == 0) {
    cudaGetLastError();
    throw NotSupportedError(std::string("CudaDevice: no CUDA device is visible (") +
                            (rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices") + ")");
  }
  if (ordinal < 0 || ordinal >= n) {
    throw NotSupportedError("CudaDevice: device " + std::to_string(ordinal) + " requested but " +
                            std::to_string(n) + " visible");
  }
  return std::make_unique<CudaDevice>(ordinal, budget_bytes);
}

}  // namespace tiermem
