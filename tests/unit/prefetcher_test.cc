#include "tiermem/prefetcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <set>

#include "tiermem/error.h"
#include "tiermem/tensor_store.h"

namespace tiermem {
namespace {

ResidencyView empty_view() { return ResidencyView{}; }

// Runs one step of `ids` (each `bytes` bytes, device tier) and returns the hints per access.
std::vector<std::vector<PrefetchHint>> step(Prefetcher& p, const std::vector<TensorId>& ids,
                                            std::uint64_t bytes = 10) {
  std::vector<std::vector<PrefetchHint>> out;
  p.begin_step();
  for (TensorId id : ids) out.push_back(p.on_access(id, bytes, Tier::kDevice, Phase::kForward, empty_view()));
  p.end_step();
  return out;
}

std::vector<TensorId> ids_of(const std::vector<PrefetchHint>& h, Tier tier) {
  std::vector<TensorId> v;
  for (auto x : h) if (x.tier == tier) v.push_back(x.id);
  return v;
}

using Ids = std::vector<TensorId>;

TEST(PrefetcherOptions, ConvertsDeepSpeedElementsWithTheDtype) {
  Config c;
  c.zero.stage3_prefetch_bucket_size_elems = 50'000'000;
  c.zero.stage3_max_live_parameters_elems = 1'000'000'000;
  c.zero.stage3_max_reuse_distance_elems = 7;
  c.tiermem.nvme_prefetch_bytes = 12345;
  auto bf16 = PrefetcherOptions::from_config(c, DType::kBF16);
  EXPECT_EQ(bf16.prefetch_bucket_bytes, 100'000'000u);
  EXPECT_EQ(bf16.max_live_bytes, 2'000'000'000u);
  EXPECT_EQ(bf16.max_reuse_distance_bytes, 14u);
  EXPECT_EQ(bf16.nvme_prefetch_bytes, 12345u);  // already bytes
  auto f32 = PrefetcherOptions::from_config(c, DType::kF32);
  EXPECT_EQ(f32.prefetch_bucket_bytes, 200'000'000u);
  c.zero.stage3_max_live_parameters_elems = ~0ull / 2;
  EXPECT_EQ(PrefetcherOptions::from_config(c, DType::kF32).max_live_bytes, ~0ull);  // saturates
}

TEST(Prefetcher, FirstStepIsLruWithoutHints) {
  Prefetcher p;
  p.begin_step();
  for (TensorId id : {4u, 2u, 9u, 2u}) {
    EXPECT_TRUE(p.on_access(id, 10, Tier::kDevice, Phase::kForward, empty_view()).empty());
  }
  EXPECT_FALSE(p.using_trace());
  EXPECT_TRUE(p.keep_on_release(9, Tier::kDevice, empty_view()));
  const TensorId cand[] = {2, 9, 4};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, cand), 4u);  // least recently used
  const TensorId cand2[] = {2, 9};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, cand2), 9u);
  EXPECT_EQ(p.stats().lru_victims, 2u);
  EXPECT_THROW(p.choose_victim(Tier::kDevice, {}), Error);
  p.end_step();
}

TEST(Prefetcher, DeviceLookAheadStaysWithinTheBucketAndHintsEachPositionOnce) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 25;  // two 10-byte tensors
  o.nvme_prefetch_bytes = 50;    // five
  o.prefetch_across_steps = false;
  Prefetcher p(o);
  const Ids order = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  step(p, order);  // record
  auto h = step(p, order);
  EXPECT_EQ(ids_of(h[0], Tier::kDevice), (Ids{1, 2}));
  EXPECT_EQ(ids_of(h[0], Tier::kHost), (Ids{1, 2, 3, 4, 5}));
  EXPECT_EQ(ids_of(h[1], Tier::kDevice), (Ids{3}));  // 2 is in flight; 3 fits, 4 would not
  EXPECT_EQ(ids_of(h[1], Tier::kHost), (Ids{6}));
  // Every later position is hinted exactly once, and nothing past the step's end.
  std::multiset<TensorId> dev, host;
  for (auto& x : h) {
    for (auto id : ids_of(x, Tier::kDevice)) dev.insert(id);
    for (auto id : ids_of(x, Tier::kHost)) host.insert(id);
  }
  EXPECT_EQ(dev, (std::multiset<TensorId>{1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(host, dev);
  EXPECT_TRUE(ids_of(h[9], Tier::kDevice).empty());
}

TEST(Prefetcher, NextTensorIsHintedEvenWhenLargerThanTheBucket) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 5;
  o.nvme_prefetch_bytes = 5;
  Prefetcher p(o);
  step(p, {0, 1, 2});
  auto h = step(p, {0, 1, 2});
  EXPECT_EQ(ids_of(h[0], Tier::kDevice), (Ids{1}));
  EXPECT_EQ(ids_of(h[1], Tier::kDevice), (Ids{2}));
  EXPECT_EQ(ids_of(h[1], Tier::kHost), (Ids{2}));
}

TEST(Prefetcher, MaxLiveBytesStopsDeviceHintsButNotHostHints) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 100;
  o.max_live_bytes = 35;  // the current 10-byte access + two more
  o.nvme_prefetch_bytes = 40;
  Prefetcher p(o);
  step(p, {0, 1, 2, 3, 4, 5});
  p.begin_step();
  ResidencyView v;
  v.resident_bytes[0] = 1000;  // a full cache is not live: it does not stop prefetching
  auto h = p.on_access(0, 10, Tier::kDevice, Phase::kForward, v);
  EXPECT_EQ(ids_of(h, Tier::kDevice), (Ids{1, 2}));
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{1, 2, 3, 4}));
  h = p.on_access(1, 10, Tier::kDevice, Phase::kForward, v);
  EXPECT_EQ(ids_of(h, Tier::kDevice), (Ids{3}));
  p.end_step();
  o.max_live_bytes = 15;  // not even the next one fits beside the current access
  Prefetcher q(o);
  step(q, {0, 1, 2});
  q.begin_step();
  h = q.on_access(0, 10, Tier::kDevice, Phase::kForward, v);
  EXPECT_TRUE(ids_of(h, Tier::kDevice).empty());
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{1, 2}));
  q.end_step();
}

