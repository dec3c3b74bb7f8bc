// tiermem/prefetcher.h — the reuse-distance prefetcher: TensorStore's trace-driven ResidencyPolicy.
//
// The first training step is recorded (AccessTrace); later steps replay it, and because the
// future is then known the Prefetcher
//   * prefetches the upcoming device accesses to the device, up to `prefetch_bucket_bytes` ahead
//     of the current access, while the live bytes (the current access + the look-ahead window)
//     stay under `max_live_bytes`; tensors merely cached (kept on release, evictable) are not
//     live. The immediately next access is hinted even when larger than the bucket (but not past
//     max_live), so the pipeline never runs dry;
//   * prefetches NVMe→host further ahead on its own budget, `nvme_prefetch_bytes`, over every
//     upcoming access (it does not stop at the first tensor still on NVMe, as DeepSpeed does);
//   * keeps a released tensor resident when its reuse distance (bytes of distinct other tensors
//     before its next use, see reuse_distance.h) is at most `max_reuse_distance_bytes`; beyond
//     it, keeps it too unless `cache_beyond_reuse_distance` is false (DeepSpeed releases it; with
//     Belady eviction an early release can only cost bytes, never save any, so we keep it);
//   * evicts, among the candidates TensorStore offers, the one whose next use is furthest away —
//     Belady's MIN ("A study of replacement algorithms for a virtual-storage computer", IBM Systems
//     Journal, 1966), optimal in misses for equal-sized tensors when the future is known. Tensors
//     absent from the trace count as never used again and go first;
//   * refuses to evict, for a prefetch, a tensor that a demand load at the prefetched tensor's use
//     might not evict: its next use must come after that use and after the next uses of every
//     access in between (evict_for_prefetch; Cao et al.'s "do no harm" rule, adapted to pinning).
//     With `aggressive_prefetch` it may also evict one used after the prefetched tensor, for a
//     tensor used within a quarter of the tier's budget (bytes of the pass) from now; the device
//     look-ahead then stops there too;
//   * plans the host tier (host_eviction_plan): once per trace it replays Belady's MIN over the
//     step's host-tier accesses, three times round the cycle, with the host pool's room for caches
//     (budget less home copies, less 1/32 of it or two of the largest host-tier tensors, whichever is
//     more, for rounding and fragmentation). A gradient partition's
//     first write of the step (recorded from TensorStore::touch with overwrite) needs room, not a
//     read; a discarded tensor frees its room after its access. From the last, steady cycle:
//     keep_on_release answers false for a tensor the plan evicts before its next use, so it is
//     written behind on a worker as soon as its last pin goes, not by the access that needs the
//     room; and an NVMe->host read-ahead goes out only when the plan's room, less the read-aheads
//     already granted, holds it from now until its use, nearest use first (a later one never takes
//     room a nearer one waits for). A read-ahead the store dropped, or one whose tensor left after
//     the look-ahead passed it, is asked again at the next access;
// The trace is treated as cyclic: the look-ahead at the end of a step runs into the next step's
// first accesses (set `prefetch_across_steps` false to stop at the step's end), and next uses wrap.
// Without a valid trace (the first step, a step that diverged, the step after it, which
// re-records) it is plain LRU: no hints, keep everything on release, evict the least recently
// accessed. Every derived decision (next uses, reuse distances, look-ahead cursors) is tied to
// the trace's generation and dropped the moment the trace is invalidated.
// Two exceptions follow a hint while they record: a step re-recorded on purpose (rerecord(): the
// engine's first step with updates moved into forward or backward, where only the optimizer's
// accesses move) follows the old trace's forward and backward accesses, and the first step follows
// the order its caller expects (expect_order(): an engine's modules forward, then in reverse).
// The position in the hint moves with each forward/backward access found within kHintResync
// positions ahead (others are skipped); from there it reads ahead to the device and from NVMe as
// a replay would (the same byte budgets, no host plan), and its victims are the tensors whose next
// use in the hint is furthest (Belady's MIN on the hint; tensors absent from it first), and a
// read-ahead may push out only what MIN would push out before its use, as in a replay
// (evict_for_prefetch, on the hint's positions). After
// kHintResync forward/backward accesses in a row that the hint does not have, the hint is dropped
// (plain LRU for the rest of the step).
//
// Units: every field of PrefetcherOptions is in BYTES. DeepSpeed's keys are in ELEMENTS
// (stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_max_reuse_distance; Config
// fields *_elems): from_config() converts them with the parameter dtype,
// bytes = elements × dtype_size(dtype) (saturating), e.g. 5e7 elements of bf16 = 1e8 bytes.
//
// Thread-safety: none of its own; TensorStore calls it under its policy mutex (see
// residency_policy.h). Errors: choose_victim throws tiermem::Error on an empty candidate list.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "tiermem/access_trace.h"
#include "tiermem/config.h"
#include "tiermem/dtype.h"
#include "tiermem/export.h"
#include "tiermem/residency_policy.h"
#include "tiermem/reuse_distance.h"

