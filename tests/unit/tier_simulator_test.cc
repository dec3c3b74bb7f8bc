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

struct RandomCase {
  std::vector<Access> trace;
  TierModel model;
  PrefetcherOptions options;
};

// A random cyclic trace with random budgets, home tier and look-ahead options.
RandomCase random_case(std::mt19937_64& rng, bool equal_sizes) {
  RandomCase c;
  const std::size_t n = 4 + rng() % 60;
  const TensorId tensors = 2 + rng() % 20;
  std::vector<std::uint64_t> size(tensors);
  for (auto& s : size) s = equal_sizes ? 10 : 1 + rng() % 100;
  c.trace.resize(n);
  std::uint64_t biggest = 0;
  for (auto& a : c.trace) {
    a.id = static_cast<TensorId>(rng() % tensors);
    a.bytes = size[a.id];
    a.phase = rng() % 2 ? Phase::kForward : Phase::kBackward;
    biggest = std::max(biggest, a.bytes);
  }
  const std::uint64_t all = distinct_bytes(c.trace);
  c.model = small_model(std::max(biggest, all * (1 + rng() % 9) / 10),
                        std::max(2 * biggest, all * (1 + rng() % 9) / 10),
                        rng() % 2 ? Tier::kNvme : Tier::kHost);
  c.options.prefetch_bucket_bytes = 1 + rng() % 200;
  c.options.nvme_prefetch_bytes = rng() % 400;
  return c;
}

void expect_sane(const SimResult& r, const TierModel& m, int iter) {
  ASSERT_LE(r.peak_device_bytes, m.device_budget_bytes) << r.policy << " iter " << iter;
  if (m.home == Tier::kNvme) {
    ASSERT_LE(r.peak_host_bytes, m.host_budget_bytes) << r.policy << " iter " << iter;
  }
  ASSERT_GE(r.hit_rate, 0.0);
  ASSERT_LE(r.hit_rate, 1.0);
  ASSERT_GT(r.efficiency, 0.0);
  ASSERT_LE(r.efficiency, 1.0 + 1e-9) << r.policy << " iter " << iter;
  ASSERT_EQ(r.trace_invalidations, 0u);
}

// Equal-sized tensors (where Belady's MIN is optimal): with look-ahead on both tiers, Belady never
// moves more bytes than LRU, on any tier pair. Budgets always hold.
TEST(TierSimulator, BeladyMovesNoMoreBytesThanLruOnRandomEqualSizeTraces) {
  std::mt19937_64 rng(99);
  int strictly_better = 0;
  for (int iter = 0; iter < 500; ++iter) {
    auto c = random_case(rng, /*equal_sizes=*/true);
    auto lru = simulate(c.trace, c.model, SimPolicy::kLru, c.options);
    auto bel = simulate(c.trace, c.model, SimPolicy::kBelady, c.options);
    auto ds = simulate(c.trace, c.model, SimPolicy::kDeepSpeed, c.options);
    ASSERT_LE(bel.bytes_host_to_device, lru.bytes_host_to_device) << "iter " << iter;
    ASSERT_LE(bel.bytes_nvme_to_host, lru.bytes_nvme_to_host) << "iter " << iter;
    for (const auto& r : {lru, bel, ds}) expect_sane(r, c.model, iter);
    if (bel.bytes_moved < lru.bytes_moved) ++strictly_better;
  }
  EXPECT_GT(strictly_better, 100);
}

// Mixed sizes: demand-only Belady never moves more than LRU; with look-ahead it may lose a little
// on some adversarial traces (MIN is not optimal for variable sizes), but not in total.
TEST(TierSimulator, BeladyOnRandomMixedSizeTraces) {
  std::mt19937_64 rng(1234);
  std::uint64_t bel_total = 0, lru_total = 0;
  for (int iter = 0; iter < 500; ++iter) {
    auto c = random_case(rng, /*equal_sizes=*/false);
    auto lru = simulate(c.trace, c.model, SimPolicy::kLru, c.options);
    auto bel = simulate(c.trace, c.model, SimPolicy::kBelady, c.options);
    expect_sane(bel, c.model, iter);
    bel_total += bel.bytes_moved;
    lru_total += lru.bytes_moved;
    PrefetcherOptions demand_only = c.options;
    demand_only.prefetch_bucket_bytes = demand_only.nvme_prefetch_bytes = demand_only.max_live_bytes = 0;
    auto bel_demand = simulate(c.trace, c.model, SimPolicy::kBelady, demand_only);
    ASSERT_LE(bel_demand.bytes_moved, lru.bytes_moved) << "iter " << iter;
  }
  EXPECT_LT(bel_total, lru_total);
}

// Model traces with real sizes, several budgets and both homes: Belady <= LRU in bytes.
TEST(TierSimulator, BeladyMovesNoMoreBytesThanLruOnModelTraces) {
  for (const char* name : {"gpt2-small", "gpt2-medium", "gpt2-xl", "llama-7b"}) {
    auto t = generate_model_trace(name);
    const std::uint64_t all = distinct_bytes(t);
    std::uint64_t biggest = 0;
    for (const Access& a : t) biggest = std::max(biggest, a.bytes);
    for (double frac : {0.1, 0.25, 0.5}) {
      if (frac * static_cast<double>(all) < static_cast<double>(biggest)) continue;
      for (Tier home : {Tier::kNvme, Tier::kHost}) {
        TierModel m;
        m.device_budget_bytes = static_cast<std::uint64_t>(frac * static_cast<double>(all));
        m.host_budget_bytes = all / 2;
        m.home = home;
        PrefetcherOptions o;
        auto lru = simulate(t, m, SimPolicy::kLru, o);
        auto bel = simulate(t, m, SimPolicy::kBelady, o);
        EXPECT_LE(bel.bytes_moved, lru.bytes_moved) << name << " frac " << frac;
        EXPECT_LE(bel.stall_seconds, lru.stall_seconds) << name << " frac " << frac;
        expect_sane(bel, m, 0);
      }
    }
  }
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
  m.compute_gbps = 6;  // compute consumes parameters as fast as the bottleneck delivers them,
  m.backward_factor = 1;  // in both phases
  PrefetcherOptions o;
  auto lru = simulate(t, m, SimPolicy::kLru, o);
  auto ds = simulate(t, m, SimPolicy::kDeepSpeed, o);
  auto bel = simulate(t, m, SimPolicy::kBelady, o);
  EXPECT_GE(bel.efficiency, 0.95);
  EXPECT_GE(bel.efficiency, 1.2 * ds.efficiency);
  EXPECT_LE(bel.bytes_moved, lru.bytes_moved);
  EXPECT_LE(bel.stall_seconds, ds.stall_seconds);
  EXPECT_LE(bel.peak_device_bytes, m.device_budget_bytes);
  // A backward twice as long as forward leaves more slack: Belady still wins, by less.
  m.backward_factor = 2;
  EXPECT_GT(simulate(t, m, SimPolicy::kBelady, o).efficiency,
            simulate(t, m, SimPolicy::kDeepSpeed, o).efficiency);
}

}  // namespace
}  // namespace tiermem