// The NVMe look-ahead budget counts bytes that move: tensors already in memory (the view's
// in_memory) are neither hinted nor counted, so the look-ahead reaches the ones on NVMe behind
// them; a tensor hinted earlier keeps counting while it is ahead of the current access.
TEST(Prefetcher, NvmeLookAheadSkipsTensorsAlreadyInMemory) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 0;  // host look-ahead only
  o.max_live_bytes = 0;
  o.nvme_prefetch_bytes = 25;
  Prefetcher p(o);
  step(p, {0, 1, 2, 3, 4, 5, 6});
  p.begin_step();
  std::set<TensorId> memory = {1, 2, 3};  // e.g. parameters cached on the device
  ResidencyView v;
  v.in_memory = [&](TensorId id) { return memory.count(id) > 0; };
  auto h = p.on_access(0, 10, Tier::kDevice, Phase::kForward, v);
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{4, 5})) << "1-3 are in memory: 4 and 5 fill the 25 bytes";
  memory.insert({4, 5});  // the prefetches landed
  h = p.on_access(1, 10, Tier::kDevice, Phase::kForward, v);
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{})) << "4 and 5 still count: 6 does not fit yet";
  p.on_access(2, 10, Tier::kDevice, Phase::kForward, v);
  p.on_access(3, 10, Tier::kDevice, Phase::kForward, v);
  h = p.on_access(4, 10, Tier::kDevice, Phase::kForward, v);
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{6}));
  p.end_step();
  // Without the view's answer every access counts (the old rule): only 1 and 2 fit.
  Prefetcher q(o);
  step(q, {0, 1, 2, 3, 4, 5, 6});
  q.begin_step();
  h = q.on_access(0, 10, Tier::kDevice, Phase::kForward, ResidencyView{});
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{1, 2}));
  q.end_step();
}

// Four optimizer sub-groups of 100 bytes stepped in a cycle through a host pool with room for
// three: Belady's MIN misses once per sub-group it evicted, and in steady state it evicts, at the
// misses of 1 and 3, the sub-groups 3 and 1 (the resident one used furthest ahead, the one just
// stepped being pinned). The plan writes those two behind at release, and reads ahead only into
// room it has free until the use: 121 bytes at every point of the cycle (the pool's 321 less
// three resident, plus the one written behind), so one read-ahead at a time.
TEST(Prefetcher, HostPlanWritesBehindBeladysVictimsAndReadsAheadOnlyIntoPlannedRoom) {
  auto run = [](bool plan) {
    PrefetcherOptions o;
    o.prefetch_bucket_bytes = 0;
    o.max_live_bytes = 0;
    o.nvme_prefetch_bytes = 1000;
    o.host_eviction_plan = plan;
    Prefetcher p(o);
    std::set<TensorId> memory = {0, 2};  // 1 and 3 are on NVMe
    ResidencyView v;
    v.budget_bytes[static_cast<int>(Tier::kHost)] = 521;  // less two of the largest: room 321
    v.in_memory = [&](TensorId id) { return memory.count(id) > 0; };
    v.home = [](TensorId) { return Tier::kNvme; };
    v.home_bytes = [](Tier) { return std::uint64_t{0}; };
    for (int s = 0; s < 2; ++s) {  // record, then replay once
      p.begin_step();
      for (TensorId id : {0u, 1u, 2u, 3u}) p.on_access(id, 100, Tier::kHost, Phase::kOptimizer, v);
      p.end_step();
    }
    p.begin_step();
    std::vector<std::vector<TensorId>> hints;
    std::vector<bool> keep;
    for (TensorId id : {0u, 1u, 2u, 3u}) {
      hints.push_back(ids_of(p.on_access(id, 100, Tier::kHost, Phase::kOptimizer, v), Tier::kHost));
      memory.insert(id);
      keep.push_back(p.keep_on_release(id, Tier::kHost, v));
    }
    p.end_step();
    return std::make_tuple(hints, keep, p.stats());
  };
  auto [hints, keep, stats] = run(true);
  EXPECT_EQ(keep, (std::vector<bool>{true, false, true, false})) << "1 and 3 leave at release";
  EXPECT_EQ(stats.write_behinds, 2u);
  EXPECT_EQ(hints[0], (Ids{1})) << "room for one read-ahead: the nearer use first";
  EXPECT_EQ(hints[1], (Ids{3})) << "1's read-ahead room is free again once 1 is in use";
  EXPECT_GE(stats.host_hints_deferred, 1u);
  auto [free_hints, free_keep, free_stats] = run(false);
  EXPECT_EQ(free_keep, (std::vector<bool>{true, true, true, true})) << "no plan: evict on demand";
  EXPECT_EQ(free_hints[0], (Ids{1, 3})) << "no plan: every read-ahead at once";
  EXPECT_EQ(free_stats.write_behinds, 0u);
}

