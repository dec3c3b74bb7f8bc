// tiermem/device.h — the device tier: an accelerator's memory (GPU HBM) and the copy engines that
// move bytes between it and host memory.
//
//   std::unique_ptr<Device> dev = make_device(config);     // tiermem.device: auto | cuda | sim
//   void* d = dev->allocate(64 << 20);                     // OutOfMemoryError(kDevice) over budget
//   DeviceEvent e = dev->copy_h2d_async(d, host_buf, 64 << 20);
//   ... overlap other work ...
//   e.wait();                                              // host_buf may be reused now
//   dev->free(d);
//
// Two implementations: CudaDevice (cuda_device.h; CUDA HBM, separate H2D and D2H copy streams,
// a caching allocator over cudaMalloc) and SimDevice (sim_device.h; host memory behind a hard
// budget, one copy-engine thread per direction, optional PCIe-like bandwidth throttle). Everything
// above src/gpu is written against this interface and tested on SimDevice.
//
// Memory: allocate() hands out device pointers, 256-byte aligned, from a caching allocator (freed
// blocks are kept for reuse, so steady-state training calls no cudaMalloc). The budget bounds the
// bytes the allocator holds (allocated + cached): it is never exceeded; when a request does not
// fit, the cache is released first and only then OutOfMemoryError(Tier::kDevice, requested,
// available) is thrown. A "device pointer" is host-addressable (the CPU may read and write it)
// exactly when host_addressable() is true — SimDevice — so CPU kernels may compute in place there.
//
// Copies: copy_*_async enqueue a copy on the copy engine of its direction (H2D, D2H; D2D and
// memset share the H2D engine on SimDevice, run on the D2D stream on CUDA) and return at once.
// Copies of one direction complete in the order they were issued; different directions overlap.
// The source and destination must stay valid, and the source unmodified, until the returned event
// is complete. Host buffers may be any host memory; pinned (page-locked, register_host()ed) memory
// makes CUDA copies truly asynchronous and faster.
//
// Compute: adam_step_async runs one multi-tensor AdamW step on device memory (optimizer state kept
// on the device: ZeroEngine with offload_optimizer none) — gpu_adam_step on the compute stream
// (CUDA), the CPU AdamW kernel on the memory itself (SimDevice, in either addressing mode).
//
// Thread-safety: every Device method is thread-safe. A DeviceEvent is a cheap shared handle;
// its methods are thread-safe. The Device must outlive its events and allocations.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "tiermem/export.h"
#include "tiermem/gpu_adam.h"
#include "tiermem/tier.h"

namespace tiermem {

struct Config;

// One tensor of Device::adam_step_async: DEVICE pointers, n elements each (fp32 master, grad, m,
// v; half: n elements of the half dtype, or null for no copy-out). The same struct as
// gpu_adam_step takes.
using DeviceAdamTensor = GpuAdamTensor;

// The CPU AdamW a SimDevice runs for adam_step_async, with tiermem::adam_step's meaning (the
// default AdamOptions: the best ISA, OpenMP's threads). tiermem::gpu does not link the CPU kernels
// (src/cpu); whoever makes the device passes them (ZeroEngine passes tiermem::adam_step, so its
// device-resident optimizer computes bit for bit what its host optimizer computes).
using SimAdamKernel = void (*)(const AdamParams& params, float* master, const float* grad, float* m,
                               float* v, std::size_t n, void* half, DType half_dtype);

enum class DeviceKind : std::uint8_t { kSim, kCuda };

namespace detail {
// Completion state behind a DeviceEvent; implemented per backend.
class DeviceEventState {
 public:
  virtual ~DeviceEventState() = default;
  virtual bool ready() = 0;  // never throws
  virtual void wait() = 0;   // rethrows the copy's error
  virtual std::exception_ptr error() = 0;
};
}  // namespace detail

// Completion of one asynchronous device operation (a copy or memset). Copyable; copies share state.
// A default-constructed event is complete.
class TIERMEM_API DeviceEvent {
 public:
  DeviceEvent() = default;
  explicit DeviceEvent(std::shared_ptr<detail::DeviceEventState> s) : state_(std::move(s)) {}

  // True once the operation finished (successfully or not). Never blocks, never throws.
  bool ready() const { return !state_ || state_->ready(); }
  // Blocks until it finished; then its buffers may be reused. Rethrows its error (CudaError, or
  // Error for a failed simulated copy); every call rethrows it again.
  void wait() const {
    if (state_) state_->wait();
  }
  // The error once finished, null when it succeeded or is still running.
  std::exception_ptr error() const { return state_ ? state_->error() : nullptr; }
  bool valid() const noexcept { return state_ != nullptr; }

