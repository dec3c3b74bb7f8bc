// Prefetcher: look-ahead hints, reuse-distance keep, Belady's MIN victims; LRU without a trace.
#include "tiermem/prefetcher.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/tensor_store.h"

namespace tiermem {
namespace {

std::uint64_t saturating_mul(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) {
    return std::numeric_limits<std::uint64_t>::max();
  }
  return a * b;
}

}  // namespace

PrefetcherOptions PrefetcherOptions::from_config(const Config& config, DType param_dtype, bool forward_only) {
  const std::uint64_t size = dtype_size(param_dtype);
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = saturating_mul(config.zero.stage3_prefetch_bucket_size_elems, size);
  o.max_live_bytes = saturating_mul(config.zero.stage3_max_live_parameters_elems, size);
  o.max_reuse_distance_bytes = saturating_mul(config.zero.stage3_max_reuse_distance_elems, size);
  o.nvme_prefetch_bytes = config.tiermem.nvme_prefetch_bytes;
  o.host_eviction_plan = config.tiermem.host_eviction_plan;
  const std::string& eviction = config.tiermem.prefetch_eviction;
  o.aggressive_prefetch = eviction == "aggressive" || (eviction == "auto" && forward_only);
  return o;
}

namespace {
// How far ahead (bytes of the trace) an aggressive prefetch may evict on `tier`: a quarter of its
// budget; 0 (no budget seen) leaves it unbounded.
std::uint64_t aggressive_window(const std::uint64_t (&budgets)[kNumTiers], Tier tier) {
  return budgets[static_cast<int>(tier)] / PrefetcherOptions::kAggressiveWindowDivisor;
}
}  // namespace

Prefetcher::Prefetcher(PrefetcherOptions options) : options_(options) {}

void Prefetcher::reset_derived() {
  derived_gen_ = ~0ull;
  reuse_.clear();
  next_.clear();
  bytes_before_.clear();
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
  bytes_before_.assign(t.size() + 1, 0);
  for (std::size_t i = 0; i < t.size(); ++i) bytes_before_[i + 1] = bytes_before_[i] + t[i].bytes;
  for (std::size_t i = 0; i < t.size(); ++i) {
    positions_[t[i].id].push_back(static_cast<std::uint32_t>(i));
  }
  derived_gen_ = trace_.generation();
}

void Prefetcher::forget_trace() {
  trace_.forget();
  continuing_ = false;
  rec_overwrite_.clear();
  rec_discard_.clear();
  rec_last_.clear();
  drop_hint();
}

void Prefetcher::drop_hint() {
  hint_.clear();
  hint_read_.clear();
  hint_moves_.clear();
  hint_next_.clear();
  hint_bytes_before_.clear();
  hint_positions_.clear();
  hint_pos_ = 0;
  hint_dev_cursor_ = -1;
  hint_host_cursor_ = -1;
  hint_misses_ = 0;
}

void Prefetcher::rerecord() {
  std::vector<Access> hint;
  std::vector<std::uint8_t> read;
  const auto t = trace_.accesses();
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i].phase != Phase::kForward && t[i].phase != Phase::kBackward) continue;  // those move
    hint.push_back(t[i]);
    read.push_back(i < overwrite_.size() && overwrite_[i] != 0 ? 0 : 1);
  }
  forget_trace();  // drops the trace (and any older hint)
  set_hint(std::move(hint), std::move(read));
  if (!hint_.empty()) {
    TM_LOG_DEBUG("PREFETCH",
                 "re-recording the step's order (the optimizer's accesses move); reading ahead along the "
                 "previous order's {} forward and backward accesses meanwhile",
                 hint_.size());
  }
}

void Prefetcher::expect_order(std::span<const Access> order) {
  if (trace_.has_trace() || trace_.state() == AccessTrace::State::kDiverged) return;  // a recorded order is better
  std::vector<Access> hint;
  for (const Access& a : order) {
    if (a.phase == Phase::kForward || a.phase == Phase::kBackward) hint.push_back(a);
  }
  std::vector<std::uint8_t> read(hint.size(), 1);
  set_hint(std::move(hint), std::move(read));
  if (!hint_.empty()) {
    TM_LOG_DEBUG("PREFETCH", "the first step reads ahead along the expected order of {} accesses while it records",
                 hint_.size());
  }
}