// One host-tier tensor over a quarter of the room (fp32_single_copy's master of gpt2's embedding,
// 154 MB, read whole by the optimizer against a 256 MiB budget) stays out of the plan's margin:
// with it, the margin (two of the largest) would be the whole room and there would be no plan, so
// every victim would be written back on demand, on the path of the read that needs its room.
TEST(Prefetcher, HostPlanSurvivesOneTensorLargerThanAQuarterOfTheRoom) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 0;
  o.max_live_bytes = 0;
  o.nvme_prefetch_bytes = 1000;
  Prefetcher p(o);
  std::set<TensorId> memory;
  ResidencyView v;
  v.budget_bytes[static_cast<int>(Tier::kHost)] = 1000;  // margin 200 (two of 100), not 1000 (two of 500)
  v.in_memory = [&](TensorId id) { return memory.count(id) > 0; };
  v.home = [](TensorId) { return Tier::kNvme; };
  v.home_bytes = [](Tier) { return std::uint64_t{0}; };
  auto bytes = [](TensorId id) { return id == 4 ? std::uint64_t{500} : std::uint64_t{100}; };
  for (int s = 0; s < 3; ++s) {  // record, then replay twice
    p.begin_step();
    for (TensorId id : {4u, 0u, 1u, 2u, 3u}) {
      p.on_access(id, bytes(id), Tier::kHost, Phase::kOptimizer, v);
      memory.insert(id);
      if (!p.keep_on_release(id, Tier::kHost, v)) memory.erase(id);
    }
    p.end_step();
  }
  // 900 bytes a step in 800 of planned room: Belady's victims leave at release.
  EXPECT_GT(p.stats().write_behinds, 0u);
  EXPECT_LT(memory.size(), 5u);
}

// A gradient partition's first write of a step (TensorStore::touch with overwrite) needs room,
// not a read: it is recorded as such and never read ahead, even while it is not in memory.
TEST(Prefetcher, OverwriteAccessesAreNeverReadAhead) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 0;
  o.max_live_bytes = 0;
  o.nvme_prefetch_bytes = 1000;
  Prefetcher p(o);
  ResidencyView v;
  v.budget_bytes[static_cast<int>(Tier::kHost)] = 1 << 20;
  v.in_memory = [](TensorId) { return false; };
  auto access = [&](TensorId id, bool overwrite) {
    ResidencyView w = v;
    w.overwrite = overwrite;
    return ids_of(p.on_access(id, 10, Tier::kHost, overwrite ? Phase::kBackward : Phase::kOptimizer, w),
                  Tier::kHost);
  };
  for (int s = 0; s < 2; ++s) {
    p.begin_step();
    access(0, false);
    access(5, true);  // the gradient is written here...
    access(5, false);  // ...and read here
    access(1, false);
    p.end_step();
  }
  p.begin_step();
  auto h = access(0, false);
  EXPECT_EQ(h, (Ids{5, 1})) << "the read of 5 is read ahead, its overwrite is not";
  access(5, true);
  access(5, false);
  access(1, false);
  p.end_step();
  EXPECT_TRUE(p.using_trace() || p.trace().has_trace());
  EXPECT_EQ(p.trace().invalidations(), 0u);
}

TEST(Prefetcher, LookAheadWrapsIntoTheNextStep) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 20;
  o.nvme_prefetch_bytes = 0;  // device only
  Prefetcher p(o);
  const Ids order = {0, 1, 2, 3};
  step(p, order);
  auto h2 = step(p, order);
  EXPECT_EQ(ids_of(h2[1], Tier::kDevice), (Ids{3}));
  EXPECT_EQ(ids_of(h2[2], Tier::kDevice), (Ids{0}));  // the next step's first access
  EXPECT_EQ(ids_of(h2[3], Tier::kDevice), (Ids{1}));
  auto h3 = step(p, order);
  EXPECT_EQ(ids_of(h3[0], Tier::kDevice), (Ids{2}));  // 1 was hinted last step already
  EXPECT_EQ(p.trace().replayed_steps(), 2u);
}

