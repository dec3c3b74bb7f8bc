// src/zero/zero_device.cc — ZeroEngine's side of the device tier. Where each optimizer
// sub-group's new working parameters go is WorkingShardOut's (working_shard_out.h), the device
// staging's copies DeviceStaging's (device_staging.h); here, what the engine does with memory of a device
// the CPU cannot address (CudaDevice; SimDevice with
// tiermem.sim_host_addressable false), where only the Device's copy API may touch it:
//   publication   new working params of a device-homed shard are written by AdamW into a device-
//                 staging sub-group (host memory) and copied up (two alternate, so copy k overlaps AdamW k+1);
//   all-gather    several ranks: the shard goes down to a device-staging host buffer, is all-gathered
//                 there and the full module copied up into a device buffer (with a communicator
//                 that takes device buffers, NCCL, in place in device memory instead);
//   gradients     reduce_gradients_from_device copies the module's gradient down to a host buffer
//                 and reduces it from there.
// On a host-addressable device (SimDevice's default) the same calls work on the memory in place.
#include <fmt/format.h>

#include <algorithm>

#include "tiermem/log.h"
#include "zero/zero_impl.h"

namespace tiermem {

// --------------------------------------------------------------------------------- gradients

void ZeroEngine::reduce_gradients_from_device(int module, const float* grad_device,
                                              std::size_t numel) {
  Impl& I = *impl_;
  I.finalize();
  if (module < 0 || module >= num_modules()) {
    throw Error("ZeroEngine::reduce_gradients_from_device: unknown module " +
                std::to_string(module));
  }
  const detail::ZeroModule& m = I.mods[static_cast<std::size_t>(module)];
  if (!I.device) {
    throw Error(fmt::format(
        "ZeroEngine::reduce_gradients_from_device: module {} ({}): this engine has no device "
        "tier (stage {}{}); hand the gradient over from host memory (reduce_gradients)",
        module, m.name, I.shape.stage, I.shape.stage == 3 ? ", every module persistent" : ""));
  }
  if (numel != m.numel) {
    throw Error(fmt::format(
        "ZeroEngine::reduce_gradients_from_device: module {} ({}) gradient has {} elements, "
        "expected {}",
        module, m.name, numel, m.numel));
  }
  if (grad_device == nullptr && numel > 0) {
    throw Error("ZeroEngine::reduce_gradients_from_device: null gradient pointer");
  }
  if (!I.shape.opaque) {  // host-addressable device memory: reduced in place
    reduce_gradients(module, std::span<const float>(grad_device, numel));
    return;
  }
  // One host buffer of the largest module, made at the first call and kept.
  std::size_t largest = 0;
  for (const auto& x : I.mods) largest = std::max(largest, x.numel);
  reduce_gradients(module, std::span<const float>(I.staging.stage_gradient(grad_device, numel, largest), numel));
}

Device* ZeroEngine::device() const noexcept { return impl_->device.get(); }

}  // namespace tiermem
