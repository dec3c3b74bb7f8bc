// src/zero/gatherer.cc — see gatherer.h.
#include "zero/gatherer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem::detail {

Gatherer::~Gatherer() {
  try {
    drop_pending();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("ZERO", "an all-gather pending at destruction failed: {}", e.what());
  }
}

std::uint64_t Gatherer::buffer_bytes(int module) const {
  return mods_[static_cast<std::size_t>(module)].shard.padded * shape_.wsize;
}

void Gatherer::count(int module) {
  live_bytes_ += buffer_bytes(module);
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
}

Gatherer::Buffer Gatherer::alloc(int module) {
  const std::size_t bytes = buffer_bytes(module);
  Buffer b;
  b.on_device = shape_.compute_tier == Tier::kDevice;
  if (b.on_device) {
    b.data = device_->allocate(bytes);  // OutOfMemoryError(kDevice) beyond the gather reserve
  } else {
    b.data = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!b.data) throw OutOfMemoryError(Tier::kHost, bytes, 0, "ZeroEngine all-gather buffer");
  }
  count(module);
  return b;
}

void Gatherer::free(int module, const Buffer& buf) noexcept {
  if (buf.on_device) {
    device_->free(buf.data);
  } else {
    std::free(buf.data);
  }
  live_bytes_ -= buffer_bytes(module);
}

Gatherer::Pending Gatherer::start(int module, TensorStore::Pin pin) {
  const ZeroModule& m = mods_[static_cast<std::size_t>(module)];
  Pending pg;
  pg.module = module;
  pg.buf = alloc(module);
  std::byte* mine =
      static_cast<std::byte*>(pg.buf.data) + static_cast<std::size_t>(shape_.rank) * m.shard.shard * shape_.wsize;
  if (m.quantized()) {  // stored in fewer bytes (tiermem.frozen_dtype): dequantized into its place
    read_at_rest(m.at_rest, static_cast<const std::byte*>(pin.data()), m.shard.shard, shape_.wdtype, mine);
  } else {
    std::memcpy(mine, pin.data(), m.shard.shard * shape_.wsize);
  }
  pin.release();
  try {
    pg.handle = comm_.all_gather_async(mine, pg.buf.data, m.shard.shard, shape_.comm_dtype);  // in place
  } catch (...) {
    free(module, pg.buf);
    throw;
  }
  ++calls_;
  return pg;
}

void* Gatherer::finish(Pending&& pg) {
  try {
    pg.handle.wait();
  } catch (...) {
    free(pg.module, pg.buf);
    throw;
  }
  return pg.buf.data;
}

Gatherer::Buffer Gatherer::gather(int module, TensorStore::Pin pin) {
  Pending pg = start(module, std::move(pin));
  const Buffer b = pg.buf;
  finish(std::move(pg));
  return b;
}

void Gatherer::prefetch(int module, TensorStore::Pin pin) {
  pending_.push_back(start(module, std::move(pin)));
  ++prefetched_;
}

bool Gatherer::pending(int module) const {
  return std::any_of(pending_.begin(), pending_.end(), [&](const Pending& pg) { return pg.module == module; });
}

std::optional<Gatherer::Buffer> Gatherer::take(int module) {
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->module != module) continue;
    Pending pg = std::move(*it);
    pending_.erase(it);
    const Buffer b = pg.buf;
    finish(std::move(pg));
    return b;
  }
  return std::nullopt;
}

void Gatherer::trim(std::size_t max) {
  while (!pending_.empty() && pending_.size() >= max) {
    Pending old = std::move(pending_.front());
    pending_.pop_front();
    const int module = old.module;
    const Buffer b = old.buf;
    finish(std::move(old));
    free(module, b);
  }
}

void Gatherer::drop_pending() {
  std::exception_ptr first;
  while (!pending_.empty()) {
    Pending pg = std::move(pending_.front());
    pending_.pop_front();
    const int module = pg.module;
    const Buffer b = pg.buf;
    try {
      finish(std::move(pg));
      free(module, b);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void Gatherer::adopt(int module) {
  ++calls_;
  count(module);
}

void Gatherer::publish_whole_modules(int module) {
  for (std::size_t i = 0; i < mods_.size(); ++i) {
    const ZeroModule& m = mods_[i];
    if (module >= 0 && static_cast<int>(i) != module) continue;
    if (module < 0 && m.frozen) continue;  // a step or an import does not change it
    if (m.full.p != nullptr && (shape_.stage == 1 || shape_.stage == 2 || m.persistent)) {
      comm_.all_gather(m.mem_shard.p, m.full.p, m.shard.shard, shape_.comm_dtype);
      ++calls_;
    }
  }
}

void Gatherer::add_stats(ZeroStats& s) const {
  s.gathered_bytes_peak = std::max(s.gathered_bytes_peak, peak_bytes_);
  s.all_gather_calls += calls_;
  s.all_gathers_prefetched += prefetched_;
}

}  // namespace tiermem::detail