namespace tiermem {

// The room the host plan keeps back from the pool's room for caches (the budget less home copies),
// for rounding and fragmentation: 1/32 of `room_bytes` or two of the largest host-tier tensors
// (`largest_bytes`), whichever is more. Bytes; pure. Prefetcher plans with it and tiermem-plan
// predicts the pool with it. The Prefetcher passes the largest host-tier access no larger than a
// quarter of the room: one larger tensor (fp32_single_copy's master of a big embedding, read whole
// by the optimizer) would otherwise make the margin the whole room and leave no plan.
inline std::uint64_t host_plan_margin(std::uint64_t room_bytes, std::uint64_t largest_bytes) {
  return room_bytes / 32 > 2 * largest_bytes ? room_bytes / 32 : 2 * largest_bytes;
}

struct TIERMEM_API PrefetcherOptions {
  std::uint64_t prefetch_bucket_bytes = 100'000'000;     // 5e7 elements of bf16 (DeepSpeed default)
  std::uint64_t max_live_bytes = 2'000'000'000;          // 1e9 elements of bf16
  std::uint64_t max_reuse_distance_bytes = 2'000'000'000;  // 1e9 elements of bf16
  std::uint64_t nvme_prefetch_bytes = 256ull << 20;      // tiermem.nvme_prefetch_bytes
  bool prefetch_across_steps = true;                     // look-ahead wraps into the next step
  // Beyond max_reuse_distance_bytes, keep the tensor cached anyway (true) and let Belady evict it
  // when room is needed — it is then the first victim, its next use being far — or release it at
  // once like DeepSpeed (false; frees memory for whatever else shares the device).
  bool cache_beyond_reuse_distance = true;
  // Plan the host tier (tiermem.host_eviction_plan): replay Belady's MIN over the trace's
  // host-tier accesses with the pool's room, write behind at release what the plan evicts before
  // its next use, and read ahead from NVMe only into room the plan has free until the use.
  bool host_eviction_plan = true;
  // A prefetch may evict a cached tensor whose next use comes after the prefetched tensor's, even
  // where Belady's MIN would keep it ("aggressive" prefetching: Cao, Felten, Karlin and Li, "A
  // Study of Integrated Prefetching and Caching Strategies", SIGMETRICS 1995). false (MIN, the
  // default): a prefetch evicts only what MIN would evict before the prefetched tensor's use, so it
  // never adds a miss; on a pass that loops over more than the cache holds, nothing qualifies and
  // every read waits for its use. true: reads go ahead and overlap the compute and each other, for
  // some more bytes read — but only for a prefetched tensor whose use is within a quarter of the
  // tier's budget (kAggressiveWindowDivisor) of bytes accessed from now: further ahead, the victims
  // by next use would be the tensors MIN keeps for the next pass, and a pass that loops over more
  // than the cache holds would read every tensor every pass (a sliding window) instead of MIN's
  // misses plus the window. tiermem.prefetch_eviction ("auto": on for a forward-only engine).
  bool aggressive_prefetch = false;
  static constexpr std::uint64_t kAggressiveWindowDivisor = 4;

  // From zero_optimization.stage3_* (elements × dtype size), tiermem.nvme_prefetch_bytes and
  // tiermem.prefetch_eviction, whose "auto" is aggressive when `forward_only` (every module the
  // store pages is frozen: its passes only read).
  static PrefetcherOptions from_config(const Config& config, DType param_dtype, bool forward_only = false);
};

class TIERMEM_API Prefetcher final : public ResidencyPolicy {
 public:
  explicit Prefetcher(PrefetcherOptions options = {});