TEST(Prefetcher, KeepsOnReleaseByReuseDistanceInBytes) {
  PrefetcherOptions o;
  o.max_reuse_distance_bytes = 25;
  o.cache_beyond_reuse_distance = false;  // DeepSpeed's strict release
  Prefetcher p(o);
  // 0 1 2 0 3 4 5 6 1: after its first access 0 is reused past 1 and 2 (20 bytes): keep.
  // 1 is reused after 2 0 3 4 5 6 (60 bytes): drop.
  const Ids order = {0, 1, 2, 0, 3, 4, 5, 6, 1};
  step(p, order);
  p.begin_step();
  p.on_access(0, 10, Tier::kDevice, Phase::kForward, empty_view());
  EXPECT_TRUE(p.keep_on_release(0, Tier::kDevice, empty_view()));
  p.on_access(1, 10, Tier::kDevice, Phase::kForward, empty_view());
  EXPECT_FALSE(p.keep_on_release(1, Tier::kDevice, empty_view()));
  EXPECT_FALSE(p.keep_on_release(99, Tier::kDevice, empty_view()));  // not in the trace
  EXPECT_EQ(p.accesses_until_next_use(0), 2u);
  EXPECT_EQ(p.accesses_until_next_use(1), 7u);
  EXPECT_EQ(p.accesses_until_next_use(99), kNoNextUse);
  p.end_step();

  o.cache_beyond_reuse_distance = true;  // the default: cache it, Belady evicts it first
  Prefetcher q(o);
  step(q, order);
  q.begin_step();
  q.on_access(0, 10, Tier::kDevice, Phase::kForward, empty_view());
  q.on_access(1, 10, Tier::kDevice, Phase::kForward, empty_view());
  EXPECT_TRUE(q.keep_on_release(1, Tier::kDevice, empty_view()));
  EXPECT_EQ(q.stats().dropped, 0u);
  q.end_step();
}

TEST(Prefetcher, VictimIsFurthestNextUseAndUnknownTensorsGoFirst) {
  Prefetcher p;
  const Ids order = {0, 1, 2, 3, 1, 0, 2};
  step(p, order);
  p.begin_step();
  p.on_access(0, 10, Tier::kDevice, Phase::kForward, empty_view());
  p.on_access(1, 10, Tier::kDevice, Phase::kForward, empty_view());
  // At position 1: next uses 0 -> 5, 1 -> 4, 2 -> 2, 3 -> 3.
  const TensorId c1[] = {1, 2, 3, 0};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, c1), 0u);
  const TensorId c2[] = {2, 3};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, c2), 3u);
  const TensorId c3[] = {2, 42, 0};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, c3), 42u);
  EXPECT_EQ(p.stats().belady_victims, 3u);
  p.end_step();
}

// A loop over more tensors than the cache holds: under MIN a prefetch may evict nothing that is used
// again before the loop comes back round, so here it evicts nothing; the aggressive rule lets it
// evict a tensor used after the prefetched one, never one used before it.
TEST(Prefetcher, AggressivePrefetchEvictsOnlyWhatIsUsedAfterThePrefetchedTensor) {
  for (bool aggressive : {false, true}) {
    SCOPED_TRACE(aggressive ? "aggressive" : "min");
    PrefetcherOptions o;
    o.aggressive_prefetch = aggressive;
    EXPECT_EQ(PrefetcherOptions{}.aggressive_prefetch, false);  // MIN unless asked
    Prefetcher p(o);
    step(p, {0, 1, 2, 3, 4, 5});  // records
    p.begin_step();
    p.on_access(0, 10, Tier::kDevice, Phase::kForward, empty_view());
    p.on_access(1, 10, Tier::kDevice, Phase::kForward, empty_view());
    // At position 1, prefetching 3 (used at 3): 0 is used next at 6, 4 at 4, 2 at 2; 1 and 2,
    // accessed before 3, are used again at 7 and 8, so MIN's horizon is 8.
    EXPECT_EQ(p.evict_for_prefetch(Tier::kDevice, 3, 0), aggressive);
    EXPECT_EQ(p.evict_for_prefetch(Tier::kDevice, 3, 4), aggressive);
    EXPECT_FALSE(p.evict_for_prefetch(Tier::kDevice, 3, 2));  // needed before 3
    EXPECT_FALSE(p.evict_for_prefetch(Tier::kDevice, 42, 0));  // not in the trace: never prefetched
    EXPECT_EQ(p.stats().aggressive_evictions, aggressive ? 2u : 0u);
    EXPECT_EQ(p.stats().prefetches_refused, aggressive ? 1u : 3u);
    p.end_step();
  }
  Config c;
  EXPECT_FALSE(PrefetcherOptions::from_config(c, DType::kBF16).aggressive_prefetch);  // "auto", training
  c.tiermem.prefetch_eviction = "aggressive";
  EXPECT_TRUE(PrefetcherOptions::from_config(c, DType::kBF16).aggressive_prefetch);
}

