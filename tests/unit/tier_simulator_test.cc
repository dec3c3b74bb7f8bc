#include "tiermem/tier_simulator.h"

#include <gtest/gtest.h>

#include <random>

#include "tiermem/error.h"

namespace tiermem {
namespace {

TEST(ModelTrace, RealParameterCounts) {
  // Published parameter counts (GPT-2 with tied embeddings; LLaMA from its paper/config).
  const std::pair<const char*, std::uint64_t> expected[] = {
      {"gpt2-small", 124'439'808ull},  {"gpt2-medium", 354'823'168ull},
      {"gpt2-xl", 1'557'611'200ull},   {"llama-7b", 6'738'415'616ull},
      {"llama-70b", 68'976'648'192ull},
  };
  for (auto [name, params] : expected) {
    auto t = generate_model_trace(name, DType::kBF16);
    EXPECT_EQ(distinct_bytes(t), 2 * params) << name;
    EXPECT_EQ(distinct_bytes(generate_model_trace(name, DType::kF32)), 4 * params) << name;
  }
  EXPECT_THROW(generate_model_trace("gpt5"), ConfigError);
}

TEST(ModelTrace, BackwardIsForwardReversed) {
  auto t = generate_model_trace("gpt2-small");
  ASSERT_EQ(t.size() % 2, 0u);
  const std::size_t half = t.size() / 2;
  for (std::size_t i = 0; i < half; ++i) {
    EXPECT_EQ(t[i].phase, Phase::kForward);
    EXPECT_EQ(t[t.size() - 1 - i].phase, Phase::kBackward);
    EXPECT_EQ(t[i].id, t[t.size() - 1 - i].id) << i;
  }
  EXPECT_EQ(half, 2u + 12 * 6 + 2);  // wte wpe, 6 tensors per block, ln_f, lm_head (= wte)
  EXPECT_EQ(t[0].id, t[half - 1].id);  // tied embedding
}

TEST(TraceFile, ParsesNamesSizesPhasesAndComments) {
  auto t = parse_trace("# a comment\nwte 64MiB forward\n\nh0 4096 fwd  # trailing\nwte 64MiB bwd\n",
                       "t.txt");
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].id, 0u);
  EXPECT_EQ(t[0].bytes, 64ull << 20);
  EXPECT_EQ(t[1].id, 1u);
  EXPECT_EQ(t[1].bytes, 4096u);
  EXPECT_EQ(t[2].id, 0u);
  EXPECT_EQ(t[2].phase, Phase::kBackward);
}

TEST(TraceFile, BadLinesNameFileAndLine) {
  auto expect_error = [](std::string_view text, std::string_view what) {
    try {
      parse_trace(text, "my.trace");
      FAIL() << "no error for " << text;
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key_path(), "my.trace:3") << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  const std::string ok = "a 10 forward\nb 10 backward\n";
  expect_error(ok + "c 10\n", "three fields");
  expect_error(ok + "c 10 forward extra\n", "three fields");
  expect_error(ok + "c ten forward\n", "not a size");
  expect_error(ok + "c 10 sideways\n", "sideways");
  expect_error(ok + "c 0 forward\n", "positive");
  EXPECT_THROW(parse_trace("\n# only comments\n", "empty.trace"), ConfigError);
  EXPECT_THROW(load_trace_file("/nonexistent/trace.txt"), ConfigError);
}

TierModel small_model(std::uint64_t device, std::uint64_t host, Tier home) {
  TierModel m;
  m.device_budget_bytes = device;
  m.host_budget_bytes = host;
  m.home = home;
  m.nvme_to_host_gbps = 1;
  m.host_to_device_gbps = 2;
  m.compute_gbps = 1;
  m.steps = 3;
  return m;
}

TEST(TierSimulator, EverythingFitsMovesNothingInSteadyState) {
  auto t = generate_model_trace("gpt2-small");
  const std::uint64_t all = distinct_bytes(t);
  PrefetcherOptions o;
  for (SimPolicy p : {SimPolicy::kLru, SimPolicy::kDeepSpeed, SimPolicy::kBelady}) {
    auto r = simulate(t, small_model(all, all, Tier::kNvme), p, o);
    if (p != SimPolicy::kDeepSpeed) {  // DeepSpeed drops by its reuse-distance threshold
      EXPECT_EQ(r.bytes_moved, 0u) << r.policy;
      EXPECT_DOUBLE_EQ(r.hit_rate, 1.0) << r.policy;
      EXPECT_DOUBLE_EQ(r.stall_seconds, 0.0) << r.policy;
      EXPECT_NEAR(r.efficiency, 1.0, 1e-9) << r.policy;
    }
    EXPECT_LE(r.peak_device_bytes, all);
  }
}

TEST(TierSimulator, RejectsTensorsLargerThanABudgetAndBadBandwidths) {
  auto t = parse_trace("a 100 forward\nb 10 forward\n", "t");
  PrefetcherOptions o;
  EXPECT_THROW(simulate(t, small_model(50, 1000, Tier::kNvme), SimPolicy::kLru, o), OutOfMemoryError);
  EXPECT_THROW(simulate(t, small_model(1000, 50, Tier::kNvme), SimPolicy::kLru, o), OutOfMemoryError);
  auto m = small_model(1000, 1000, Tier::kNvme);
  m.compute_gbps = 0;
  EXPECT_THROW(simulate(t, m, SimPolicy::kLru, o), ConfigError);
}

// Random cyclic traces: Belady (our Prefetcher) never moves more bytes than LRU, budgets hold.
TEST(TierSimulator, BeladyMovesNoMoreBytesThanLruOnRandomTraces) {
  std::mt19937_64 rng(99);
  int strictly_better = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const std::size_t n = 4 + rng() % 60;
    const TensorId tensors = 2 + rng() % 20;
    std::vector<std::uint64_t> size(tensors);
    for (auto& s : size) s = 1 + rng() % 100;
    std::vector<Access> t(n);
    std::uint64_t biggest = 0;
    for (auto& a : t) {
      a.id = static_cast<TensorId>(rng() % tensors);
      a.bytes = size[a.id];
      a.phase = rng() % 2 ? Phase::kForward : Phase::kBackward;
      biggest = std::max(biggest, a.bytes);
    }
    const std::uint64_t all = distinct_bytes(t);
    const std::uint64_t dev = std::max(biggest, all * (1 + rng() % 9) / 10);
    const std::uint64_t host = std::max(2 * biggest, all * (1 + rng() % 9) / 10);
    const Tier home = rng() % 2 ? Tier::kNvme : Tier::kHost;
    PrefetcherOptions o;
    o.prefetch_bucket_bytes = 1 + rng() % 200;
    o.nvme_prefetch_bytes = rng() % 400;
    o.max_reuse_distance_bytes = ~0ull; (void)(rng() % 3);
    auto m = small_model(dev, host, home);
    auto lru = simulate(t, m, SimPolicy::kLru, o);
    auto bel = simulate(t, m, SimPolicy::kBelady, o);
    auto ds = simulate(t, m, SimPolicy::kDeepSpeed, o);
    ASSERT_LE(bel.bytes_host_to_device, lru.bytes_host_to_device) << "iter " << iter;
    ASSERT_LE(bel.bytes_moved, lru.bytes_moved) << "iter " << iter;
    for (const auto& r : {lru, bel, ds}) {
      ASSERT_LE(r.peak_device_bytes, dev) << r.policy << " iter " << iter;
      if (home == Tier::kNvme) {
        ASSERT_LE(r.peak_host_bytes, host) << r.policy << " iter " << iter;
      }
      ASSERT_GE(r.hit_rate, 0.0);
      ASSERT_LE(r.hit_rate, 1.0);
      ASSERT_GT(r.efficiency, 0.0);
      ASSERT_LE(r.efficiency, 1.0 + 1e-9) << r.policy << " iter " << iter;
      ASSERT_EQ(r.trace_invalidations, 0u);
    }
    if (bel.bytes_moved < lru.bytes_moved) ++strictly_better;
  }
  EXPECT_GT(strictly_better, 50);
}

// The target, on the simulated model (deterministic; not a timing measurement).
TEST(TierSimulator, Gpt2XlQuarterBudgetBeladyBeatsDeepSpeed) {
  auto t = generate_model_trace("gpt2-xl");
  const std::uint64_t all = distinct_bytes(t);
  TierModel m;
  m.device_budget_bytes = all / 4;
  m.host_budget_bytes = all / 2;
  m.home = Tier::kNvme;
  m.nvme_to_host_gbps = 6;
  m.host_to_device_gbps = 24;
  m.compute_gbps = 6;  // compute consumes parameters as fast as the bottleneck delivers them
  PrefetcherOptions o;
  auto lru = simulate(t, m, SimPolicy::kLru, o);
  auto ds = simulate(t, m, SimPolicy::kDeepSpeed, o);
  auto bel = simulate(t, m, SimPolicy::kBelady, o);
  EXPECT_GE(bel.efficiency, 0.95);
  EXPECT_GE(bel.efficiency, 1.2 * ds.efficiency);
  EXPECT_LE(bel.bytes_moved, lru.bytes_moved);
  EXPECT_LE(bel.stall_seconds, ds.stall_seconds);
  EXPECT_LE(bel.peak_device_bytes, m.device_budget_bytes);
}

}  // namespace
}  // namespace tiermem