  void begin_step() override;
  void end_step() override;
  void forget_trace() override;
  // Between steps: drops the trace, keeping its forward and backward accesses as the next
  // recording step's hint (see above). Without a trace, the next step records without a hint.
  void rerecord() override;
  // Before the first step's accesses (no trace yet): `order`'s forward and backward accesses are
  // that step's hint, followed as rerecord()'s is. Ignored once a trace was recorded.
  void expect_order(std::span<const Access> order) override;
  // Records/checks the access (kOutsideStep ones only update recency: no trace, no hints); while
  // replaying returns device hints (nearest first) followed by host hints for the NVMe
  // look-ahead. Each trace position is hinted at most once per step.
  std::vector<PrefetchHint> on_access(TensorId id, std::uint64_t bytes, Tier tier, Phase phase,
                                      const ResidencyView& view) override;
  bool keep_on_release(TensorId id, Tier tier, const ResidencyView& view) override;
  TensorId choose_victim(Tier tier, std::span<const TensorId> candidates) override;
  void on_evicted(TensorId id, Tier tier) override;
  void on_discard(TensorId id) override;
  bool evict_for_prefetch(Tier tier, TensorId incoming, TensorId victim) override;
  void add_stats(TensorStoreStats& out) const override;  // prefetch_hints, prefetch_hints_recording

  // True when decisions come from a valid trace right now (replaying, no divergence this step).
  bool using_trace() const { return trace_.replaying(); }
  // True while a re-recording step follows the previous order as a hint (rerecord()).
  bool using_hint() const { return hint_active(); }
  // How far ahead of the hint's position (in hint accesses) an access may be found and move it; as
  // many forward/backward accesses in a row not found drop the hint.
  static constexpr std::size_t kHintResync = 64;
  const AccessTrace& trace() const { return trace_; }
  const PrefetcherOptions& options() const { return options_; }

  // Accesses from the current one until the next use of `id` (1 = the next access), from the
  // valid trace; kNoNextUse when not replaying or `id` is not in the trace.
  std::uint64_t accesses_until_next_use(TensorId id);

  struct Stats {
    std::uint64_t device_hints = 0, host_hints = 0;
    std::uint64_t kept = 0, dropped = 0;             // keep_on_release answers
    std::uint64_t belady_victims = 0, lru_victims = 0;
    std::uint64_t evictions = 0;                      // on_evicted calls
    std::uint64_t prefetches_refused = 0;             // evict_for_prefetch said no
    std::uint64_t aggressive_evictions = 0;           // ... said yes where MIN would have said no
    std::uint64_t write_behinds = 0;                  // keep_on_release said no: the host plan evicts it
    std::uint64_t host_hints_deferred = 0;            // a host read-ahead waiting for planned room
    std::uint64_t hints_recording = 0;                // device + host hints given while recording (rerecord())
    std::uint64_t hints_dropped = 0;                  // hints dropped: the order did not follow them
  };
  const Stats& stats() const { return stats_; }

 private:
  void reset_derived();
  void ensure_derived();
  std::uint64_t next_use_abs(TensorId id) const;  // absolute index of the next use after cur_
  std::uint64_t bytes_until(std::uint64_t abs) const;  // trace bytes after cur_ up to and including abs
  void ensure_host_plan(const ResidencyView& view);
  // Host read-ahead of the access at absolute index `q` (not in memory): true when the plan's room
  // holds it from now until its use (reserving that room), or it was granted before.
  bool grant_host_room(std::int64_t q, std::uint64_t bytes);
  void sweep_reservations();
  // The re-recording step's hint (rerecord()).
  bool hint_active() const { return !hint_.empty() && trace_.state() == AccessTrace::State::kRecording; }
  void follow_hint(TensorId id, Phase phase);
  std::vector<PrefetchHint> hint_look_ahead(TensorId id, std::uint64_t bytes, const ResidencyView& view);
  std::uint64_t hint_next_use(TensorId id) const;  // hint index of id's next use at or after hint_pos_
  // evict_for_prefetch's answer once its positions are known: `victim_use` after `horizon` (the
  // furthest next use of the accesses from now until incoming's use at `in_use`), or aggressive
  // within the window (`bytes_to_use`: bytes accessed until then). Counts the answer.
  bool may_evict_early(Tier tier, std::uint64_t in_use, std::uint64_t horizon, std::uint64_t victim_use,
                       std::uint64_t bytes_to_use);
  void drop_hint();
  void set_hint(std::vector<Access> hint, std::vector<std::uint8_t> read);