// ---- Belady against a brute-force optimum -----------------------------------------------------

// Minimum misses of demand paging `t` from position i with cache `cache` of `cap` equal-sized
// slots, over every choice of victim (exhaustive).
int brute_force(const Ids& t, std::size_t i, std::set<TensorId> cache, std::size_t cap) {
  if (i == t.size()) return 0;
  if (cache.count(t[i])) return brute_force(t, i + 1, cache, cap);
  if (cache.size() < cap) {
    cache.insert(t[i]);
    return 1 + brute_force(t, i + 1, cache, cap);
  }
  int best = 1 << 30;
  for (TensorId v : cache) {
    auto next = cache;
    next.erase(v);
    next.insert(t[i]);
    best = std::min(best, 1 + brute_force(t, i + 1, next, cap));
  }
  return best;
}

// Misses of demand paging `t` (one step, empty cache) with the Prefetcher choosing victims.
int with_prefetcher(Prefetcher& p, const Ids& t, std::size_t cap) {
  std::set<TensorId> cache;
  int misses = 0;
  p.begin_step();
  for (TensorId id : t) {
    p.on_access(id, 1, Tier::kDevice, Phase::kForward, empty_view());
    if (cache.count(id)) continue;
    ++misses;
    if (cache.size() == cap) {
      std::vector<TensorId> cand(cache.begin(), cache.end());
      std::shuffle(cand.begin(), cand.end(), std::mt19937(id));  // order must not matter
      const TensorId v = p.choose_victim(Tier::kDevice, cand);
      EXPECT_TRUE(cache.count(v)) << "victim not a candidate";
      cache.erase(v);
    }
    cache.insert(id);
  }
  p.end_step();
  return misses;
}

TEST(Prefetcher, BeladyEqualsBruteForceOptimumOnTinyTraces) {
  std::mt19937_64 rng(7);
  int nontrivial = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const std::size_t n = 3 + rng() % 10;
    const TensorId tensors = 2 + rng() % 5;
    const std::size_t cap = 1 + rng() % 3;
    Ids t(n);
    for (auto& id : t) id = static_cast<TensorId>(rng() % tensors);
    Prefetcher p;
    with_prefetcher(p, t, cap);  // step 1 records (LRU)
    ASSERT_TRUE(p.trace().has_trace());
    const int ours = with_prefetcher(p, t, cap);  // step 2 replays: Belady
    ASSERT_TRUE(p.trace().has_trace());
    const int best = brute_force(t, 0, {}, cap);
    ASSERT_EQ(ours, best) << "iter " << iter;
    const int lru = [&] {
      Prefetcher fresh;  // a fresh one never has a trace in its first step: LRU
      return with_prefetcher(fresh, t, cap);
    }();
    ASSERT_LE(ours, lru);
    if (lru > best) ++nontrivial;
  }
  EXPECT_GT(nontrivial, 100);  // the comparison is meaningful: LRU is often worse
}

// ---- invalidation -------------------------------------------------------------------------------

// Accesses outside the step (checkpoint save/load, evaluation between steps) are neither recorded
// nor matched: a replayed step with such accesses in the middle keeps its trace and its hints.
TEST(Prefetcher, OutsideStepAccessesNeitherRecordNorDiverge) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 10;
  Prefetcher p(o);
  p.begin_step();
  EXPECT_TRUE(p.on_access(7, 10, Tier::kHost, Phase::kOutsideStep, empty_view()).empty());
  for (TensorId id : {1u, 2u, 3u}) p.on_access(id, 10, Tier::kDevice, Phase::kForward, empty_view());
  p.end_step();
  p.begin_step();
  EXPECT_TRUE(p.using_trace());
  const auto h1 = p.on_access(1, 10, Tier::kDevice, Phase::kForward, empty_view());
  EXPECT_EQ(ids_of(h1, Tier::kDevice), Ids{2});
  EXPECT_TRUE(p.on_access(9, 10, Tier::kHost, Phase::kOutsideStep, empty_view()).empty());
  EXPECT_TRUE(p.on_access(1, 10, Tier::kHost, Phase::kOutsideStep, empty_view()).empty());
  const auto h2 = p.on_access(2, 10, Tier::kDevice, Phase::kForward, empty_view());
  EXPECT_TRUE(p.using_trace()) << "an outside-step access made the trace diverge";
  EXPECT_EQ(ids_of(h2, Tier::kDevice), Ids{3});
  p.on_access(3, 10, Tier::kDevice, Phase::kForward, empty_view());
  p.end_step();
  // Control: the same extra access as a step access does make it diverge.
  p.begin_step();
  p.on_access(1, 10, Tier::kDevice, Phase::kForward, empty_view());
  p.on_access(9, 10, Tier::kDevice, Phase::kForward, empty_view());
  EXPECT_FALSE(p.using_trace());
  p.end_step();
}

