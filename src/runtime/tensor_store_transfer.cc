// tensor_store_transfer.cc — TensorStore transfers between tiers: NVMe<->host I/O, the chunked
// NVMe<->device pipelines through pinned bounce buffers, and the worker pool.
// See tensor_store_impl.h.
#include "runtime/tensor_store_impl.h"
#include "core/thread_name.h"

namespace tiermem {

void TensorStore::Impl::transfer(const Entry& e, Tier from, void* from_ptr, Tier to, void* to_ptr) {
  const std::uint64_t bytes = e.info.bytes;
  if (bytes == 0) return;
  TraceSpan span(e.info.name, track(from, to));
  try {
    transfer_bytes(e, from, from_ptr, to, to_ptr);
  } catch (const IoError& err) {
    throw err.with_context(io_context(e, track(from, to)));
  }
}

void TensorStore::Impl::transfer_bytes(const Entry& e, Tier from, void* from_ptr, Tier to, void* to_ptr) {
  const std::uint64_t bytes = e.info.bytes;
  if (from == Tier::kHost && to == Tier::kDevice) {
    device->copy_h2d(to_ptr, from_ptr, bytes);
  } else if (from == Tier::kDevice && to == Tier::kHost) {
    device->copy_d2h(to_ptr, from_ptr, bytes);
  } else if (from == Tier::kNvme && to == Tier::kHost) {
    nvme_to_host(e, to_ptr);
  } else if (from == Tier::kHost && to == Tier::kNvme) {
    host_to_nvme(e, from_ptr);
  } else if (from == Tier::kNvme && to == Tier::kDevice) {
    // A device whose memory is the CPU's (Device::storage_direct): read straight into it, as into
    // the host tier, with no bounce buffer and no copy.
    if (device->storage_direct())
      nvme_to_host(e, to_ptr);
    else
      nvme_to_device(e, to_ptr);
  } else if (from == Tier::kDevice && to == Tier::kNvme) {
    if (device->storage_direct())
      host_to_nvme(e, from_ptr);
    else
      device_to_nvme(e, from_ptr);
  } else {
    throw Error("TensorStore: no transfer from " + std::string(tier_name(from)) + " to " +
                std::string(tier_name(to)));
  }
}

void TensorStore::Impl::nvme_to_host(const Entry& e, void* dst) {
  std::vector<IoRequest> reqs;
  for (std::size_t k = 0; k < e.extents.size(); ++k) {
    reqs.push_back(e.swap->read(e.extents[k], static_cast<char*>(dst) + k * opts.pipeline_chunk_bytes,
                              chunk_len(e, k)));
  }
  wait_all(reqs);
}

void TensorStore::Impl::host_to_nvme(const Entry& e, const void* src) {
  std::vector<IoRequest> reqs;
  for (std::size_t k = 0; k < e.extents.size(); ++k) {
    reqs.push_back(e.swap->write(e.extents[k],
                               static_cast<const char*>(src) + k * opts.pipeline_chunk_bytes,
                               chunk_len(e, k)));
  }
  wait_all(reqs);
}

template <class StartFirst, class StartSecond>
void TensorStore::Impl::bounce_pipeline(std::size_t n, StartFirst start_first, StartSecond start_second) {
  using First = decltype(start_first(std::size_t{}, static_cast<void*>(nullptr)));
  using Second = decltype(start_second(std::size_t{}, static_cast<void*>(nullptr)));
  struct Slot {
    std::size_t k;
    void* buf;
    First first;
    Second second;
  };
  const std::size_t window = std::min<std::size_t>(n, static_cast<std::size_t>(opts.pipeline_chunks));
  std::deque<Slot> in_first, in_second;
  std::size_t next = 0;
  // Waits for the oldest stage two, gives its buffer back, rethrows its error.
  auto retire = [&] {
    Slot s = std::move(in_second.front());
    in_second.pop_front();
    try {
      s.second.wait();
    } catch (...) {
      bounce->release(s.buf);
      throw;
    }
    bounce->release(s.buf);
  };
  try {
    while (next < n || !in_first.empty() || !in_second.empty()) {
      while (next < n && in_first.size() + in_second.size() < window) {
        void* buf = (in_first.empty() && in_second.empty()) ? bounce->acquire() : bounce->try_acquire();
        if (buf == nullptr) break;
        First h;
        try {
          h = start_first(next, buf);
        } catch (...) {  // refused at submission: nothing in flight on buf
          bounce->release(buf);
          throw;
        }
        in_first.push_back({next, buf, std::move(h), {}});
        ++next;
      }
      if (!in_first.empty()) {
        Slot s = std::move(in_first.front());
        in_first.pop_front();
        try {  // a failed stage one, or a stage two refused at submission: buf is idle
          s.first.wait();
          s.second = start_second(s.k, s.buf);
        } catch (...) {
          bounce->release(s.buf);
          throw;
        }
        in_second.push_back(std::move(s));
        while (!in_second.empty() && in_second.front().second.ready()) retire();
      } else if (!in_second.empty()) {
        retire();
      }
    }
  } catch (...) {
    for (Slot& s : in_first) {
      try {
        s.first.wait();
      } catch (...) {
      }
      bounce->release(s.buf);
    }
    for (Slot& s : in_second) {
      try {
        s.second.wait();
      } catch (...) {
      }
      bounce->release(s.buf);
    }
    throw;
  }
}

void TensorStore::Impl::nvme_to_device(const Entry& e, void* dst) {
  bounce_pipeline(
      e.extents.size(),
      [&](std::size_t k, void* buf) { return e.swap->read(e.extents[k], buf, chunk_len(e, k)); },
      [&](std::size_t k, void* buf) {
        return device->copy_h2d_async(static_cast<char*>(dst) + k * opts.pipeline_chunk_bytes, buf,
                                      chunk_len(e, k));
      });
}

void TensorStore::Impl::device_to_nvme(const Entry& e, const void* src) {
  bounce_pipeline(
      e.extents.size(),
      [&](std::size_t k, void* buf) {
        return device->copy_d2h_async(
            buf, static_cast<const char*>(src) + k * opts.pipeline_chunk_bytes, chunk_len(e, k));
      },
      [&](std::size_t k, void* buf) { return e.swap->write(e.extents[k], buf, chunk_len(e, k)); });
}

void TensorStore::Impl::submit(std::function<void()> fn) {
  {
    std::lock_guard lock(q_mu_);
    ++pending_;
  }
  boost::asio::post(*pool_, [this, fn = std::move(fn), phase = access_phase()] {
    detail::name_pool_thread("tm-store");
    {
      const AccessPhase access(phase);
      fn();  // never throws: tasks catch their own errors
    }
    {
      std::lock_guard lock(q_mu_);
      --pending_;
    }
    idle_cv_.notify_all();
  });
}

void TensorStore::Impl::prefetch_one(TensorId id, Tier t, std::uint64_t uses) {
  try {
    std::unique_lock lock(mu_);
    Entry& e = *entries_[id];
    e.prefetch_queued[idx(t)] = false;
    // Stale: discarded since the hint (its next access overwrites it: a read would move garbage),
    // or accessed since (the prefetch was for that access; loading it now, perhaps right after a
    // write-behind, would take room for a use the policy did not ask for).
    if (e.undefined || e.uses != uses) {
      ++stats_.prefetches_dropped;
      return;
    }
    bool hit = false;
    void* p = ensure(lock, id, t, Mode::kPrefetch, std::chrono::steady_clock::now(), &hit);
    if (p == nullptr) ++stats_.prefetches_dropped;
  } catch (const std::exception& ex) {
    std::lock_guard lock(mu_);
    ++stats_.prefetches_dropped;
    TM_LOG_DEBUG("RUNTIME", "prefetch of tensor {} to {} dropped: {}", id, tier_name(t), ex.what());
  }
}

void TensorStore::Impl::issue_hints(const std::vector<PrefetchHint>& hints) {
  for (const PrefetchHint& h : hints) {
    if (h.id >= entries_.size()) continue;
    if (idx(h.tier) > idx(entries_[h.id]->info.home)) continue;
    Entry& e = *entries_[h.id];
    if (e.undefined) continue;  // discarded: loading it would move garbage
    if (e.prefetch_queued[idx(h.tier)]) continue;  // one is on its way already
    e.prefetch_queued[idx(h.tier)] = true;
    ++stats_.prefetches_issued;
    submit([this, h, uses = e.uses] { prefetch_one(h.id, h.tier, uses); });  // the hinting access's phase
  }
}

}  // namespace tiermem
