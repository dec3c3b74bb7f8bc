// Prefetcher: look-ahead hints, reuse-distance keep, Belady's MIN victims; LRU without a trace.
#include "tiermem/prefetcher.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {
namespace {

std::uint64_t saturating_mul(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) {
    return std::numeric_limits<std::uint64_t>::max();
  }
  return a * b;
}

}  // namespace

PrefetcherOptions PrefetcherOptions::from_config(const Config& config, DType param_dtype) {
  const std::uint64_t size = dtype_size(param_dtype);
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = saturating_mul(config.zero.stage3_prefetch_bucket_size_elems, size);
  o.max_live_bytes = saturating_mul(config.zero.stage3_max_live_parameters_elems, size);
  o.max_reuse_distance_bytes = saturating_mul(config.zero.stage3_max_reuse_distance_elems, size);
  o.nvme_prefetch_bytes = config.tiermem.nvme_prefetch_bytes;
  return o;
}

Prefetcher::Prefetcher(PrefetcherOptions options) : options_(options) {}

void Prefetcher::reset_derived() {
  derived_gen_ = ~0ull;
  reuse_.clear();
  next_.clear();
  positions_.clear();
  base_ = 0;
  cur_ = -1;
  dev_cursor_ = -1;
  host_cursor_ = -1;
  continuing_ = false;
}

void Prefetcher::ensure_derived() {
  if (derived_gen_ == trace_.generation()) return;
  reset_derived();
  auto t = trace_.accesses();
  reuse_ = reuse_distances(t, ReuseMode::kCyclic);
  next_ = next_uses(t, ReuseMode::kCyclic);
  for (std::size_t i = 0; i < t.size(); ++i) {
    positions_[t[i].id].push_back(static_cast<std::uint32_t>(i));
  }
  derived_gen_ = trace_.generation();
}

void Prefetcher::begin_step() {
  const bool continuing = continuing_;
  continuing_ = false;
  trace_.begin_step();
  if (!trace_.replaying()) return;
  const std::uint64_t gen_before = derived_gen_;
  ensure_derived();
  if (continuing && gen_before == derived_gen_) {
    base_ += static_cast<std::int64_t>(trace_.accesses().size());  // cursors carry over
  } else {
    base_ = 0;
    cur_ = -1;
    dev_cursor_ = -1;
    host_cursor_ = -1;
  }
}

void Prefetcher::end_step() {
  const bool was_replaying = trace_.replaying();
  trace_.end_step();
  if (derived_gen_ != ~0ull && derived_gen_ != trace_.generation()) reset_derived();
  continuing_ = was_replaying && trace_.has_trace();
}

std::vector<PrefetchHint> Prefetcher::on_access(TensorId id, std::uint64_t bytes, Tier tier,
                                                Phase phase, const ResidencyView& view) {
  last_tick_[id] = ++tick_;
  if (phase == Phase::kOutsideStep) return {};  // not part of the step: the trace never sees it
  const bool matched = trace_.on_access(Access{id, bytes, phase, tier});
  if (!matched) {
    // Recording, or the trace just diverged: drop everything derived from a stale trace.
    if (derived_gen_ != ~0ull && derived_gen_ != trace_.generation()) reset_derived();
    return {};
  }
  ensure_derived();
  auto t = trace_.accesses();
  const auto n = static_cast<std::int64_t>(t.size());
  cur_ = base_ + static_cast<std::int64_t>(trace_.position()) - 1;
  const std::int64_t end = options_.prefetch_across_steps ? cur_ + n - 1 : base_ + n - 1;
  auto at = [&](std::int64_t abs) -> const Access& { return t[static_cast<std::size_t>(abs % n)]; };

  std::vector<PrefetchHint> hints;
  // Device look-ahead: the next device accesses up to the bucket, while live bytes stay capped.
  {
    std::int64_t c = std::max(dev_cursor_, cur_);
    std::uint64_t window = 0;
    for (std::int64_t a = cur_ + 1; a <= c; ++a) {
      if (at(a).tier == Tier::kDevice) window += at(a).bytes;
    }
    // Live = in use now + fetched ahead for use. Tensors merely cached (kept on release, evictable
    // at any time) are not live, or a well-used cache would switch prefetching off.
    const std::uint64_t live = bytes;
    for (; c + 1 <= end; ++c) {
      const Access& x = at(c + 1);
      if (x.tier != Tier::kDevice) continue;
      if (window > 0 && window + x.bytes > options_.prefetch_bucket_bytes) break;
      if (live + window + x.bytes > options_.max_live_bytes) break;
      if (x.id != id) hints.push_back({x.id, Tier::kDevice});
      window += x.bytes;
    }
    dev_cursor_ = c;
  }
  // NVMe->host look-ahead: every upcoming access, further ahead, on its own byte budget. The
  // budget counts the bytes that move: an access whose tensor is already in memory when the
  // cursor passes it (a device-resident parameter, a host-homed gradient partition) is neither
  // hinted nor counted, so the look-ahead reaches past them to what does need reading (e.g. the
  // optimizer state of the coming step, read during backward).
  if (options_.nvme_prefetch_bytes > 0) {
    if (host_moves_.size() != t.size()) host_moves_.assign(t.size(), 1);
    auto slot = [&](std::int64_t abs) -> std::uint8_t& { return host_moves_[static_cast<std::size_t>(abs % n)]; };
    std::int64_t c = std::max(host_cursor_, cur_);
    std::uint64_t window = 0;
    for (std::int64_t a = cur_ + 1; a <= c; ++a) {
      if (slot(a)) window += at(a).bytes;
    }
    for (; c + 1 <= end; ++c) {
      const Access& x = at(c + 1);
      const bool moves = !view.in_memory || !view.in_memory(x.id);
      slot(c + 1) = moves ? 1 : 0;
      if (!moves) continue;
      if (window > 0 && window + x.bytes > options_.nvme_prefetch_bytes) break;
      if (x.id != id) hints.push_back({x.id, Tier::kHost});
      window += x.bytes;
    }
    host_cursor_ = c;
  }
  for (const auto& h : hints) ++(h.tier == Tier::kDevice ? stats_.device_hints : stats_.host_hints);
  return hints;
}