TEST(Prefetcher, ChangedOrderReRecordsAndNeverUsesAStaleTrace) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 10;  // one tensor ahead
  o.nvme_prefetch_bytes = 0;
  o.prefetch_across_steps = false;
  Prefetcher p(o);
  step(p, {0, 1, 2, 3});
  auto h = step(p, {0, 1, 2, 3});
  EXPECT_EQ(ids_of(h[0], Tier::kDevice), (Ids{1}));

  // The order changes in the middle of a step.
  p.begin_step();
  EXPECT_EQ(ids_of(p.on_access(0, 10, Tier::kDevice, Phase::kForward, empty_view()), Tier::kDevice),
            (Ids{1}));
  EXPECT_TRUE(p.on_access(3, 10, Tier::kDevice, Phase::kForward, empty_view()).empty());
  EXPECT_EQ(p.trace().invalidations(), 1u);
  EXPECT_FALSE(p.using_trace());
  // Decisions fall back to LRU at once: the old trace would evict 0 (next use furthest).
  const TensorId cand[] = {0, 2};
  const auto belady_before = p.stats().belady_victims;
  EXPECT_EQ(p.choose_victim(Tier::kDevice, cand), 2u);  // LRU: 2 was used last step, 0 just now
  EXPECT_EQ(p.stats().belady_victims, belady_before);
  EXPECT_EQ(p.accesses_until_next_use(0), kNoNextUse);
  EXPECT_TRUE(p.keep_on_release(3, Tier::kDevice, empty_view()));
  EXPECT_TRUE(p.on_access(2, 10, Tier::kDevice, Phase::kForward, empty_view()).empty());
  EXPECT_TRUE(p.on_access(1, 10, Tier::kDevice, Phase::kForward, empty_view()).empty());
  p.end_step();

  // Next step records the new order (no hints), the one after replays it.
  auto rec = step(p, {0, 3, 2, 1});
  for (auto& x : rec) EXPECT_TRUE(x.empty());
  auto rep = step(p, {0, 3, 2, 1});
  EXPECT_EQ(ids_of(rep[0], Tier::kDevice), (Ids{3}));
  EXPECT_EQ(ids_of(rep[1], Tier::kDevice), (Ids{2}));
  EXPECT_EQ(ids_of(rep[2], Tier::kDevice), (Ids{1}));
  EXPECT_EQ(p.trace().invalidations(), 1u);

  // Victims follow the new trace: at position 0, next uses 3 -> 1, 2 -> 2, 1 -> 3.
  p.begin_step();
  p.on_access(0, 10, Tier::kDevice, Phase::kForward, empty_view());
  const TensorId c2[] = {3, 1, 2};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, c2), 1u);
  EXPECT_EQ(p.accesses_until_next_use(3), 1u);
  p.end_step();  // ends early: a divergence again
  EXPECT_EQ(p.trace().invalidations(), 2u);
  EXPECT_FALSE(p.trace().has_trace());
}

