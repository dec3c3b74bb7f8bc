// src/zero/device_staging.h — device staging: the engine's own copies between host and device
// memory, outside the TensorStore (which moves and counts its tensors itself). "Device staging"
// is this part's word, and only this: tiermem.torch's zero.Init keeps what it builds in files of
// its own, which are no part of the engine. What it stages:
//   a device the CPU cannot address (shape.opaque: CudaDevice, SimDevice with
//   tiermem.sim_host_addressable false) is touched only through the Device's copy API, through
//   its host buffers: new working params on their way up (two publish buffers that alternate,
//   WorkingShardOut), an all-gather staged through host memory (all_gather_to_device), a module's
//   gradient on its way down (stage_gradient), a checkpoint's device-homed state (state_buffer);
//   the device-resident optimizer's scratch sub-groups in device memory (a gradient not homed on
//   the device, new working params bound for host memory; zero_device_step.cc).
// It owns those buffers and counts what it copies (ZeroStats::host_to_device_bytes and
// device_to_host_bytes get its share) and what it holds (host_bytes: part of host_engine_bytes;
// device_scratch_bytes: part of device_peak_bytes).
//
// Ownership: the buffers are the staging's, reused across calls (a publish buffer until the next
// publish_buffer() of the same index, the gradient's until the next stage_gradient(), scratch
// until the next call that reserves it). A device buffer returned by all_gather_to_device is the
// caller's (freed with device->free). Completion: synchronous copies, except publish_async: its
// event says when the publish buffer may be written again. Thread-safety: none; the engine's
// driving thread only. Errors: the Device's (CudaError, OutOfMemoryError) and the
// communicator's CommError; a failed all_gather_to_device frees its device buffer first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "tiermem/communicator.h"
#include "tiermem/device.h"
#include "tiermem/tensor_store.h"
#include "tiermem/zero_engine.h"
#include "zero/zero_types.h"

namespace tiermem::detail {

class DeviceStaging {
 public:
  // `device`: the engine's (null until its tiers are made, and without a device tier).
  DeviceStaging(Communicator& comm, const EngineShape& shape, const std::shared_ptr<Device>& device,
                HostPeakSampler sample_host_peak)
      : comm_(comm), shape_(shape), device_(device), sample_host_peak_(std::move(sample_host_peak)) {}
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // The tier gather() pins module m's working shard at: the compute tier, except when an opaque
  // device's all-gather is staged through host memory anyway (several ranks, a host
  // communicator) and the shard is not homed on the device: then the host tier (no copy down).
  // (The host tier for a quantized frozen module not homed on the device: ZeroModule::quantized.)
  // The host tier too for a frozen module homed on the host tier of a device the CPU addresses
  // (SimDevice): its home copy is read in place, where a device copy would be the same bytes
  // again (a LoRA base with offload_param cpu held twice: host home + device cache).
  Tier gather_tier(const ZeroModule& m) const;
  // Copies `bytes` host bytes to offset `offset` of a pin (synchronously; through the device's
  // copy when the pin is opaque device memory).
  void upload(const TensorStore::Pin& pin, std::size_t offset, const void* src, std::size_t bytes);
  // Several ranks: module m's working shard (pinned at the device or host tier) all-gathered into
  // a new device buffer of m.shard.padded working elements: through a host staging buffer unless
  // the communicator takes device buffers (NCCL). Releases `pin`.
  void* all_gather_to_device(const ZeroModule& m, TensorStore::Pin& pin);
  // `numel` fp32 gradient elements copied down from device memory into the staging buffer (made
  // for `largest` elements, kept), returned.
  const float* stage_gradient(const float* grad_device, std::size_t numel, std::size_t largest);

  // Publish buffer b (0 or 1) of at least `bytes` (made max(bytes, min_bytes) when smaller: the
  // old one freed first, so at most two live). The caller has waited for its last publish_async.
  std::byte* publish_buffer(int b, std::size_t bytes, std::size_t min_bytes);
  // Copies `bytes` of publish buffer b up to `dst` (device memory), asynchronously.
  DeviceEvent publish_async(void* dst, int b, std::size_t bytes);

  // A checkpoint's staging of device-homed state: `buf` made `bytes` at its first use and counted
  // live until state_done() (the caller's scope ends).
  float* state_buffer(AlignedBuf& buf, std::size_t bytes);
  void state_done() { state_live_ = 0; }

  // The device-resident optimizer's scratch: `n` fp32 of host gradient `g` uploaded into a
  // scratch sub-group of `cap` elements (device memory), returned.
  const float* gradient_to_scratch(const float* g, std::size_t n, std::size_t cap);
  // A device scratch sub-group of at least `bytes` for new working params bound for host memory.
  void* out_scratch(std::size_t bytes);
  // `bytes` copied down from device memory `src` to host `dst` (counted).
  void copy_down(void* dst, const void* src, std::size_t bytes);
  void count_h2d(std::uint64_t bytes) { h2d_bytes_ += bytes; }

  std::uint64_t host_bytes() const;            // staging buffers held now
  std::uint64_t device_scratch_bytes() const;  // as the device's allocator counts them
  void add_stats(ZeroStats& s) const;          // host_to_device_bytes, device_to_host_bytes

 private:
  Communicator& comm_;
  const EngineShape& shape_;
  const std::shared_ptr<Device>& device_;
  const HostPeakSampler sample_host_peak_;
  AlignedBuf publish_[2];             // new working params of one sub-group, on their way up
  AlignedBuf grad_;                   // stage_gradient: the module's gradient
  std::uint64_t gather_live_ = 0;     // host bytes of an all-gather being staged now
  std::uint64_t state_live_ = 0;      // host bytes staging a checkpoint of device-homed state
  DeviceBuf grad_scratch_, out_scratch_;  // device memory (each holds the device it was made on)
  std::uint64_t h2d_bytes_ = 0, d2h_bytes_ = 0;  // bytes copied by the engine itself
};

}  // namespace tiermem::detail