void Prefetcher::set_hint(std::vector<Access> hint, std::vector<std::uint8_t> read) {
  drop_hint();
  hint_ = std::move(hint);
  hint_read_ = std::move(read);
  const std::size_t n = hint_.size();
  for (std::size_t i = 0; i < n; ++i) hint_positions_[hint_[i].id].push_back(static_cast<std::uint32_t>(i));
  hint_next_.assign(n, 0);
  for (const auto& [id, pos] : hint_positions_) {
    for (std::size_t k = 0; k < pos.size(); ++k) hint_next_[pos[k]] = k + 1 < pos.size() ? pos[k + 1] : n + pos.front();
  }
  hint_bytes_before_.assign(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) hint_bytes_before_[i + 1] = hint_bytes_before_[i] + hint_[i].bytes;
}

void Prefetcher::begin_step() {
  const bool continuing = continuing_;
  continuing_ = false;
  trace_.begin_step();
  // A hint serves the one recording step right after rerecord() (its position is still at 0:
  // nothing follows it outside a recording step).
  if (trace_.state() != AccessTrace::State::kRecording) drop_hint();
  if (trace_.state() == AccessTrace::State::kRecording) {
    rec_overwrite_.clear();
    rec_discard_.clear();
    rec_last_.clear();
  }
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
    reserved_.clear();
    granted_.clear();
    swept_ = -1;
  }
}

void Prefetcher::end_step() {
  const bool was_replaying = trace_.replaying();
  const bool was_recording = trace_.state() == AccessTrace::State::kRecording;
  trace_.end_step();
  drop_hint();  // the step it served is over
  if (was_recording && trace_.has_trace()) {  // the recording is the trace now
    overwrite_ = std::move(rec_overwrite_);
    discard_after_ = std::move(rec_discard_);
    overwrite_.resize(trace_.accesses().size(), 0);
    discard_after_.resize(trace_.accesses().size(), 0);
    rec_overwrite_.clear();
    rec_discard_.clear();
    rec_last_.clear();
  }
  if (derived_gen_ != ~0ull && derived_gen_ != trace_.generation()) reset_derived();
  continuing_ = was_replaying && trace_.has_trace();
}