// rerecord(): the engine's first step with its updates moved into forward. That step records the
// new order afresh, and meanwhile reads ahead along the old one's forward and backward accesses
// (the parameters' order, which did not move), skipping the optimizer's accesses where they now
// fall; the step after replays the new recording.
TEST(Prefetcher, RerecordReadsAheadAlongTheOldOrderWhileItRecords) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 20;  // two tensors ahead to the device
  o.nvme_prefetch_bytes = 30;    // three ahead from NVMe
  o.prefetch_across_steps = false;
  Prefetcher p(o);
  auto access = [&](TensorId id, Phase phase) { return p.on_access(id, 10, Tier::kDevice, phase, empty_view()); };
  // The first step: forward 0..3, backward 3..0, the optimizer's 100 and 101 at the end.
  p.begin_step();
  for (TensorId id : {0u, 1u, 2u, 3u}) access(id, Phase::kForward);
  for (TensorId id : {3u, 2u, 1u, 0u}) access(id, Phase::kBackward);
  for (TensorId id : {100u, 101u}) access(id, Phase::kOptimizer);
  p.end_step();
  p.rerecord();
  EXPECT_FALSE(p.trace().has_trace());
  // The second: the updates run in forward now (100 before 0, 101 before 2).
  p.begin_step();
  EXPECT_TRUE(p.using_hint());
  auto h = access(100, Phase::kOptimizer);  // the hint's position stays at 0: forward's 0 is next
  EXPECT_EQ(ids_of(h, Tier::kDevice), (Ids{0, 1}));
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{0, 1, 2}));
  h = access(0, Phase::kForward);
  EXPECT_EQ(ids_of(h, Tier::kDevice), (Ids{2}));
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{3}));
  h = access(1, Phase::kForward);
  EXPECT_EQ(ids_of(h, Tier::kDevice), (Ids{3}));
  EXPECT_EQ(ids_of(h, Tier::kHost), (Ids{3})) << "forward's 3 then backward's 3: each position once";
  EXPECT_TRUE(access(101, Phase::kOptimizer).empty());
  h = access(2, Phase::kForward);
  EXPECT_EQ(ids_of(h, Tier::kDevice), (Ids{3})) << "backward's 3";
  EXPECT_FALSE(p.using_trace());
  // Victims by the hint's next uses (from position 3, forward's 3): 0 is used last, 100 never.
  const TensorId cand[] = {1, 0, 2};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, cand), 0u);
  const TensorId cand2[] = {1, 100, 0};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, cand2), 100u);
  // A read-ahead pushes out only what MIN would push out before its use (as in a replay).
  EXPECT_TRUE(p.evict_for_prefetch(Tier::kDevice, 3, 0)) << "0 is used after every next use until forward's 3";
  EXPECT_FALSE(p.evict_for_prefetch(Tier::kDevice, 2, 0))
      << "0 is used after backward's 2, but backward's 3 comes first and 3 is used again only next step: "
         "MIN would push out 3";
  EXPECT_FALSE(p.evict_for_prefetch(Tier::kDevice, 0, 3)) << "3 is used before backward's 0";
  for (TensorId id : {3u}) access(id, Phase::kForward);
  for (TensorId id : {3u, 2u, 1u, 0u}) access(id, Phase::kBackward);
  p.end_step();
  EXPECT_FALSE(p.using_hint());
  EXPECT_EQ(p.stats().hints_dropped, 0u);
  // Device + host hints per access: 100 2 + 3, 0 1 + 1, 1 1 + 1, 2 1 + 0, forward's 3 1 + 1,
  // backward's 3 1 + 1, backward's 2 1 + 0.
  EXPECT_EQ(p.stats().hints_recording, 15u);
  TensorStoreStats st;
  p.add_stats(st);
  EXPECT_EQ(st.prefetch_hints_recording, 15u);
  EXPECT_EQ(st.prefetch_hints, p.stats().device_hints + p.stats().host_hints);
  // The third replays the second's recording (10 accesses), the updates in forward.
  p.begin_step();
  EXPECT_EQ(ids_of(access(100, Phase::kOptimizer), Tier::kDevice), (Ids{0, 1}));
  EXPECT_TRUE(p.using_trace());
  EXPECT_EQ(p.trace().accesses().size(), 10u);
  EXPECT_FALSE(p.using_hint());
}

// The hint serves one step and only one that follows it: an order it does not have drops it after
// kHintResync forward/backward accesses in a row (plain LRU again), forget_trace() drops it, and
// the step after the re-recorded one records nothing it did not see.
TEST(Prefetcher, HintIsDroppedWhenTheOrderDoesNotFollowIt) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 10;
  o.nvme_prefetch_bytes = 0;
  Prefetcher p(o);
  step(p, {0, 1, 2, 3});
  p.rerecord();
  p.begin_step();
  EXPECT_EQ(ids_of(p.on_access(0, 10, Tier::kDevice, Phase::kForward, empty_view()), Tier::kDevice), (Ids{1}));
  for (std::size_t i = 0; i + 1 < Prefetcher::kHintResync; ++i) {
    EXPECT_TRUE(p.on_access(static_cast<TensorId>(1000 + i), 10, Tier::kDevice, Phase::kForward, empty_view()).empty());
  }
  EXPECT_TRUE(p.using_hint());
  EXPECT_TRUE(p.on_access(999, 10, Tier::kDevice, Phase::kForward, empty_view()).empty());
  EXPECT_FALSE(p.using_hint());
  EXPECT_EQ(p.stats().hints_dropped, 1u);
  EXPECT_TRUE(p.on_access(1, 10, Tier::kDevice, Phase::kForward, empty_view()).empty()) << "no hint: no hints";
  const TensorId cand[] = {1, 0};
  const auto lru_before = p.stats().lru_victims;
  EXPECT_EQ(p.choose_victim(Tier::kDevice, cand), 0u);  // least recently used
  EXPECT_EQ(p.stats().lru_victims, lru_before + 1);
  p.end_step();

  Prefetcher q(o);
  step(q, {0, 1, 2, 3});
  q.rerecord();
  q.forget_trace();  // e.g. a checkpoint's optimizer state replaced the pending updates
  auto rec = step(q, {0, 1, 2, 3});
  for (auto& x : rec) EXPECT_TRUE(x.empty());
  EXPECT_EQ(q.stats().hints_recording, 0u);

  Prefetcher r(o);
  r.rerecord();  // no trace yet: nothing to follow
  auto first = step(r, {0, 1, 2, 3});
  for (auto& x : first) EXPECT_TRUE(x.empty());
  EXPECT_EQ(ids_of(step(r, {0, 1, 2, 3})[0], Tier::kDevice), (Ids{1}));  // replays
}