 private:
  std::shared_ptr<detail::DeviceEventState> state_;
};

// Counters since the device was made (monotonic except the *_bytes gauges).
struct TIERMEM_API DeviceStats {
  std::uint64_t budget_bytes = 0;          // hard cap on allocated + cached bytes
  std::uint64_t allocated_bytes = 0;       // live allocations (rounded sizes)
  std::uint64_t cached_bytes = 0;          // freed blocks kept by the caching allocator
  std::uint64_t peak_allocated_bytes = 0;  // max of allocated_bytes
  std::uint64_t peak_reserved_bytes = 0;   // max of allocated + cached (never above budget)
  std::uint64_t allocations = 0;           // allocate() calls that succeeded
  std::uint64_t cache_hits = 0;            // of which were served from the cache
  std::uint64_t backend_allocations = 0;   // cudaMalloc / host allocations made
  std::uint64_t h2d_bytes = 0, d2h_bytes = 0, d2d_bytes = 0;
  std::uint64_t h2d_copies = 0, d2h_copies = 0, d2d_copies = 0;
};

class TIERMEM_API Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceKind kind() const noexcept = 0;
  // "sim" or "cuda:0 (NVIDIA H200)"; for logs.
  virtual std::string name() const = 0;
  // True when device pointers may be dereferenced by the CPU (SimDevice). CPU kernels may then
  // compute directly on device memory; otherwise only copies and device kernels may touch it.
  virtual bool host_addressable() const noexcept = 0;
  // True when NVMe reads may land in, and writes leave from, device memory directly, with no
  // bounce buffer and no device copy (the TensorStore's NVMe<->device transfers): SimDevice when
  // host-addressable and unthrottled (its memory is the CPU's own; a throttled one models a copy
  // link, which such a transfer would skip). False for CudaDevice (GPUDirect Storage is not used).
  virtual bool storage_direct() const noexcept { return false; }

  // The hard cap on bytes the allocator holds (allocated + cached), bytes.
  virtual std::uint64_t budget_bytes() const noexcept = 0;
  // The size (bytes) an allocation of `bytes` really takes from the budget (rounded up to the
  // allocator's granularity, at least 256). Pure; lets callers account exactly.
  virtual std::uint64_t allocation_size(std::uint64_t bytes) const noexcept = 0;

  // A device buffer of at least `bytes` bytes (256-byte aligned, contents undefined), owned by the
  // caller until free(). bytes == 0 gives a unique non-null pointer of allocation_size(1).
  // Throws OutOfMemoryError(Tier::kDevice, requested, available) when it does not fit in the
  // budget even after releasing the cache; CudaError when the backend fails otherwise.
  virtual void* allocate(std::uint64_t bytes) = 0;
  // Like allocate() but returns nullptr instead of throwing OutOfMemoryError.
  virtual void* try_allocate(std::uint64_t bytes) noexcept = 0;
  // Returns a buffer from allocate() to the cache. nullptr is ignored. The caller must have
  // waited for every operation using it. Never throws (an unknown pointer is logged).
  virtual void free(void* ptr) noexcept = 0;
  // Releases cached (free) blocks to the backend (cudaFree). Allocated blocks are untouched.
  virtual void empty_cache() = 0;

  // Asynchronous copies and memset (see the top of this file for ordering and buffer lifetime).
  // `bytes` may be 0 (the event is complete at once). Invalid arguments throw Error at once.
  virtual DeviceEvent copy_h2d_async(void* dst_device, const void* src_host, std::uint64_t bytes) = 0;
  virtual DeviceEvent copy_d2h_async(void* dst_host, const void* src_device, std::uint64_t bytes) = 0;
  virtual DeviceEvent copy_d2d_async(void* dst_device, const void* src_device, std::uint64_t bytes) = 0;
  virtual DeviceEvent memset_async(void* dst_device, int value, std::uint64_t bytes) = 0;

  // Synchronous helpers: issue and wait.
  void copy_h2d(void* dst_device, const void* src_host, std::uint64_t bytes) {
    copy_h2d_async(dst_device, src_host, bytes).wait();
  }
  void copy_d2h(void* dst_host, const void* src_device, std::uint64_t bytes) {
    copy_d2h_async(dst_host, src_device, bytes).wait();
  }