bool Prefetcher::keep_on_release(TensorId id, Tier /*tier*/, const ResidencyView& /*view*/) {
  bool keep = true;
  if (trace_.replaying()) {
    ensure_derived();
    auto it = positions_.find(id);
    if (it == positions_.end()) {
      keep = options_.cache_beyond_reuse_distance;  // not in the trace: never used again
    } else {
      // The latest access of `id` at or before the current position decides.
      const std::int64_t p = cur_ - base_;
      const auto& pos = it->second;
      auto up = std::upper_bound(pos.begin(), pos.end(), p, [](std::int64_t v, std::uint32_t x) {
        return v < static_cast<std::int64_t>(x);
      });
      if (up != pos.begin()) {
        keep = reuse_[*(up - 1)].bytes <= options_.max_reuse_distance_bytes ||
               options_.cache_beyond_reuse_distance;
      }
    }
  }
  ++(keep ? stats_.kept : stats_.dropped);
  return keep;
}

std::uint64_t Prefetcher::next_use_abs(TensorId id) const {
  auto it = positions_.find(id);
  if (it == positions_.end()) return kNoNextUse;
  const std::int64_t p = cur_ - base_;  // -1 before the step's first access
  const auto& pos = it->second;
  auto up = std::upper_bound(pos.begin(), pos.end(), p, [](std::int64_t v, std::uint32_t x) {
    return v < static_cast<std::int64_t>(x);
  });
  const auto n = static_cast<std::int64_t>(trace_.accesses().size());
  const std::int64_t abs = up != pos.end() ? base_ + *up : base_ + n + pos.front();
  return static_cast<std::uint64_t>(abs);
}

std::uint64_t Prefetcher::accesses_until_next_use(TensorId id) {
  if (!trace_.replaying()) return kNoNextUse;
  ensure_derived();
  const std::uint64_t abs = next_use_abs(id);
  if (abs == kNoNextUse) return kNoNextUse;
  return abs - static_cast<std::uint64_t>(std::max<std::int64_t>(cur_, base_ - 1));
}

TensorId Prefetcher::choose_victim(Tier tier, std::span<const TensorId> candidates) {
  if (candidates.empty()) {
    throw Error(fmt::format("Prefetcher::choose_victim({}): no candidates (TensorStore must offer "
                            "at least one resident, unpinned tensor)",
                            tier_name(tier)));
  }
  auto tick = [&](TensorId id) {
    auto it = last_tick_.find(id);
    return it == last_tick_.end() ? 0 : it->second;
  };
  TensorId best = candidates.front();
  if (trace_.replaying()) {
    ensure_derived();
    std::uint64_t best_next = next_use_abs(best);
    for (TensorId c : candidates.subspan(1)) {
      const std::uint64_t nu = next_use_abs(c);
      if (nu > best_next || (nu == best_next && tick(c) < tick(best))) {
        best = c;
        best_next = nu;
      }
    }
    ++stats_.belady_victims;
  } else {
    for (TensorId c : candidates.subspan(1)) {
      if (tick(c) < tick(best) || (tick(c) == tick(best) && c < best)) best = c;
    }
    ++stats_.lru_victims;
  }
  return best;
}

void Prefetcher::on_evicted(TensorId /*id*/, Tier /*tier*/) { ++stats_.evictions; }

bool Prefetcher::evict_for_prefetch(Tier /*tier*/, TensorId incoming, TensorId victim) {
  if (!trace_.replaying()) return true;
  ensure_derived();
  // Demand-loading `incoming` at its use would pick the victim among everything resident then,
  // including the tensors accessed from now until that use (pinned or still to come now). Evicting
  // `victim` early is harmless only if it would still be the furthest: its next use must come
  // after incoming's use and after the next uses of every access in between.
  const std::uint64_t in_use = next_use_abs(incoming);
  if (in_use == kNoNextUse) return false;  // not in the trace: no reason to prefetch it
  std::uint64_t horizon = in_use;
  const auto n = static_cast<std::uint64_t>(next_.size());
  for (auto q = static_cast<std::uint64_t>(std::max<std::int64_t>(cur_, 0)); q < in_use; ++q) {
    horizon = std::max(horizon, q - q % n + next_[q % n]);
  }
  if (next_use_abs(victim) > horizon) return true;
  ++stats_.prefetches_refused;
  return false;
}

}  // namespace tiermem