std::vector<PrefetchHint> Prefetcher::on_access(TensorId id, std::uint64_t bytes, Tier tier,
                                                Phase phase, const ResidencyView& view) {
  last_tick_[id] = ++tick_;
  std::copy(std::begin(view.budget_bytes), std::end(view.budget_bytes), std::begin(budget_seen_));
  if (phase == Phase::kOutsideStep) return {};  // not part of the step: the trace never sees it
  const bool matched = trace_.on_access(Access{id, bytes, phase, tier});
  if (trace_.state() == AccessTrace::State::kRecording) {
    rec_last_[id] = static_cast<std::uint32_t>(rec_overwrite_.size());
    rec_overwrite_.push_back(view.overwrite ? 1 : 0);
    rec_discard_.push_back(0);
  }
  if (!matched) {
    // Recording, or the trace just diverged: drop everything derived from a stale trace.
    if (derived_gen_ != ~0ull && derived_gen_ != trace_.generation()) reset_derived();
    if (!hint_active()) return {};
    follow_hint(id, phase);
    return hint_active() ? hint_look_ahead(id, bytes, view) : std::vector<PrefetchHint>{};
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
    // Aggressive: no further than evict_for_prefetch's window, or the hints beyond it would be
    // refused once and not asked again (each position is hinted once a step).
    const std::uint64_t device_window = aggressive_window(budget_seen_, Tier::kDevice);
    const std::uint64_t bucket = options_.aggressive_prefetch && device_window > 0
                                     ? std::min(options_.prefetch_bucket_bytes, device_window)
                                     : options_.prefetch_bucket_bytes;
    for (; c + 1 <= end; ++c) {
      const Access& x = at(c + 1);
      if (x.tier != Tier::kDevice) continue;
      if (window > 0 && window + x.bytes > bucket) break;
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
    ensure_host_plan(view);
    sweep_reservations();
    // A host read-ahead goes out when the plan has room for it until its use (else it waits for a
    // later access: room frees as the step goes on); other tiers' and unplanned ones always do.
    // In order of use: once one waits for room, later ones wait too (none may take the room the
    // nearer one is waiting for).
    bool waiting = false;
    auto host_hint = [&](std::int64_t abs) {
      const Access& x = at(abs);
      if (x.tier == Tier::kHost && plan_valid_ && (waiting || !grant_host_room(abs, x.bytes))) {
        waiting = true;
        ++stats_.host_hints_deferred;
        return;
      }
      hints.push_back({x.id, Tier::kHost});
    };
    if (host_moves_.size() != t.size()) host_moves_.assign(t.size(), 1);
    auto slot = [&](std::int64_t abs) -> std::uint8_t& { return host_moves_[static_cast<std::size_t>(abs % n)]; };
    std::int64_t c = std::max(host_cursor_, cur_);
    std::uint64_t window = 0;
    auto overwrites = [&](std::int64_t abs) {
      return overwrite_.size() == t.size() && overwrite_[static_cast<std::size_t>(abs % n)] != 0;
    };
    for (std::int64_t a = cur_ + 1; a <= c; ++a) {
      // Passed before. Still (or again) not in memory: the store dropped that prefetch (no room,
      // or the room's tenants were needed sooner), or the tensor left after the cursor passed it
      // (a write-behind). Room frees as the step goes on — a consumed gradient partition is
      // discarded, a pin ends — so ask again rather than leave it to a demand miss.
      const bool missing = view.in_memory && !overwrites(a) && !view.in_memory(at(a).id);
      if (missing) slot(a) = 1;
      if (!slot(a)) continue;
      window += at(a).bytes;
      if (missing && at(a).id != id) host_hint(a);
    }
    for (; c + 1 <= end; ++c) {
      const Access& x = at(c + 1);
      const bool moves = !overwrites(c + 1) && (!view.in_memory || !view.in_memory(x.id));
      slot(c + 1) = moves ? 1 : 0;
      if (!moves) continue;
      if (window > 0 && window + x.bytes > options_.nvme_prefetch_bytes) break;
      if (x.id != id) host_hint(c + 1);
      window += x.bytes;
    }
    host_cursor_ = c;
  }
  for (const auto& h : hints) ++(h.tier == Tier::kDevice ? stats_.device_hints : stats_.host_hints);
  return hints;
}

bool Prefetcher::keep_on_release(TensorId id, Tier tier, const ResidencyView& view) {
  bool keep = true;
  if (trace_.replaying()) {
    ensure_derived();
    if (tier == Tier::kHost) ensure_host_plan(view);
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
        if (keep && tier == Tier::kHost && plan_valid_ && plan_wb_[*(up - 1)]) {
          keep = false;  // the plan evicts it before its next use anyway: now, off the demand path
          ++stats_.write_behinds;
        }
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

std::uint64_t Prefetcher::bytes_until(std::uint64_t abs) const {
  const auto n = static_cast<std::uint64_t>(bytes_before_.size() - 1);
  if (n == 0) return 0;
  auto sum_before = [&](std::uint64_t a) { return (a / n) * bytes_before_[n] + bytes_before_[a % n]; };
  const auto from = static_cast<std::uint64_t>(std::max<std::int64_t>(cur_, -1) + 1);
  return abs + 1 > from ? sum_before(abs + 1) - sum_before(from) : 0;
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
  // Belady's MIN: the furthest next use (by the trace, or the recording step's hint); ties by LRU.
  auto furthest = [&](auto next_use) {
    std::uint64_t best_next = next_use(best);
    for (TensorId c : candidates.subspan(1)) {
      const std::uint64_t nu = next_use(c);
      if (nu > best_next || (nu == best_next && tick(c) < tick(best))) {
        best = c;
        best_next = nu;
      }
    }
    ++stats_.belady_victims;
  };
  if (trace_.replaying()) {
    ensure_derived();
    furthest([&](TensorId id) { return next_use_abs(id); });
  } else if (hint_active()) {
    furthest([&](TensorId id) { return hint_next_use(id); });
  } else {
    for (TensorId c : candidates.subspan(1)) {
      if (tick(c) < tick(best) || (tick(c) == tick(best) && c < best)) best = c;
    }
    ++stats_.lru_victims;
  }
  return best;
}

void Prefetcher::add_stats(TensorStoreStats& out) const {
  out.prefetch_hints = stats_.device_hints + stats_.host_hints;
  out.prefetch_hints_recording = stats_.hints_recording;
}

void Prefetcher::on_evicted(TensorId /*id*/, Tier /*tier*/) { ++stats_.evictions; }

void Prefetcher::on_discard(TensorId id) {
  if (trace_.state() != AccessTrace::State::kRecording) return;
  auto it = rec_last_.find(id);
  if (it != rec_last_.end() && it->second < rec_discard_.size()) rec_discard_[it->second] = 1;
}

void Prefetcher::ensure_host_plan(const ResidencyView& view) {
  const auto t = trace_.accesses();
  const std::uint64_t budget = view.budget_bytes[static_cast<int>(Tier::kHost)];
  const std::uint64_t homes = view.home_bytes ? view.home_bytes(Tier::kHost) : 0;
  // Room for caches: the budget less home copies, less a margin for rounding and the pool's
  // fragmentation — 1/32 of it or two of the largest host-tier tensors, whichever is more (the
  // plan must not promise room the pool cannot give: with 1/32 alone, gpt2's 85 MB sub-groups in
  // a 1 GiB pool cycled one sub-group more than planned, evicted on demand). Tensors over a quarter
  // of the room are left out of "largest": the plan cannot work around them anyway, and with them
  // in one large tensor would leave no plan at all (fp32_single_copy's masters: gpt2's 154 MB
  // embedding, read whole by the optimizer, against a 256 MiB host budget).
  if (plan_sizes_gen_ != derived_gen_ || derived_gen_ == ~0ull) {  // once per trace, not at every access
    plan_sizes_gen_ = derived_gen_;
    plan_sizes_.clear();
    for (const Access& a : t) {
      if (a.tier == Tier::kHost) plan_sizes_.push_back(a.bytes);
    }
    std::sort(plan_sizes_.begin(), plan_sizes_.end());
    plan_sizes_.erase(std::unique(plan_sizes_.begin(), plan_sizes_.end()), plan_sizes_.end());
  }
  const std::uint64_t room = budget > homes ? budget - homes : 0;
  std::uint64_t largest = plan_sizes_.empty() ? 0 : plan_sizes_.back();
  auto fits = std::upper_bound(plan_sizes_.begin(), plan_sizes_.end(), room / 4);
  if (fits != plan_sizes_.begin()) largest = *(fits - 1);
  const std::uint64_t margin = host_plan_margin(room, largest);
  const std::uint64_t capacity = room > margin ? room - margin : 0;
  // Replanned for a new trace, or when the room moved by more than 1/64 (home copies come and go;
  // the plan costs O(host accesses x resident tensors), so not at every access).
  const std::uint64_t moved = capacity > plan_capacity_ ? capacity - plan_capacity_ : plan_capacity_ - capacity;
  if (plan_gen_ == derived_gen_ && moved <= room / 64) return;
  plan_gen_ = derived_gen_;
  plan_capacity_ = capacity;
  plan_valid_ = false;
  const std::size_t n = t.size();
  plan_wb_.assign(n, 0);
  plan_room_.assign(n, 0);
  reserved_.assign(n, 0);
  granted_.assign(n, 0);
  swept_ = cur_ - 1;
  if (!options_.host_eviction_plan || n == 0 || capacity == 0 || overwrite_.size() != n || discard_after_.size() != n) return;

  // The host-tier accesses of tensors that are cached there (not homed there).
  std::vector<std::uint32_t> hp;
  for (std::size_t i = 0; i < n; ++i) {
    if (t[i].tier != Tier::kHost) continue;
    if (view.home && view.home(t[i].id) == Tier::kHost) continue;
    hp.push_back(static_cast<std::uint32_t>(i));
  }
  const std::size_t m = hp.size();
  if (m == 0) return;
  // gap[k]: host accesses from hp[k] to the next access of the same tensor (cyclic, 1..m).
  std::vector<std::uint32_t> gap(m, static_cast<std::uint32_t>(m));
  {
    std::unordered_map<TensorId, std::size_t> seen;
    for (std::size_t r = 2 * m; r-- > 0;) {
      const std::size_t k = r % m;
      const TensorId id = t[hp[k]].id;
      auto it = seen.find(id);
      if (it != seen.end() && r < m) gap[k] = static_cast<std::uint32_t>(it->second - r);
      seen[id] = r;
    }
  }
  struct Res {
    std::uint64_t bytes;
    std::int64_t last;  // absolute host-access index of its latest access
  };
  std::unordered_map<TensorId, Res> res;
  std::uint64_t used = 0;
  struct Ev {
    std::int64_t last, at;
    std::uint64_t bytes;
  };
  std::vector<Ev> evictions;                 // in the last cycle
  std::vector<std::uint64_t> occupied(m, 0);  // after each host access of the last cycle
  constexpr int kCycles = 3;
  for (std::int64_t a = 0; a < static_cast<std::int64_t>(kCycles * m); ++a) {
    const std::size_t k = static_cast<std::size_t>(a % static_cast<std::int64_t>(m));
    const bool last_cycle = a >= static_cast<std::int64_t>((kCycles - 1) * m);
    const Access& x = t[hp[k]];
    auto it = res.find(x.id);
    if (it == res.end()) {
      // Room by Belady's MIN; the previous host access's tensor is taken to be still pinned.
      const TensorId prev = t[hp[(k + m - 1) % m]].id;
      while (used + x.bytes > capacity) {
        TensorId victim = kInvalidTensor;
        std::int64_t far = -1;
        for (const auto& [rid, r] : res) {
          if (rid == prev) continue;
          const std::int64_t next = r.last + gap[static_cast<std::size_t>(r.last % static_cast<std::int64_t>(m))];
          if (next > far) {
            far = next;
            victim = rid;
          }
        }
        if (victim == kInvalidTensor) break;  // over the room even so: the plan cannot help
        const Res v = res[victim];
        if (last_cycle) evictions.push_back({v.last, a, v.bytes});
        used -= v.bytes;
        res.erase(victim);
      }
      res[x.id] = {x.bytes, a};
      used += x.bytes;
    } else {
      it->second.last = a;
    }
    if (discard_after_[hp[k]]) {
      used -= x.bytes;
      res.erase(x.id);
    }
    if (last_cycle) occupied[k] = used;
  }
  // Steady state: each last-cycle eviction marks its victim's latest access for write-behind and
  // frees its bytes from that access on, instead of at the access that needed them.
  std::vector<std::int64_t> free_after(m);
  for (std::size_t k = 0; k < m; ++k) free_after[k] = static_cast<std::int64_t>(capacity - std::min(capacity, occupied[k]));
  for (const Ev& e : evictions) {
    plan_wb_[hp[static_cast<std::size_t>(e.last % static_cast<std::int64_t>(m))]] = 1;
    for (std::int64_t r = e.last; r < e.at; ++r) {
      free_after[static_cast<std::size_t>(r % static_cast<std::int64_t>(m))] += static_cast<std::int64_t>(e.bytes);
    }
  }
  // Per trace position: the room after the latest host access at or before it.
  for (std::size_t i = 0, k = m - 1; i < n; ++i) {
    if (k + 1 < m && hp[k + 1] == i) ++k;
    else if (i == hp[0]) k = 0;
    plan_room_[i] = free_after[k];
  }
  plan_valid_ = true;
}

void Prefetcher::sweep_reservations() {
  if (reserved_.empty()) return;
  const auto n = static_cast<std::int64_t>(reserved_.size());
  for (std::int64_t r = std::max(swept_ + 1, cur_ - n + 1); r < cur_; ++r) {
    if (r < 0) continue;
    reserved_[static_cast<std::size_t>(r % n)] = 0;
    granted_[static_cast<std::size_t>(r % n)] = 0;
  }
  swept_ = std::max(swept_, cur_ - 1);
}

bool Prefetcher::grant_host_room(std::int64_t q, std::uint64_t bytes) {
  const auto n = static_cast<std::int64_t>(plan_room_.size());
  if (granted_[static_cast<std::size_t>(q % n)]) return true;
  const auto b = static_cast<std::int64_t>(bytes);
  for (std::int64_t r = std::max<std::int64_t>(cur_, 0); r < q; ++r) {
    const auto i = static_cast<std::size_t>(r % n);
    if (plan_room_[i] - static_cast<std::int64_t>(reserved_[i]) < b) return false;
  }
  for (std::int64_t r = std::max<std::int64_t>(cur_, 0); r < q; ++r) reserved_[static_cast<std::size_t>(r % n)] += bytes;
  granted_[static_cast<std::size_t>(q % n)] = 1;
  return true;
}

bool Prefetcher::evict_for_prefetch(Tier tier, TensorId incoming, TensorId victim) {
  // Demand-loading `incoming` at its use would pick the victim among everything resident then,
  // including the tensors accessed from now until that use (pinned or still to come now). Evicting
  // `victim` early is harmless only if it would still be the furthest: its next use must come
  // after incoming's use and after the next uses of every access in between. The same rule over
  // the trace (replaying) and over the hint (a recording step reading ahead along an order).
  if (trace_.replaying()) {
    ensure_derived();
    const std::uint64_t in_use = next_use_abs(incoming);
    if (in_use == kNoNextUse) return false;  // not in the trace: no reason to prefetch it
    std::uint64_t horizon = in_use;
    const auto n = static_cast<std::uint64_t>(next_.size());
    for (auto q = static_cast<std::uint64_t>(std::max<std::int64_t>(cur_, 0)); q < in_use; ++q) {
      horizon = std::max(horizon, q - q % n + next_[q % n]);
    }
    return may_evict_early(tier, in_use, horizon, next_use_abs(victim), bytes_until(in_use));
  }
  if (!hint_active()) return true;
  const std::uint64_t in_use = hint_next_use(incoming);
  if (in_use == kNoNextUse) return false;
  std::uint64_t horizon = in_use;
  const std::uint64_t n = hint_.size();
  const std::uint64_t now = hint_pos_ > 0 ? hint_pos_ - 1 : 0;  // the latest access (pinned now)
  for (std::uint64_t q = now; q < std::min(in_use, n); ++q) horizon = std::max(horizon, hint_next_[q]);
  const std::uint64_t to_use = hint_bytes_before_[std::min(in_use + 1, n)] - hint_bytes_before_[std::min(hint_pos_, n)];
  return may_evict_early(tier, in_use, horizon, hint_next_use(victim), to_use);
}

bool Prefetcher::may_evict_early(Tier tier, std::uint64_t in_use, std::uint64_t horizon, std::uint64_t victim_use,
                                 std::uint64_t bytes_to_use) {
  if (victim_use > horizon) return true;
  // Aggressive (PrefetcherOptions::aggressive_prefetch): the victim is still used after incoming,
  // so incoming is not read at the cost of something needed before it; and incoming's use is
  // within the window (a quarter of the tier's budget in bytes accessed until then), so the
  // read-ahead takes that much of the cache from what MIN keeps, not all of it.
  const std::uint64_t window = aggressive_window(budget_seen_, tier);
  if (options_.aggressive_prefetch && victim_use > in_use && (window == 0 || bytes_to_use <= window)) {
    ++stats_.aggressive_evictions;
    return true;
  }
  ++stats_.prefetches_refused;
  return false;
}

// --------------------------------------------------------------------- the re-recording step's hint

void Prefetcher::follow_hint(TensorId id, Phase phase) {
  if (phase != Phase::kForward && phase != Phase::kBackward) return;  // the optimizer's: they moved
  auto it = hint_positions_.find(id);
  if (it != hint_positions_.end()) {
    const auto& pos = it->second;
    for (auto p = std::lower_bound(pos.begin(), pos.end(), hint_pos_); p != pos.end() && *p < hint_pos_ + kHintResync;
         ++p) {
      if (hint_[*p].phase != phase) continue;
      hint_pos_ = *p + std::size_t{1};
      hint_misses_ = 0;
      return;
    }
  }
  if (++hint_misses_ >= kHintResync) {
    ++stats_.hints_dropped;
    TM_LOG_DEBUG("PREFETCH",
                 "{} forward/backward accesses in a row are not in the previous order near position {} of {}; "
                 "the read-ahead along it stops for this step",
                 hint_misses_, hint_pos_, hint_.size());
    drop_hint();
  }
}

std::uint64_t Prefetcher::hint_next_use(TensorId id) const {
  auto it = hint_positions_.find(id);
  if (it == hint_positions_.end()) return kNoNextUse;
  const auto& pos = it->second;
  auto p = std::lower_bound(pos.begin(), pos.end(), hint_pos_);
  return p != pos.end() ? *p : hint_.size() + pos.front();  // else: the next step's
}

// As the replay's look-ahead (on_access), over the hint from its position to its end: device hints
// within the bucket and max_live, NVMe->host hints within nvme_prefetch_bytes of bytes that move.
std::vector<PrefetchHint> Prefetcher::hint_look_ahead(TensorId id, std::uint64_t bytes, const ResidencyView& view) {
  std::vector<PrefetchHint> hints;
  const auto n = static_cast<std::int64_t>(hint_.size());
  const auto from = static_cast<std::int64_t>(hint_pos_);  // the next expected access
  auto read = [&](std::int64_t a) { return hint_read_[static_cast<std::size_t>(a)] != 0; };
  auto at = [&](std::int64_t a) -> const Access& { return hint_[static_cast<std::size_t>(a)]; };
  {
    std::int64_t c = std::max(hint_dev_cursor_, from - 1);
    std::uint64_t window = 0;
    for (std::int64_t a = from; a <= c; ++a) {
      if (at(a).tier == Tier::kDevice) window += at(a).bytes;
    }
    for (; c + 1 < n; ++c) {
      const Access& x = at(c + 1);
      if (x.tier != Tier::kDevice) continue;
      if (window > 0 && window + x.bytes > options_.prefetch_bucket_bytes) break;
      if (bytes + window + x.bytes > options_.max_live_bytes) break;
      if (x.id != id && read(c + 1)) hints.push_back({x.id, Tier::kDevice});
      window += x.bytes;
    }
    hint_dev_cursor_ = c;
  }
  if (options_.nvme_prefetch_bytes > 0) {
    if (hint_moves_.size() != hint_.size()) hint_moves_.assign(hint_.size(), 0);
    auto moves = [&](std::int64_t a) -> std::uint8_t& { return hint_moves_[static_cast<std::size_t>(a)]; };
    std::int64_t c = std::max(hint_host_cursor_, from - 1);
    std::uint64_t window = 0;
    for (std::int64_t a = from; a <= c; ++a) {
      // Passed before and not in memory now (dropped, or left again): asked again; counted while
      // ahead, as the replay's look-ahead does.
      const bool missing = read(a) && view.in_memory && !view.in_memory(at(a).id);
      if (missing) moves(a) = 1;
      if (!moves(a)) continue;
      window += at(a).bytes;
      if (missing && at(a).id != id) hints.push_back({at(a).id, Tier::kHost});
    }
    for (; c + 1 < n; ++c) {
      const Access& x = at(c + 1);
      const bool m = read(c + 1) && (!view.in_memory || !view.in_memory(x.id));
      moves(c + 1) = m ? 1 : 0;
      if (!m) continue;
      if (window > 0 && window + x.bytes > options_.nvme_prefetch_bytes) break;
      if (x.id != id) hints.push_back({x.id, Tier::kHost});
      window += x.bytes;
    }
    hint_host_cursor_ = c;
  }
  for (const auto& h : hints) ++(h.tier == Tier::kDevice ? stats_.device_hints : stats_.host_hints);
  stats_.hints_recording += hints.size();
  return hints;
}

}  // namespace tiermem
