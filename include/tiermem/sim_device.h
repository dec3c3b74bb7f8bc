// tiermem/sim_device.h — SimDevice: the device tier on a machine without a GPU, and the device every
// test runs on. Not a mock: host memory behind a hard budget with the same caching allocator as
// CudaDevice, real asynchronous copies on one copy-engine thread per direction (H2D; D2H; D2D and
// memset run on the H2D engine), events that complete when their copies finish, and an optional
// bandwidth throttle that makes copies take as long as over PCIe.
//
// Device pointers are ordinary host memory (host_addressable() is true): CPU kernels compute on
// them in place. Copies check that the device side lies inside a live allocation (Error at once
// otherwise), which catches use-after-free and overruns in tests.
//
// With SimDeviceOptions::host_addressable = false (config tiermem.sim_host_addressable: false) it
// is the CPU twin of CudaDevice instead: host_addressable() is false and a device pointer is an
// address the CPU may NOT touch. Each backend allocation is a memfd mapped twice: the device
// pointer lies in a PROT_NONE view (any load or store through it by host code is a SIGSEGV at
// once, so a test of code that dereferences device memory fails at the offending access), and
// only the copy engines reach the bytes, through a second, private read-write view. Budgets,
// events and ordering are as in the default mode; only the copy API moves bytes.
//
// Thread-safety: as Device (every method thread-safe). Destruction waits for queued copies.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "tiermem/device.h"
#include "tiermem/export.h"

namespace tiermem {

namespace detail {
class CachingAllocator;
}

struct TIERMEM_API SimDeviceOptions {
  std::uint64_t budget_bytes = 1ull << 30;  // hard cap (allocated + cached), bytes
  double h2d_gbps = 0;  // copy throttle, GB/s (1e9 bytes/s); 0 = as fast as memcpy
  double d2h_gbps = 0;
  // false: device memory is not host-addressable (see the top of this file).
  bool host_addressable = true;
  // The CPU AdamW adam_step_async runs (DeviceOptions::sim_adam_kernel); null: NotSupportedError.
  SimAdamKernel adam_kernel = nullptr;
};

class TIERMEM_API SimDevice final : public Device {
 public:
  explicit SimDevice(SimDeviceOptions options = {});
  ~SimDevice() override;

  DeviceKind kind() const noexcept override { return DeviceKind::kSim; }
  std::string name() const override {
    return options_.host_addressable ? "sim" : "sim (not host-addressable)";
  }
  bool host_addressable() const noexcept override { return options_.host_addressable; }
  bool storage_direct() const noexcept override {
    return options_.host_addressable && options_.h2d_gbps == 0 && options_.d2h_gbps == 0;
  }
  std::uint64_t budget_bytes() const noexcept override { return options_.budget_bytes; }
  std::uint64_t allocation_size(std::uint64_t bytes) const noexcept override;

  void* allocate(std::uint64_t bytes) override;
  void* try_allocate(std::uint64_t bytes) noexcept override;
  void free(void* ptr) noexcept override;
  void empty_cache() override;

  DeviceEvent copy_h2d_async(void* dst_device, const void* src_host, std::uint64_t bytes) override;
  DeviceEvent copy_d2h_async(void* dst_host, const void* src_device, std::uint64_t bytes) override;
  DeviceEvent copy_d2d_async(void* dst_device, const void* src_device, std::uint64_t bytes) override;
  DeviceEvent memset_async(void* dst_device, int value, std::uint64_t bytes) override;
  DeviceEvent adam_step_async(const AdamParams& params, const DeviceAdamTensor* tensors,
                              std::size_t count, DType half_dtype) override;
  void synchronize() override;

  bool register_host(void*, std::uint64_t) override { return true; }
  void unregister_host(void*) override {}

  DeviceStats stats() const override;
  const SimDeviceOptions& options() const noexcept { return options_; }

 private:
  // One copy engine: a FIFO of copies run by its own thread (guards its queue with its own mutex).
  class Engine;
  // Non-addressable mode: the memfd-backed blocks and the read-write view of each (own mutex).
  class OpaqueMemory;
  // Host-addressable mode: anonymous mappings whose pages are handed on from freed blocks to the
  // next allocation (own mutex).
  class HostMemory;

  // The address the copy engines use for device pointer p (p itself when host-addressable).
  void* engine_ptr(const void* p) const;

  void check_device_range(const void* p, std::uint64_t bytes, const char* what) const;

  SimDeviceOptions options_;
  std::unique_ptr<OpaqueMemory> opaque_;  // before alloc_: outlives the blocks it backs
  std::unique_ptr<HostMemory> host_;      // likewise
  std::unique_ptr<detail::CachingAllocator> alloc_;
  std::unique_ptr<Engine> h2d_, d2h_;
  mutable std::mutex stats_mu_;
  DeviceStats copy_stats_;  // guarded by stats_mu_ (only the copy counters are used)
};

}  // namespace tiermem