  PrefetcherOptions options_;
  AccessTrace trace_;
  Stats stats_;

  // Derived from trace_ at generation derived_gen_ (rebuilt lazily, dropped on invalidation).
  std::uint64_t derived_gen_ = ~0ull;
  std::vector<ReuseDistance> reuse_;
  std::vector<std::uint64_t> next_;  // next_uses(trace, kCyclic)
  std::vector<std::uint64_t> bytes_before_;  // trace bytes before each position (n + 1 sums)
  std::unordered_map<TensorId, std::vector<std::uint32_t>> positions_;  // sorted trace positions

  // Absolute indices into the endlessly repeated trace: step k position p is k*n + p.
  std::int64_t base_ = 0;         // absolute index of position 0 of the current step
  std::int64_t cur_ = -1;         // absolute index of the latest access (-1: none this replay)
  std::int64_t dev_cursor_ = -1;  // last absolute index hinted to the device
  std::int64_t host_cursor_ = -1; // last absolute index hinted to the host
  std::vector<std::uint8_t> host_moves_;  // per trace position: counted in the NVMe look-ahead
  bool continuing_ = false;       // the previous step replayed fully (cursors carry over)

  // Per trace position, learnt while recording: the access fills the tensor without reading it
  // (TensorStore::touch with overwrite), and the tensor was discarded after it (before its next
  // access). rec_* grow with the recording and become the valid trace's at end_step().
  std::vector<std::uint8_t> overwrite_, discard_after_, rec_overwrite_, rec_discard_;
  std::unordered_map<TensorId, std::uint32_t> rec_last_;  // latest recorded position per tensor

  // The host plan: Belady's MIN replayed over the trace's host-tier accesses (three cycles, the
  // last kept as the steady state) with the host pool's room for caches. Per trace position:
  // plan_wb_ — the tensor accessed there is evicted before its next access, so it may leave at
  // release (written behind on a worker, not on the path of the access that needs the room);
  // plan_room_ — bytes free after the access when every planned eviction happens at release.
  // Host read-ahead is granted only within that room (reserved_ per position, granted_ per target).
  std::uint64_t plan_gen_ = ~0ull, plan_capacity_ = 0;
  std::uint64_t plan_sizes_gen_ = ~0ull;    // the trace generation plan_sizes_ is for
  std::vector<std::uint64_t> plan_sizes_;  // the host-tier accesses' sizes, ascending and unique
  bool plan_valid_ = false;
  std::vector<std::uint8_t> plan_wb_;
  std::vector<std::int64_t> plan_room_;
  std::vector<std::uint64_t> reserved_;
  std::vector<std::uint8_t> granted_;
  std::int64_t swept_ = -1;  // absolute index up to which reservations were cleared

  std::uint64_t budget_seen_[kNumTiers] = {};  // each tier's budget, from the latest ResidencyView

  // The hint: the previous trace's forward and backward accesses (hint_read_: 0 where the access
  // overwrote without reading, never read ahead), their positions per tensor, the next expected
  // one, the look-ahead cursors (last hint index hinted) and the misses in a row.
  std::vector<Access> hint_;
  std::vector<std::uint8_t> hint_read_;
  std::vector<std::uint8_t> hint_moves_;  // per hint index: counted in the NVMe look-ahead
  std::vector<std::uint64_t> hint_next_;  // per hint index: the same tensor's next (n + first: the next step's)
  std::vector<std::uint64_t> hint_bytes_before_;  // hint bytes before each index (n + 1 sums)
  std::unordered_map<TensorId, std::vector<std::uint32_t>> hint_positions_;
  std::size_t hint_pos_ = 0;
  std::int64_t hint_dev_cursor_ = -1, hint_host_cursor_ = -1;
  std::size_t hint_misses_ = 0;

  // LRU fallback: access tick per tensor (0 = never accessed).
  std::uint64_t tick_ = 0;
  std::unordered_map<TensorId, std::uint64_t> last_tick_;
};

}  // namespace tiermem
