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
  if (!m.stored) return m.mem_shard.b() + p.begin * I_.wsize;
  if (module_ != p.module) {
    finish();
    pin_ = I_.store->acquire_for_overwrite(m.param,
                                           m.home == Tier::kDevice ? Tier::kDevice : I_.publish_tier);
    module_ = p.module;
  }
  if (!I_.opaque || pin_.tier() != Tier::kDevice) return pin_.as<std::byte>() + p.begin * I_.wsize;
  // Opaque device memory: AdamW writes a host staging sub-group, copied up by the next call.
  const std::size_t bytes = p.size() * I_.wsize;
  stage_ ^= 1;
  detail::AlignedBuf& buf = I_.publish_stage[stage_];
  upload_[stage_].wait();  // its previous copy has left the buffer
  upload_[stage_] = DeviceEvent();
  if (buf.bytes < bytes) {
    buf = detail::AlignedBuf();  // free first: at most two staging sub-groups live
    buf = detail::AlignedBuf(std::max<std::size_t>(bytes, I_.plan.piece_elems * I_.wsize));
    I_.st.host_engine_peak_bytes = std::max(I_.st.host_engine_peak_bytes, I_.engine_host_bytes());
  }
  staged_offset_ = p.begin * I_.wsize;
  staged_bytes_ = bytes;
  return buf.b();
}

std::byte* ZeroEngine::Impl::WorkingShardOut::device_dest(const detail::Piece& p) {
  detail::ZeroModule& m = I_.mods[static_cast<std::size_t>(p.module)];
  if (!m.stored) return nullptr;
  if (module_ != p.module) {
    finish();
    pin_ = I_.store->acquire_for_overwrite(m.param,
                                           m.home == Tier::kDevice ? Tier::kDevice : I_.publish_tier);
    module_ = p.module;
  }
  if (pin_.tier() != Tier::kDevice) return nullptr;
  return pin_.as<std::byte>() + p.begin * I_.wsize;
}

void ZeroEngine::Impl::WorkingShardOut::upload_staged() {
  if (staged_bytes_ == 0) return;
  upload_[stage_] = I_.device->copy_h2d_async(pin_.as<std::byte>() + staged_offset_,
                                              I_.publish_stage[stage_].b(), staged_bytes_);
  I_.engine_h2d_bytes += staged_bytes_;
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

// --------------------------------------------------------------------------------- helpers

void ZeroEngine::Impl::upload(const TensorStore::Pin& pin, std::size_t offset, const void* src,
                              std::size_t bytes) {
  if (!opaque || pin.tier() != Tier::kDevice) {
    std::memcpy(pin.as<std::byte>() + offset, src, bytes);
    return;
  }
  device->copy_h2d(pin.as<std::byte>() + offset, src, bytes);
  engine_h2d_bytes += bytes;
}

void* ZeroEngine::Impl::all_gather_to_device(const detail::ZeroModule& m, TensorStore::Pin& pin) {
  const std::size_t shard_bytes = m.shard.shard * wsize;
  const std::size_t bytes = m.shard.padded * wsize;
  const std::size_t mine_at = static_cast<std::size_t>(rank) * shard_bytes;
  void* buf = device->allocate(bytes);  // OutOfMemoryError(kDevice) beyond the gather reserve
  try {
    if (comm.device_buffers()) {  // NCCL: in place in device memory
      std::byte* mine = static_cast<std::byte*>(buf) + mine_at;
      if (pin.tier() == Tier::kDevice) {
        device->copy_d2d_async(mine, pin.data(), shard_bytes).wait();
      } else {
        device->copy_h2d(mine, pin.data(), shard_bytes);
        engine_h2d_bytes += shard_bytes;
      }
      pin.release();
      comm.all_gather(static_cast<std::byte*>(buf) + mine_at, buf, m.shard.shard, comm_dtype);
      return buf;
    }
    detail::AlignedBuf host(bytes);
    gather_stage_live = host.bytes;
    st.host_engine_peak_bytes = std::max(st.host_engine_peak_bytes, engine_host_bytes());
    if (pin.tier() == Tier::kDevice) {
      device->copy_d2h(host.b() + mine_at, pin.data(), shard_bytes);
      engine_d2h_bytes += shard_bytes;
    } else {
      std::memcpy(host.b() + mine_at, pin.data(), shard_bytes);
    }
    pin.release();
    comm.all_gather(host.b() + mine_at, host.p, m.shard.shard, comm_dtype);  // in place
    device->copy_h2d(buf, host.p, bytes);
    engine_h2d_bytes += bytes;
    gather_stage_live = 0;
    return buf;
  } catch (...) {
    gather_stage_live = 0;
    try {
      device->synchronize();  // no copy still reads or writes buf
    } catch (...) {
    }
    device->free(buf);
    throw;
  }
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
        module, m.name, I.stage, I.stage == 3 ? ", every module persistent" : ""));
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
  if (!I.opaque) {  // host-addressable device memory: reduced in place
    reduce_gradients(module, std::span<const float>(grad_device, numel));
    return;
  }
  // One host buffer of the largest module, made at the first call and kept.
  std::size_t largest = 0;
  for (const auto& x : I.mods) largest = std::max(largest, x.numel);
  if (I.grad_stage.bytes < 4 * largest) {
    I.grad_stage = detail::AlignedBuf();
    I.grad_stage = detail::AlignedBuf(4 * largest);
    I.st.host_engine_peak_bytes = std::max(I.st.host_engine_peak_bytes, I.engine_host_bytes());
  }
  I.device->copy_d2h(I.grad_stage.p, grad_device, 4 * numel);
  I.engine_d2h_bytes += 4 * numel;
  reduce_gradients(module, std::span<const float>(I.grad_stage.f(), numel));
}

Device* ZeroEngine::device() const noexcept { return impl_->device.get(); }

}  // namespace tiermem
