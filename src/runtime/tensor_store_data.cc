// tensor_store_data.cc — TensorStore caller data in and out: read (a consistent copy of the
// newest bytes), write (replace the contents; NVMe homes write new extents first), flush.
// See tensor_store_impl.h.
#include "runtime/tensor_store_impl.h"

namespace tiermem {

std::uint64_t TensorStore::offload() {
  drain();
  flush();
  Impl& m = *impl_;
  std::uint64_t dropped = 0;
  for (TensorId id = 0; id < size(); ++id) {
    Tier home;
    std::uint64_t bytes;
    {
      std::lock_guard lock(m.mu_);
      home = m.entries_[id]->info.home;
      bytes = m.entries_[id]->info.bytes;
    }
    for (Tier t : {Tier::kDevice, Tier::kHost}) {
      if (idx(t) >= idx(home)) continue;
      bool resident;
      {
        std::lock_guard lock(m.mu_);
        resident = m.entries_[id]->copy[idx(t)].state != State::kAbsent;
      }
      if (resident && evict(id, t)) dropped += bytes;
    }
  }
  if (m.host_pool) m.host_pool->release_free();
  if (m.device) m.device->empty_cache();
  return dropped;
}

void TensorStore::flush() {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu_);
  for (TensorId id = 0; id < m.entries_.size(); ++id) {
    Entry& e = *m.entries_[id];
    const Tier home = e.info.home;
    while (e.copy[idx(home)].version != e.latest) {
      int src = -1;
      for (int t = 0; t < idx(home); ++t) {
        const Copy& c = e.copy[t];
        if (c.state == State::kResident && c.version == e.latest && !c.writing) src = t;
      }
      Copy& h = e.copy[idx(home)];
      if (src < 0 || h.writing || h.readers > 0) {
        m.cv_.wait(lock);  // the newest copy is in transfer; it lands somewhere shortly
        continue;
      }
      Copy& s = e.copy[src];
      ++s.readers;
      h.writing = true;
      const std::uint64_t version = s.version;
      const bool nvme = home == Tier::kNvme;
      const Phase ph = m.io_begin(nvme);
      lock.unlock();
      std::exception_ptr err;
      try {
        m.transfer(e, tier_at(src), s.ptr, home, h.ptr);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      m.io_end(nvme, ph);
      --s.readers;
      h.writing = false;
      m.cv_.notify_all();
      if (err) std::rethrow_exception(err);
      h.version = std::max(h.version, version);
      m.count_move(e, src, idx(home), ph);
      ++m.stats_.writebacks[src];
    }
  }
}

void TensorStore::read(TensorId id, std::span<std::byte> out) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu_);
  Entry& e = m.entry(id);
  if (out.size() != e.info.bytes) {
    throw Error(fmt::format("TensorStore::read: tensor '{}' has {} bytes, buffer {}", e.info.name,
                            e.info.bytes, out.size()));
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(m.opts.acquire_timeout);
  int src = -1;
  while ((src = m.find_source(e, Tier::kNvme)) < 0 &&
         !(e.copy[idx(Tier::kNvme)].state == State::kResident &&
           e.copy[idx(Tier::kNvme)].version == e.latest && !e.copy[idx(Tier::kNvme)].writing)) {
    if (!m.wait(lock, deadline)) throw Error("TensorStore::read: timed out waiting for '" + e.info.name + "'");
  }
  if (src < 0) src = idx(Tier::kNvme);
  Copy& s = e.copy[src];
  ++s.readers;
  lock.unlock();
  std::exception_ptr err;
  try {
    TraceSpan span(e.info.name, std::string(tier_name(tier_at(src))) + "->caller");
    if (src == idx(Tier::kDevice)) {
      m.device->copy_d2h(out.data(), s.ptr, e.info.bytes);
    } else if (src == idx(Tier::kHost)) {
      std::memcpy(out.data(), s.ptr, e.info.bytes);
    } else {
      m.nvme_to_host(e, out.data());
    }
  } catch (const IoError& io) {
    err = std::make_exception_ptr(io.with_context(Impl::io_context(e, "nvme->caller")));
  } catch (...) {
    err = std::current_exception();
  }
  lock.lock();
  --s.readers;
  m.cv_.notify_all();
  if (err) std::rethrow_exception(err);
}

