// src/zero/zero_types.h — the plain data ZeroEngine's parts share: the engine's shape, its
// modules and optimizer sub-groups, and the engine's own host and device buffers.
// No behaviour beyond the buffers' RAII. Units: elements unless a name ends in _bytes/bytes.
// Thread-safety: plain data; whoever owns a value guards it (the engine's driving thread, except
// where the gradient reducer's contract says otherwise).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tiermem/device.h"
#include "tiermem/dtype.h"
#include "tiermem/error.h"
#include "tiermem/quantize.h"
#include "tiermem/shard.h"
#include "tiermem/tensor_store.h"

namespace tiermem::detail {

// The engine's shape: what the configuration and the communicator fix at construction (rank,
// world, stage, dtypes) and what make_tiers decides once (the tiers). Filled before any part
// runs; the parts read it through a const reference and never change it.
// The update rule step() runs on each sub-group (optimizer.type). The sub-group's fp32 state is
// [master | slot 1 | slot 2] for all: AdamW's exp_avg and exp_avg_sq; Lion's exp_avg in slot 1
// (slot 2 unused, zero); Adagrad's sum in slot 2 (DeepSpeed's "exp_avg_sq"; slot 1 unused).
enum class OptimizerKind { kAdamW, kLion, kAdagrad };

struct EngineShape {
  int rank = 0, world = 1;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  int opt_world = 1, opt_rank = 0;  // stage 0: optimizer state is not partitioned
  int stage = 0;
  std::size_t wsize = 4;            // bytes of one working-parameter element
  DType wdtype = DType::kF32;       // working parameters (f32, bf16, f16)
  DType comm_dtype = DType::kF32;   // of the working-parameter all-gathers (kU16: 16-bit bits)
  bool loss_scaled = false;         // fp16: a dynamic loss scaler checks for overflow
  Tier compute_tier = Tier::kHost;  // where gathers pin working shards
  Tier grad_tier = Tier::kHost;     // where gradient partitions are accumulated and read (home
                                    // device: the device-resident optimizer, addressable device)
  Tier publish_tier = Tier::kHost;  // where step() writes stored shards homed below the device
                                    // (and holds them while their sub-groups step: ZeroPlan::
                                    // updates_on_device)
  // The device's memory is not host-addressable (CudaDevice; SimDevice with
  // tiermem.sim_host_addressable false): the engine touches it only through the Device's copy
  // API, through the device staging's host buffers (device_staging.h).
  bool opaque = false;
  // How frozen modules' stored working shards sit on their tier (tiermem.frozen_dtype resolved
  // against the working dtype: tiermem/quantize.h).
  FrozenDtype frozen_at_rest = FrozenDtype::kWorking;
  // Every module is frozen (ZeroEngineOptions::frozen_modules): the engine's passes only read
  // (PrefetcherOptions::from_config's forward_only).
  bool forward_only = false;
};

// Called by a part right after its host memory grew, so that the engine samples its whole host
// footprint (ZeroStats::host_engine_peak_bytes) at the same moments as before the parts existed;
// `uncounted`: bytes of the footprint not to count at this sample.
using HostPeakSampler = std::function<void(std::uint64_t uncounted)>;

// 4 KiB-aligned zeroed heap buffer (engine host buffers; counted in ZeroStats::host_engine_bytes).
struct AlignedBuf {
  void* p = nullptr;
  std::size_t bytes = 0;
  AlignedBuf() = default;
  explicit AlignedBuf(std::size_t n) : bytes(n) {
    if (n == 0) return;
    p = std::aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!p) throw OutOfMemoryError(Tier::kHost, n, 0, "ZeroEngine host buffer");
    std::memset(p, 0, n);
  }
  AlignedBuf(AlignedBuf&& o) noexcept : p(o.p), bytes(o.bytes) {
    o.p = nullptr;
    o.bytes = 0;
  }
  AlignedBuf& operator=(AlignedBuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~AlignedBuf() { std::free(p); }
  float* f() const { return static_cast<float*>(p); }
  std::byte* b() const { return static_cast<std::byte*>(p); }
};

// A device buffer owned by the engine (freed on destruction; the device must outlive it).
struct DeviceBuf {
  std::shared_ptr<Device> device;
  void* p = nullptr;
  std::uint64_t bytes = 0;
  DeviceBuf() = default;
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
  ~DeviceBuf() {
    if (p != nullptr) device->free(p);
  }
  // At least `n` bytes (reallocated when smaller; contents undefined).
  void reserve(const std::shared_ptr<Device>& d, std::uint64_t n) {
    if (p != nullptr && bytes >= n) return;
    if (p != nullptr) device->free(p);
    p = nullptr;
    device = d;
    p = device->allocate(n);
    bytes = n;
  }
  float* f() const { return static_cast<float*>(p); }
  std::byte* b() const { return static_cast<std::byte*>(p); }
};

// One optimizer sub-group: a range of one module's shard.
struct SubGroup {
  int module = 0;
  std::size_t begin = 0, end = 0;  // within the module's shard (elements)
  std::size_t flat = 0;            // rank-flat offset of `begin`
  TensorId optim = kInvalidTensor; // fp32 [master | exp_avg | exp_avg_sq], 3 x size(); without the
                                   // master (2 x size()) when its module's shared_master
  TensorId grad = kInvalidTensor;  // stages 2-3: fp32 gradient partition, size()
  bool grad_fresh = true;          // no gradient since the last step: contents undefined
  // Its state is homed on the device and stepped there (the device-resident optimizer, or the
  // device's share under offload_optimizer.ratio < 1); gtier: where its gradient partition is
  // accumulated and read (the device when homed there, else the host).
  bool on_device = false;
  Tier gtier = Tier::kHost;
  std::size_t acc_elems = 0;       // elements accumulated so far in the current reduce call
  std::size_t size() const { return end - begin; }
};

// TensorSpec::group of the engine's tensors (the NVMe traffic split of ZeroStats): working
// params (trainable, frozen), optimizer state (master and moments), gradient partitions.
inline constexpr std::uint8_t kGroupTrainable = 1, kGroupFrozen = 2, kGroupOptimizer = 3, kGroupGradient = 4;

struct ZeroModule {
  std::string name;
  std::size_t numel = 0;
  ModuleShard shard;
  std::size_t flat = 0;        // rank-flat offset of the shard
  bool persistent = false;     // stage 3, below the persistence threshold: kept whole
  bool stored = false;         // stage 3 working shard is a store tensor (`param`)
  bool registered = false;     // tensors written (registration streamed or finalized)
  bool frozen = false;         // no master, gradient or optimizer state (ZeroEngineOptions)
  // fp32 working params that are the master weights (tiermem.fp32_single_copy): `param` holds
  // the fp32 master, and each sub-group's `optim` holds only its two moment slots (2 x size()).
  // Set at registration for a stored, trained module homed where the optimizer state is (host or
  // NVMe, not the device), on a host-addressable device, stepped by the CPU.
  bool shared_master = false;
  TensorId param = kInvalidTensor;
  Tier home = Tier::kHost;     // of `param` (stored modules)
  // How `param` is stored: a frozen stored module in EngineShape::frozen_at_rest's format
  // (at_rest_bytes of its shard; dequantized at gather and export), else the working dtype.
  FrozenDtype at_rest = FrozenDtype::kWorking;
  bool quantized() const { return at_rest != FrozenDtype::kWorking; }
  AlignedBuf mem_shard;        // working shard when !stored (stage 0: the full copy)
  AlignedBuf full;             // stages 1-2 and persistent: the all-gathered working params
  std::vector<float> full_grad;   // stages 0-1: full padded fp32 gradient
  std::vector<float> shard_grad;  // stage 1: the reduce-scattered shard
  std::vector<float> init_shard;  // deferred registration only (no numels up front)
  std::vector<int> sub_groups;        // indices into the engine's sub-groups (consecutive)
  int grad_calls = 0;
  // Updated during this step's backward (ZeroEngine::step_in_backward): step() passes it over, and
  // its gradient (consumed) still counts in the step's folded norm.
  bool stepped_in_backward = false;
  // Optimizer-phase accesses its update made outside a step (a checkpoint export, an eval
  // gather): shown to the store's policy at the next in-step gather (touch) so the recorded
  // access trace still matches.
  std::vector<std::pair<TensorId, Tier>> replay;  // the tensor and the tier it was pinned at

  // The tier an update holds this stored module's working shard at (step(), a deferred update,
  // a checkpoint's export and import): the device when that is its home, else `publish`
  // (EngineShape::publish_tier, or the tier a deferred update's gather reads).
  Tier update_tier(Tier publish) const { return home == Tier::kDevice ? Tier::kDevice : publish; }
};

}  // namespace tiermem::detail