// expect_order(): the first step, with no trace yet, reads ahead along the order its caller
// expects (an engine's modules forward, then backward in reverse), skipping accesses the order
// does not have (a gradient's); once a trace is recorded the expected order is ignored.
TEST(Prefetcher, FirstStepReadsAheadAlongTheExpectedOrder) {
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = 10;  // one tensor ahead to the device
  o.nvme_prefetch_bytes = 0;
  Prefetcher p(o);
  std::vector<Access> order;
  for (TensorId id : {0u, 1u, 2u}) order.push_back({id, 10, Phase::kForward, Tier::kDevice});
  for (TensorId id : {2u, 1u, 0u}) order.push_back({id, 10, Phase::kBackward, Tier::kDevice});
  p.begin_step();
  p.expect_order(order);
  EXPECT_TRUE(p.using_hint());
  auto access = [&](TensorId id, Phase phase) {
    return ids_of(p.on_access(id, 10, Tier::kDevice, phase, empty_view()), Tier::kDevice);
  };
  EXPECT_EQ(access(0, Phase::kForward), (Ids{1}));
  EXPECT_EQ(access(1, Phase::kForward), (Ids{2}));
  EXPECT_EQ(access(2, Phase::kForward), (Ids{})) << "backward's 2 is the one in use now";
  EXPECT_EQ(access(50, Phase::kBackward), (Ids{})) << "a gradient: not in the order, the position stays";
  EXPECT_EQ(access(2, Phase::kBackward), (Ids{1}));
  EXPECT_EQ(access(1, Phase::kBackward), (Ids{0}));
  EXPECT_EQ(access(0, Phase::kBackward), (Ids{}));
  p.end_step();
  EXPECT_FALSE(p.using_hint());
  EXPECT_EQ(p.stats().hints_recording, 4u);
  // Recorded now: the expected order is ignored, the step replays its recording.
  p.expect_order(order);
  p.begin_step();
  EXPECT_FALSE(p.using_hint());
  EXPECT_TRUE(p.trace().has_trace());
  EXPECT_EQ(access(0, Phase::kForward), (Ids{1}));
  p.end_step();
}

// While the first step reads ahead along the expected order, a prefetch may push out a cached
// tensor only where MIN would before the prefetched one's use; aggressive prefetching (a
// forward-only engine's default) also allows a victim used after it, within a quarter of the
// tier's budget of bytes ahead, as a replay does.
TEST(Prefetcher, FirstStepReadAheadEvictsAsAReplayWould) {
  std::vector<Access> order;
  for (TensorId id : {0u, 1u, 2u, 3u}) order.push_back({id, 10, Phase::kForward, Tier::kDevice});
  for (TensorId id : {3u, 2u, 1u, 0u}) order.push_back({id, 10, Phase::kBackward, Tier::kDevice});
  auto first_access = [&](bool aggressive, std::uint64_t device_budget) {
    PrefetcherOptions o;
    o.aggressive_prefetch = aggressive;
    auto p = std::make_unique<Prefetcher>(o);
    p->begin_step();
    p->expect_order(order);
    ResidencyView view;
    view.budget_bytes[static_cast<int>(Tier::kDevice)] = device_budget;
    p->on_access(0, 10, Tier::kDevice, Phase::kForward, view);
    return p;
  };
  // After forward's 0: 0 is next used last (backward's 0), so MIN's horizon for any read-ahead is
  // that use; 3 (used at forward's 3) falls before it.
  auto min = first_access(false, 80);
  EXPECT_TRUE(min->evict_for_prefetch(Tier::kDevice, 1, 4)) << "4 is not in the order: never used";
  EXPECT_FALSE(min->evict_for_prefetch(Tier::kDevice, 1, 3));
  EXPECT_EQ(min->stats().prefetches_refused, 1u);
  auto wide = first_access(true, 80);  // window: 20 bytes ahead
  EXPECT_TRUE(wide->evict_for_prefetch(Tier::kDevice, 1, 3)) << "3 is used after 1, 1 is 10 bytes ahead";
  EXPECT_TRUE(wide->evict_for_prefetch(Tier::kDevice, 2, 3)) << "2 is 20 bytes ahead";
  EXPECT_FALSE(wide->evict_for_prefetch(Tier::kDevice, 3, 2)) << "2 is used before 3";
  EXPECT_EQ(wide->stats().aggressive_evictions, 2u);
  auto narrow = first_access(true, 40);  // window: 10 bytes ahead
  EXPECT_TRUE(narrow->evict_for_prefetch(Tier::kDevice, 1, 3));
  EXPECT_FALSE(narrow->evict_for_prefetch(Tier::kDevice, 2, 3)) << "2 is beyond the window";
}

}  // namespace
}  // namespace tiermem
