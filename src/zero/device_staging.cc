// src/zero/device_staging.cc — see device_staging.h.
#include "zero/device_staging.h"

#include <algorithm>
#include <cstring>

namespace tiermem::detail {

Tier DeviceStaging::gather_tier(const ZeroModule& m) const {
  // A frozen module at rest in fewer bytes is read by the CPU where it is cached and dequantized
  // into its gather buffer (Gatherer::start): its smaller bytes never take device room.
  if (m.quantized() && m.home != Tier::kDevice) return Tier::kHost;
  // Frozen, homed in host memory the device addresses: read in place. Never written while
  // gathered (no update); a device copy would only hold the same bytes twice.
  if (m.frozen && m.home == Tier::kHost && !shape_.opaque) return Tier::kHost;
  if (shape_.opaque && shape_.world > 1 && !comm_.device_buffers() && m.home != Tier::kDevice) return Tier::kHost;
  return shape_.compute_tier;
}

void DeviceStaging::upload(const TensorStore::Pin& pin, std::size_t offset, const void* src, std::size_t bytes) {
  if (!shape_.opaque || pin.tier() != Tier::kDevice) {
    std::memcpy(pin.as<std::byte>() + offset, src, bytes);
    return;
  }
  device_->copy_h2d(pin.as<std::byte>() + offset, src, bytes);
  h2d_bytes_ += bytes;
}

void* DeviceStaging::all_gather_to_device(const ZeroModule& m, TensorStore::Pin& pin) {
  const std::size_t wsize = shape_.wsize;
  const std::size_t shard_bytes = m.shard.shard * wsize;
  const std::size_t bytes = m.shard.padded * wsize;
  const std::size_t mine_at = static_cast<std::size_t>(shape_.rank) * shard_bytes;
  Device& device = *device_;
  void* buf = device.allocate(bytes);  // OutOfMemoryError(kDevice) beyond the gather reserve
  try {
    if (comm_.device_buffers()) {  // NCCL: in place in device memory
      std::byte* mine = static_cast<std::byte*>(buf) + mine_at;
      if (pin.tier() == Tier::kDevice) {
        device.copy_d2d_async(mine, pin.data(), shard_bytes).wait();
      } else {
        device.copy_h2d(mine, pin.data(), shard_bytes);
        h2d_bytes_ += shard_bytes;
      }
      pin.release();
      comm_.all_gather(static_cast<std::byte*>(buf) + mine_at, buf, m.shard.shard, shape_.comm_dtype);
      return buf;
    }
    AlignedBuf host(bytes);
    gather_live_ = host.bytes;
    sample_host_peak_(0);
    if (pin.tier() == Tier::kDevice) {
      device.copy_d2h(host.b() + mine_at, pin.data(), shard_bytes);
      d2h_bytes_ += shard_bytes;
    } else {
      std::memcpy(host.b() + mine_at, pin.data(), shard_bytes);
    }
    pin.release();
    comm_.all_gather(host.b() + mine_at, host.p, m.shard.shard, shape_.comm_dtype);  // in place
    device.copy_h2d(buf, host.p, bytes);
    h2d_bytes_ += bytes;
    gather_live_ = 0;
    return buf;
  } catch (...) {
    gather_live_ = 0;
    try {
      device.synchronize();  // no copy still reads or writes buf
    } catch (...) {
    }
    device.free(buf);
    throw;
  }
}

const float* DeviceStaging::stage_gradient(const float* grad_device, std::size_t numel, std::size_t largest) {
  if (grad_.bytes < 4 * largest) {
    grad_ = AlignedBuf();
    grad_ = AlignedBuf(4 * largest);
    sample_host_peak_(0);
  }
  device_->copy_d2h(grad_.p, grad_device, 4 * numel);
  d2h_bytes_ += 4 * numel;
  return grad_.f();
}

std::byte* DeviceStaging::publish_buffer(int b, std::size_t bytes, std::size_t min_bytes) {
  AlignedBuf& buf = publish_[b];
  if (buf.bytes < bytes) {
    buf = AlignedBuf();  // free first: at most two staging sub-groups live
    buf = AlignedBuf(std::max(bytes, min_bytes));
    sample_host_peak_(0);
  }
  return buf.b();
}

DeviceEvent DeviceStaging::publish_async(void* dst, int b, std::size_t bytes) {
  DeviceEvent e = device_->copy_h2d_async(dst, publish_[b].b(), bytes);
  h2d_bytes_ += bytes;
  return e;
}

float* DeviceStaging::state_buffer(AlignedBuf& buf, std::size_t bytes) {
  if (buf.p == nullptr) {
    buf = AlignedBuf(bytes);
    state_live_ = buf.bytes;
    sample_host_peak_(0);
  }
  return buf.f();
}

const float* DeviceStaging::gradient_to_scratch(const float* g, std::size_t n, std::size_t cap) {
  grad_scratch_.reserve(device_, 4ull * cap);
  device_->copy_h2d(grad_scratch_.p, g, 4ull * n);
  h2d_bytes_ += 4ull * n;
  return grad_scratch_.f();
}

void* DeviceStaging::out_scratch(std::size_t bytes) {
  out_scratch_.reserve(device_, bytes);
  return out_scratch_.p;
}

void DeviceStaging::copy_down(void* dst, const void* src, std::size_t bytes) {
  device_->copy_d2h(dst, src, bytes);
  d2h_bytes_ += bytes;
}

std::uint64_t DeviceStaging::host_bytes() const {
  return publish_[0].bytes + publish_[1].bytes + grad_.bytes + gather_live_ + state_live_;
}

std::uint64_t DeviceStaging::device_scratch_bytes() const {
  return (grad_scratch_.p ? device_->allocation_size(grad_scratch_.bytes) : 0) +
         (out_scratch_.p ? device_->allocation_size(out_scratch_.bytes) : 0);
}

void DeviceStaging::add_stats(ZeroStats& s) const {
  s.host_to_device_bytes += h2d_bytes_;
  s.device_to_host_bytes += d2h_bytes_;
}

}  // namespace tiermem::detail
