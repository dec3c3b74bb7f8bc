// tensor_store_residency.cc — TensorStore residency state: which copy is current, budgets and
// policy-driven eviction, and ensure() (make a tensor resident at a tier). See tensor_store_impl.h.
#include "runtime/tensor_store_impl.h"

namespace tiermem {

std::uint64_t TensorStore::Impl::pinned_bytes(Tier t, int* count) const {
  std::uint64_t b = 0;
  int n = 0;
  for (const auto& e : entries_) {
    const Copy& c = e->copy[idx(t)];
    if (c.state != State::kAbsent && (c.pins > 0 || e->info.home == t)) {
      b += c.alloc_bytes;
      ++n;
    }
  }
  if (count) *count = n;
  return b;
}

std::string TensorStore::Impl::holders(Tier t, std::uint64_t pinned, int count) const {
  std::vector<std::pair<std::uint64_t, const Entry*>> held;
  for (const auto& e : entries_) {
    const Copy& c = e->copy[idx(t)];
    if (c.state != State::kAbsent && (c.pins > 0 || e->info.home == t)) held.push_back({c.alloc_bytes, e.get()});
  }
  std::sort(held.begin(), held.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string out = fmt::format("{} pinned or homed tensors, {}", count, format_bytes(pinned));
  const std::size_t shown = std::min<std::size_t>(held.size(), 8);
  for (std::size_t i = 0; i < shown; ++i) {
    const Copy& c = held[i].second->copy[idx(t)];
    out += fmt::format("{}'{}' {} ({})", i == 0 ? ": " : ", ", held[i].second->info.name, format_bytes(held[i].first),
                       c.pins > 0 ? fmt::format("{} pins", c.pins) : std::string("home"));
  }
  if (held.size() > shown) out += fmt::format(", and {} more", held.size() - shown);
  return out;
}

std::string TensorStore::Impl::in_flight(Tier t) const {
  int n = 0;
  std::uint64_t bytes = 0;
  std::string names;
  for (const auto& e : entries_) {
    const Copy& c = e->copy[idx(t)];
    if (c.state == State::kLoading || c.state == State::kEvicting || c.writing || c.readers > 0) {
      if (n < 4) names += fmt::format("{}'{}'", n == 0 ? ": " : ", ", e->info.name);
      ++n;
      bytes += c.alloc_bytes;
    }
  }
  return n == 0 ? std::string("no transfers in flight")
                : fmt::format("{} transfers in flight ({}){}", n, format_bytes(bytes), names);
}

bool TensorStore::Impl::needs_writeback(const Entry& e, Tier t) const {
  const Copy& c = e.copy[idx(t)];
  if (c.version != e.latest || t == e.info.home) return false;
  for (int l = idx(t) + 1; l <= idx(e.info.home); ++l) {
    const Copy& lc = e.copy[l];
    if (lc.version == e.latest && (lc.state == State::kResident || lc.state == State::kEvicting)) {
      return false;
    }
  }
  return true;
}

void TensorStore::Impl::make_newest(Entry& e, TensorId id, Tier tier) {
  ++e.latest;
  e.undefined = false;
  e.copy[idx(tier)].version = e.latest;
  for (int t = 0; t < 2; ++t) {
    Copy& o = e.copy[t];
    if (t != idx(tier) && tier_at(t) != e.info.home && o.state == State::kResident && o.pins == 0 &&
        o.readers == 0 && !o.writing) {
      tier_free(tier_at(t), o.ptr);
      account(tier_at(t), -static_cast<std::int64_t>(o.alloc_bytes));
      o = Copy{};
      policy_->on_evicted(id, tier_at(t));
    }
  }
  cv_.notify_all();
}

bool TensorStore::Impl::readable(const Entry& e, int s) {
  const Copy& c = e.copy[s];
  return c.state == State::kResident && c.version == e.latest && !c.writing && !c.user_writing;
}

int TensorStore::Impl::find_source(const Entry& e, Tier t) const {
  auto ok = [&](int s) { return s != idx(t) && readable(e, s); };
  for (int s = idx(t) + 1; s < kNumTiers && s <= idx(e.info.home); ++s) {
    if (ok(s)) return s;
  }
  for (int s = idx(t) - 1; s >= 0; --s) {
    if (ok(s)) return s;
  }
  return -1;
}

void TensorStore::Impl::evict_locked(std::unique_lock<std::mutex>& lock, TensorId id, Tier t, bool to_make_room) {
  Entry& e = *entries_[id];
  Copy& c = e.copy[idx(t)];
  c.state = State::kEvicting;
  if (needs_writeback(e, t)) {
    // Target: the next tier down when its copy is resident and free to write, else home.
    Tier target = e.info.home;
    if (t == Tier::kDevice && e.info.home == Tier::kNvme) {
      Copy& h = e.copy[idx(Tier::kHost)];
      if (h.state == State::kResident && !h.writing && h.readers == 0 && h.pins == 0) target = Tier::kHost;
    }
    Copy& dst = e.copy[idx(target)];
    while (dst.writing) cv_.wait(lock);  // another write to the same target finishes first
    dst.writing = true;
    const std::uint64_t version = c.version;
    const bool nvme = target == Tier::kNvme;
    const Phase ph = io_begin(nvme);
    lock.unlock();
    std::exception_ptr err;
    try {
      transfer(e, t, c.ptr, target, dst.ptr);
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    io_end(nvme, ph);
    dst.writing = false;
    if (err) {
      c.state = State::kResident;
      cv_.notify_all();
      std::rethrow_exception(err);
    }
    dst.version = std::max(dst.version, version);
    count_move(e, idx(t), idx(target), ph);
    ++stats_.writebacks[idx(t)];
  } else if (t == Tier::kDevice && to_make_room) {
    demote_locked(lock, id);
  } else if (t == Tier::kHost && to_make_room) {
    promote_locked(lock, id);
  }
  tier_free(t, c.ptr);
  account(t, -static_cast<std::int64_t>(c.alloc_bytes));
  c = Copy{};
  ++stats_.evictions[idx(t)];
  policy_->on_evicted(id, t);
  cv_.notify_all();
}

void TensorStore::Impl::demote_locked(std::unique_lock<std::mutex>& lock, TensorId id) {
  Entry& e = *entries_[id];
  Copy& d = e.copy[idx(Tier::kDevice)];
  Copy& h = e.copy[idx(Tier::kHost)];
  if (!opts.demote_to_host || e.info.home != Tier::kNvme || e.undefined || d.version != e.latest ||
      h.state != State::kAbsent || h.writing) {
    return;
  }
  const std::uint64_t size = alloc_size(Tier::kHost, e.info.bytes);
  if (size > budget_[idx(Tier::kHost)]) return;
  void* p = nullptr;
  try {
    p = make_room(lock, Tier::kHost, size, Mode::kPrefetch, std::chrono::steady_clock::now(), id);
  } catch (const std::exception& ex) {
    // A host victim's write-back failed (it stays resident and dirty: nothing lost). The device
    // copy is dropped as without demotion; letting the error out would leave it kEvicting forever.
    TM_LOG_WARN("RUNTIME", "keeping tensor '{}' in host memory on its eviction from the device: making room "
                "failed ({}); it is dropped and read from NVMe at its next use", e.info.name, ex.what());
    return;
  }
  if (p == nullptr) return;
  if (h.state != State::kAbsent || d.version != e.latest) {  // changed while mu_ was released
    tier_free(Tier::kHost, p);
    return;
  }
  if (copy_evicted_locked(lock, id, Tier::kDevice, Tier::kHost, p, size)) ++stats_.demotions;
}

void TensorStore::Impl::promote_locked(std::unique_lock<std::mutex>& lock, TensorId id) {
  Entry& e = *entries_[id];
  Copy& h = e.copy[idx(Tier::kHost)];
  Copy& d = e.copy[idx(Tier::kDevice)];
  if (!e.read_in_place || !device || e.info.home != Tier::kNvme || e.undefined || h.version != e.latest ||
      d.state != State::kAbsent || d.writing) {
    return;
  }
  const std::uint64_t size = alloc_size(Tier::kDevice, e.info.bytes);
  if (device_room_wanted_ > 0 || used_[idx(Tier::kDevice)] + size > budget_[idx(Tier::kDevice)]) return;
  void* p = tier_alloc(Tier::kDevice, size);
  if (p == nullptr) return;
  if (copy_evicted_locked(lock, id, Tier::kHost, Tier::kDevice, p, size)) ++stats_.promotions;
}

bool TensorStore::Impl::copy_evicted_locked(std::unique_lock<std::mutex>& lock, TensorId id, Tier from, Tier to,
                                            void* p, std::uint64_t size) {
  Entry& e = *entries_[id];
  Copy& src = e.copy[idx(from)];
  Copy& dst = e.copy[idx(to)];
  dst.ptr = p;
  dst.alloc_bytes = size;
  dst.state = State::kLoading;
  account(to, static_cast<std::int64_t>(size));
  ++src.readers;
  const std::uint64_t version = src.version;
  const Phase ph = access_phase();
  lock.unlock();
  std::exception_ptr err;
  try {
    transfer(e, from, src.ptr, to, p);
  } catch (...) {
    err = std::current_exception();
  }
  lock.lock();
  --src.readers;
  if (err) {
    tier_free(to, p);
    account(to, -static_cast<std::int64_t>(size));
    dst = Copy{};
    cv_.notify_all();
    try {
      std::rethrow_exception(err);
    } catch (const std::exception& ex) {
      TM_LOG_WARN("RUNTIME", "keeping tensor '{}' in {} on its eviction from {} failed ({}); it is dropped and "
                  "read from NVMe at its next use", e.info.name, tier_name(to), tier_name(from), ex.what());
    }
    return false;
  }
  dst.state = State::kResident;
  dst.version = version;
  count_move(e, idx(from), idx(to), ph);
  cv_.notify_all();
  return true;
}

void* TensorStore::Impl::make_room(std::unique_lock<std::mutex>& lock, Tier t, std::uint64_t size, Mode mode,
                std::chrono::steady_clock::time_point deadline,
                TensorId incoming, bool home) {
  if (size > budget_[idx(t)]) {
    throw OutOfMemoryError(t, size, budget_[idx(t)],
                           fmt::format("larger than the whole {} budget", tier_name(t)));
  }
  const CountScope wanted(t == Tier::kDevice ? &device_room_wanted_ : nullptr);  // promote_locked stays out
  std::vector<TensorId> candidates;
  while (true) {
    // Room for `incoming` is not needed once another call (a prefetch, a fetch) started its copy
    // here meanwhile: nullptr, the caller looks again. Waiting on could last forever where that
    // copy fills the tier: an acquire's own tensor is nobody's victim (Entry::acquiring).
    if (incoming != kInvalidTensor && entries_[incoming]->copy[idx(t)].state != State::kAbsent) return nullptr;
    if (used_[idx(t)] + size <= budget_[idx(t)]) {
      if (void* p = tier_alloc(t, size, home)) return p;
    }
    candidates.clear();
    for (TensorId i = 0; i < entries_.size(); ++i) {
      const Entry& e = *entries_[i];
      const Copy& c = e.copy[idx(t)];
      if (c.state == State::kResident && c.pins == 0 && c.readers == 0 && !c.writing && e.info.home != t &&
          e.acquiring == 0) {
        candidates.push_back(i);
      }
    }
    if (t == Tier::kHost && opts.demote_to_host) {
      // A host copy whose device copy is resident and current is a duplicate: dropping it loses
      // nothing (the device keeps the bytes, and goes down here again when evicted), so such
      // copies go first, the furthest-used of them, before anything only the host holds.
      std::vector<TensorId> dups;
      for (TensorId i : candidates) {
        const Entry& e = *entries_[i];
        const Copy& d = e.copy[idx(Tier::kDevice)];
        if (d.state == State::kResident && d.version == e.latest && !d.writing && !d.user_writing &&
            !needs_writeback(e, t)) {
          dups.push_back(i);
        }
      }
      if (!dups.empty()) {
        TensorId victim = policy_->choose_victim(t, dups);
        if (std::find(dups.begin(), dups.end(), victim) == dups.end()) victim = dups.front();
        evict_locked(lock, victim, t, true);
        continue;
      }
    }
    if (!candidates.empty() && mode == Mode::kPrefetch) {
      if (!plan_prefetch_evictions(lock, t, size, incoming, candidates)) return nullptr;
      continue;
    }
    if (!candidates.empty()) {
      TensorId victim = policy_->choose_victim(t, candidates);
      if (std::find(candidates.begin(), candidates.end(), victim) == candidates.end()) {
        victim = candidates.front();  // a policy bug must not corrupt the store
      }
      evict_locked(lock, victim, t, true);
      continue;
    }
    if (mode == Mode::kPrefetch) return nullptr;
    if (!wait(lock, deadline)) {
      if (used_[idx(t)] + size <= budget_[idx(t)]) {
        if (void* p = tier_alloc(t, size, home)) return p;
      }
      int n = 0;
      std::uint64_t pinned = pinned_bytes(t, &n);
      ++stats_.oom_errors;
      // Any block fits while the budget holds its bytes (the pools cannot fragment), so this is
      // memory really held past the timeout: a budget below what the work needs, or a bug.
      const char* key = t == Tier::kHost ? "tiermem.host_budget_bytes (--host-budget)"
                                         : "tiermem.device_budget_bytes (--device-budget)";
      throw OutOfMemoryError(
          t, size, budget_[idx(t)] - used_[idx(t)],
          fmt::format("{} tier full after waiting {:.1f} s for a release: the {} budget {} ({} bytes, {}) "
                      "holds {} resident; held by {} (pins and home copies cannot be evicted); {}. "
                      "The start check accepted this budget, so the engine needs more than its minimum "
                      "says (a bug: please report this message) or something holds pins too long; "
                      "raise {} to work around it",
                      tier_name(t), opts.acquire_timeout.count(), tier_name(t), format_bytes(budget_[idx(t)]),
                      budget_[idx(t)], key, format_bytes(used_[idx(t)]), holders(t, pinned, n), in_flight(t), key));
    }
  }
}

bool TensorStore::Impl::plan_prefetch_evictions(std::unique_lock<std::mutex>& lock, Tier t, std::uint64_t size,
                             TensorId incoming, std::vector<TensorId>& candidates) {
  std::vector<TensorId> plan;
  std::uint64_t freed = 0;
  while (used_[idx(t)] - freed + size > budget_[idx(t)] || plan.empty()) {
    if (candidates.empty()) return false;
    TensorId victim = policy_->choose_victim(t, candidates);
    auto it = std::find(candidates.begin(), candidates.end(), victim);
    if (it == candidates.end()) {
      it = candidates.begin();  // a policy bug must not corrupt the store
      victim = *it;
    }
    if (!policy_->evict_for_prefetch(t, incoming, victim)) return false;
    plan.push_back(victim);
    freed += entries_[victim]->copy[idx(t)].alloc_bytes;
    candidates.erase(it);
  }
  for (TensorId v : plan) {
    // evict_locked releases mu_ during a write-back: re-check each victim is still evictable.
    const Copy& c = entries_[v]->copy[idx(t)];
    if (c.state == State::kResident && c.pins == 0 && c.readers == 0 && !c.writing) {
      evict_locked(lock, v, t, true);
    }
  }
  return true;
}

void* TensorStore::Impl::ensure(std::unique_lock<std::mutex>& lock, TensorId id, Tier t, Mode mode,
             std::chrono::steady_clock::time_point deadline, bool* hit) {
  Entry& e = entry(id);
  if (t == Tier::kNvme && mode == Mode::kAcquire) {
    throw Error("TensorStore: tensor '" + e.info.name + "' cannot be pinned on the nvme tier");
  }
  if (idx(t) > idx(e.info.home)) {
    throw Error(fmt::format("TensorStore: tensor '{}' has home {}; it cannot be brought to the "
                            "slower tier {}",
                            e.info.name, tier_name(e.info.home), tier_name(t)));
  }
  if (t == Tier::kDevice && !device) {
    throw NotSupportedError("TensorStore: no device was given, tensor '" + e.info.name +
                            "' cannot go to the device tier");
  }
  *hit = true;
  // An acquire's tensor is nobody's victim until it returns (Entry::acquiring): while it waits
  // (for its copy in transfer, the look-ahead's read of it, or for room), a prefetch for a later
  // access must not take the copy it waits for or reads from, or it would read the tensor again.
  const CountScope acquiring(mode == Mode::kAcquire ? &e.acquiring : nullptr);
  auto timeout = [&] {
    ++stats_.oom_errors;
    int n = 0;
    std::uint64_t pinned = pinned_bytes(t, &n);
    return OutOfMemoryError(t, e.info.bytes, budget_[idx(t)] - used_[idx(t)],
                            fmt::format("timed out after {:.1f} s (tiermem.acquire_timeout_s) waiting for "
                                        "tensor '{}' on {} (busy: pinned elsewhere or in transfer); pinned {} in "
                                        "{} tensors",
                                        opts.acquire_timeout.count(), e.info.name, tier_name(t),
                                        format_bytes(pinned), n));
  };
  while (true) {
    Copy& c = e.copy[idx(t)];
    if (c.state == State::kResident && c.version == e.latest && !c.writing) {
      if (mode == Mode::kAcquire) ++c.pins;
      return c.ptr;
    }
    // Read in place (the device's memory is the CPU's): a device read takes the current host copy
    // where it is; a host read-ahead is done when the device copy is current (its reader gathers
    // that one: a host copy beside it would read NVMe a second time).
    if (const int o = idx(t == Tier::kDevice ? Tier::kHost : Tier::kDevice);
        e.read_in_place && (t == Tier::kDevice || (t == Tier::kHost && mode == Mode::kPrefetch)) && readable(e, o)) {
      if (mode == Mode::kAcquire) ++e.copy[o].pins;
      return e.copy[o].ptr;
    }
    *hit = false;
    // A read-in-place tensor's host copy is its device copy to its reader: while one is being
    // loaded, the device waits for it, and a host prefetch leaves a device load alone, rather than
    // read NVMe a second time (the look-ahead's host read and the device hint of the same weight).
    const auto loading = [&](Tier o) { return e.copy[idx(o)].state == State::kLoading; };
    const bool other_loading = e.read_in_place && ((t == Tier::kDevice && loading(Tier::kHost)) ||
                                                   (t == Tier::kHost && mode == Mode::kPrefetch && loading(Tier::kDevice)));
    if (c.state == State::kLoading || c.state == State::kEvicting || c.writing || other_loading ||
        (c.state == State::kResident && (c.pins > 0 || c.readers > 0))) {
      if (mode == Mode::kPrefetch) return nullptr;
      if (!wait(lock, deadline)) throw timeout();
      continue;
    }
    int src = find_source(e, t);
    if (src < 0) {  // the newest bytes are in transfer (being written down); wait for them
      if (mode == Mode::kPrefetch) return nullptr;
      if (!wait(lock, deadline)) throw timeout();
      continue;
    }
    if (c.state == State::kAbsent) {
      std::uint64_t size = alloc_size(t, e.info.bytes);
      void* p = make_room(lock, t, size, mode, deadline, id);
      if (c.state != State::kAbsent) {  // someone else started meanwhile (mu_ was released)
        if (p != nullptr) tier_free(t, p);
        continue;
      }
      if (p == nullptr) return nullptr;  // a prefetch that would have to wait
      src = find_source(e, t);
      if (src < 0) {
        tier_free(t, p);
        continue;
      }
      c.ptr = p;
      c.alloc_bytes = size;
      account(t, static_cast<std::int64_t>(size));
    }
    // Load (or refresh in place) from src.
    const bool refresh = c.state == State::kResident;
    c.state = State::kLoading;
    Copy& s = e.copy[src];
    ++s.readers;
    const std::uint64_t version = s.version;
    const bool nvme = src == idx(Tier::kNvme);
    const Phase ph = io_begin(nvme);
    lock.unlock();
    std::exception_ptr err;
    try {
      transfer(e, tier_at(src), s.ptr, t, c.ptr);
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    io_end(nvme, ph);
    --s.readers;
    if (err) {
      if (refresh) {  // keep the (stale) allocation; the home copy is never freed
        c.state = State::kResident;
      } else {
        tier_free(t, c.ptr);
        account(t, -static_cast<std::int64_t>(c.alloc_bytes));
        c = Copy{};
      }
      cv_.notify_all();
      std::rethrow_exception(err);
    }
    c.state = State::kResident;
    c.version = version;
    count_move(e, src, idx(t), ph);
    cv_.notify_all();
    if (c.version == e.latest) {
      if (mode == Mode::kAcquire) ++c.pins;
      return c.ptr;
    }
  }
}

}  // namespace tiermem