void TensorStore::write(TensorId id, std::span<const std::byte> in) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu_);
  Entry& e = m.entry(id);
  if (in.size() != e.info.bytes) {
    throw Error(fmt::format("TensorStore::write: tensor '{}' has {} bytes, buffer {}", e.info.name,
                            e.info.bytes, in.size()));
  }
  const Tier home = e.info.home;
  while (true) {
    bool busy = false;
    for (int t = 0; t < kNumTiers; ++t) {
      const Copy& c = e.copy[t];
      if (tier_at(t) != home && c.pins > 0) {
        throw Error(fmt::format("TensorStore::write: tensor '{}' is pinned on {}", e.info.name,
                                tier_name(tier_at(t))));
      }
      if (c.readers > 0 || c.writing || c.state == State::kLoading || c.state == State::kEvicting) busy = true;
    }
    if (!busy) break;
    m.cv_.wait(lock);
  }
  // Every resident copy is marked `writing` for the duration: nobody loads from, pins or evicts
  // this tensor meanwhile. Cached copies are dropped only once the new bytes are safely at home,
  // so a failed write leaves the tensor exactly as it was (nothing lost).
  for (int t = 0; t < kNumTiers; ++t) {
    if (e.copy[t].state == State::kResident) e.copy[t].writing = true;
  }
  lock.unlock();
  std::exception_ptr err;
  std::vector<SwapExtent> fresh;  // home kNvme: the new bytes go to new extents, swapped in at the end
  try {
    TraceSpan span(e.info.name, "caller->" + std::string(tier_name(home)));
    Copy& h = e.copy[idx(home)];
    if (home == Tier::kDevice) {
      m.device->copy_h2d(h.ptr, in.data(), e.info.bytes);
    } else if (home == Tier::kHost) {
      std::memcpy(h.ptr, in.data(), e.info.bytes);
    } else {
      // Not in place: a failure halfway must not leave the home copy half old, half new.
      for (const SwapExtent& x : e.extents) fresh.push_back(e.swap->allocate(x.bytes));
      std::vector<IoRequest> reqs;
      for (std::size_t k = 0; k < fresh.size() && e.info.bytes > 0; ++k) {
        reqs.push_back(e.swap->write(fresh[k], in.data() + k * m.opts.pipeline_chunk_bytes,
                                     m.chunk_len(e, k)));
      }
      wait_all(reqs);
    }
  } catch (const IoError& io) {
    err = std::make_exception_ptr(io.with_context(Impl::io_context(e, "caller->nvme")));
  } catch (...) {
    err = std::current_exception();
  }
  if (err) {
    for (const SwapExtent& x : fresh) e.swap->free(x);
    fresh.clear();
  }
  lock.lock();
  for (int t = 0; t < kNumTiers; ++t) e.copy[t].writing = false;
  if (!err) {
    if (home == Tier::kNvme) std::swap(fresh, e.extents);  // `fresh` now holds the old extents
    for (int t = 0; t < idx(home); ++t) {
      Copy& c = e.copy[t];
      if (c.state == State::kResident) {
        m.tier_free(tier_at(t), c.ptr);
        m.account(tier_at(t), -static_cast<std::int64_t>(c.alloc_bytes));
        c = Copy{};
        m.policy_->on_evicted(id, tier_at(t));
      }
    }
    ++e.latest;
    e.undefined = false;
    e.copy[idx(home)].version = e.latest;
  }
  m.cv_.notify_all();
  lock.unlock();
  for (const SwapExtent& x : fresh) e.swap->free(x);  // old extents; no I/O on them remains
  if (err) std::rethrow_exception(err);
}
}  // namespace tiermem