  // One AdamW step (tiermem/adam.h's formula) over tensors[0..count), in device memory: each
  // tensor's master, m and v are updated in place and, when its half is not null, the new master
  // is written there rounded to `half_dtype` (kBF16 or kF16; ignored when no tensor has a half).
  // Every pointer must lie inside a live allocation of this device (SimDevice checks: Error at
  // once; CUDA: any device memory of its GPU). `tensors` is copied before the call returns; the
  // device buffers must stay valid and untouched until the returned event is complete.
  // Asynchronous: CudaDevice enqueues gpu_adam_step on its compute stream (compute_stream());
  // SimDevice runs its CPU kernel (SimDeviceOptions::adam_kernel) on its H2D engine thread, on its
  // own read-write view of the memory when that is not host-addressable. Ordering with copies is
  // the caller's: wait for the copies that write its inputs before the call, and for its event
  // before copying its outputs (different engines/streams). Results: CUDA within adam.h's stated
  // tolerance of the CPU kernels; SimDevice bit for bit tiermem::adam_step's.
  // Tensors with n == 0 are skipped (their pointers may be null).
  // Errors: Error for a pointer outside the device's allocations (SimDevice) or a null `tensors`
  // with count > 0; NotSupportedError for a half dtype other than bf16/fp16 when a half is
  // given, or a SimDevice made without a kernel; CudaError from the launch (at once) or the
  // kernel (from the event). The base class's version throws NotSupportedError (a Device with no
  // compute, e.g. a test's fake).
  virtual DeviceEvent adam_step_async(const AdamParams& params, const DeviceAdamTensor* tensors,
                                      std::size_t count, DType half_dtype);

  // Blocks until every operation issued so far (all streams / copy engines) has finished.
  // Rethrows the first error of an operation whose event nobody waited for.
  virtual void synchronize() = 0;

  // Page-locks host memory for the device's DMA (cudaHostRegister) so copies from/to it are
  // asynchronous and at full bandwidth. Returns false (and logs once) when that is not possible;
  // copies still work. SimDevice: no-op, returns true. unregister_host(base) undoes it.
  virtual bool register_host(void* base, std::uint64_t bytes) = 0;
  virtual void unregister_host(void* base) = 0;

  // The native stream device kernels should run on (cudaStream_t as void*), nullptr on SimDevice
  // (CPU kernels run on the calling thread).
  virtual void* compute_stream() const noexcept { return nullptr; }

  virtual DeviceStats stats() const = 0;

 protected:
  Device() = default;
};

// Which backend make_device picks.
enum class DeviceChoice : std::uint8_t { kAuto, kCuda, kSim };

// Settings of make_device. from_config reads tiermem.device, device_budget_bytes, sim_h2d_gbps,
// sim_d2h_gbps, sim_host_addressable.
struct TIERMEM_API DeviceOptions {
  DeviceChoice choice = DeviceChoice::kAuto;
  int cuda_device = 0;              // CUDA ordinal (CudaDevice)
  std::uint64_t budget_bytes = 0;   // 0: Sim 1 GiB; CUDA all free memory minus 5% headroom
  double sim_h2d_gbps = 0;          // SimDevice throttle in GB/s (1e9 B/s); 0 = unthrottled
  double sim_d2h_gbps = 0;
  // SimDevice: false makes its memory not host-addressable (the CPU twin of CudaDevice; see
  // sim_device.h). CudaDevice memory never is.
  bool sim_host_addressable = true;
  // SimDevice: the CPU AdamW its adam_step_async runs (see SimAdamKernel); null: that call throws
  // NotSupportedError. Not read from the config (the program passes it).
  SimAdamKernel sim_adam_kernel = nullptr;

  // Throws ConfigError (key "tiermem.device") for a value other than auto|cuda|sim.
  static DeviceOptions from_config(const Config& config);
};

// True when this build has CUDA and at least one CUDA device is visible (cudaGetDeviceCount > 0).
// Never throws ("driver version is insufficient" and similar count as no device).
TIERMEM_API bool cuda_device_available() noexcept;

// What a look for CUDA devices found, with the reason when none is usable (for one-line messages).
struct TIERMEM_API CudaProbe {
  bool built_with_cuda = false;  // this build compiled CudaDevice (TIERMEM_HAVE_CUDA)
  int device_count = 0;          // visible CUDA devices; 0 when none or the runtime failed
  std::string device0_name;      // "NVIDIA H200" when device_count > 0
  // "" when device_count > 0; else why not, e.g. "this build has no CUDA", "cudaGetDeviceCount:
  // CUDA driver version is insufficient for CUDA runtime version (no GPU driver)".
  std::string reason;
  bool usable() const noexcept { return device_count > 0; }
};
// Looks (cudaGetDeviceCount, cudaGetDeviceProperties of device 0). Never throws.
TIERMEM_API CudaProbe probe_cuda() noexcept;

// Makes the device the options ask for: kAuto = CudaDevice when cuda_device_available(), else
// SimDevice; the choice and why is logged once (GPU tag). kCuda without CUDA (build or device)
// throws NotSupportedError saying which is missing.
TIERMEM_API std::unique_ptr<Device> make_device(const DeviceOptions& options);
TIERMEM_API std::unique_ptr<Device> make_device(const Config& config);

}  // namespace tiermem
