// src/zero/zero_device.cc — ZeroEngine's side of the device tier: where each optimizer
// sub-group's new working parameters go (WorkingShardOut), and everything the engine does with
// memory of a device the CPU cannot address (CudaDevice; SimDevice with
// tiermem.sim_host_addressable false), where only the Device's copy API may touch it:
//   publication   new working params of a device-homed shard are written by AdamW into a host
//                 staging sub-group and copied up (two alternate, so copy k overlaps AdamW k+1);
//   all-gather    several ranks: the shard goes down to a host staging buffer, is all-gathered
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

// --------------------------------------------------------------------------------- publication

ZeroEngine::Impl::WorkingShardOut::~WorkingShardOut() {
  try {
    wait_uploads();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("ZERO", "working-parameter upload failed while abandoning a step: {}", e.what());
  }
}

std::byte* ZeroEngine::Impl::WorkingShardOut::dest(const detail::Piece& p) {
  detail::ZeroModule& m = I_.mods[static_cast<std::size_t>(p.module)];
  upload_staged();  // the previous sub-group is complete now
  if (!m.stored) return m.mem_shard.b() + p.begin * I_.shape.wsize;
  if (module_ != p.module) {
    finish();
    pin_ = I_.store->acquire_for_overwrite(m.param,
                                           m.home == Tier::kDevice ? Tier::kDevice : I_.shape.publish_tier);
    module_ = p.module;
  }
  if (!I_.shape.opaque || pin_.tier() != Tier::kDevice) return pin_.as<std::byte>() + p.begin * I_.shape.wsize;
  // Opaque device memory: AdamW writes a host staging sub-group, copied up by the next call.
  const std::size_t bytes = p.size() * I_.shape.wsize;
  stage_ ^= 1;
  upload_[stage_].wait();  // its previous copy has left the buffer
  upload_[stage_] = DeviceEvent();
  std::byte* buf = I_.staging.publish_buffer(stage_, bytes, I_.plan.piece_elems * I_.shape.wsize);
  staged_offset_ = p.begin * I_.shape.wsize;
  staged_bytes_ = bytes;
  return buf;
}

std::byte* ZeroEngine::Impl::WorkingShardOut::device_dest(const detail::Piece& p) {
  detail::ZeroModule& m = I_.mods[static_cast<std::size_t>(p.module)];
  if (!m.stored) return nullptr;
  if (module_ != p.module) {
    finish();
    pin_ = I_.store->acquire_for_overwrite(m.param,
                                           m.home == Tier::kDevice ? Tier::kDevice : I_.shape.publish_tier);
    module_ = p.module;
  }
  if (pin_.tier() != Tier::kDevice) return nullptr;
  return pin_.as<std::byte>() + p.begin * I_.shape.wsize;
}

void ZeroEngine::Impl::WorkingShardOut::upload_staged() {
  if (staged_bytes_ == 0) return;
  upload_[stage_] = I_.staging.publish_async(pin_.as<std::byte>() + staged_offset_, stage_, staged_bytes_);
  staged_bytes_ = 0;
}

void ZeroEngine::Impl::WorkingShardOut::wait_uploads() {
  for (DeviceEvent& e : upload_) {
    DeviceEvent mine = e;
    e = DeviceEvent();
    mine.wait();
  }
}

void ZeroEngine::Impl::WorkingShardOut::finish() {
  upload_staged();
  wait_uploads();  // the pin is released only once every byte of the shard has arrived
  if (pin_.valid()) pin_.mark_dirty();
  pin_.release();
}

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
