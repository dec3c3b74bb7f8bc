#include "tiermem/reuse_distance.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

namespace tiermem {
namespace {

// O(n²) oracle straight from the definition.
std::vector<ReuseDistance> oracle(const std::vector<Access>& t, ReuseMode mode) {
  const std::size_t n = t.size();
  std::vector<ReuseDistance> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t limit = mode == ReuseMode::kCyclic ? i + n : n - 1;
    std::map<TensorId, std::uint64_t> seen;  // tensor -> bytes of its last access in the window
    for (std::size_t j = i + 1; j <= limit; ++j) {
      const Access& a = t[j % n];
      if (a.id == t[i].id) {
        std::uint64_t bytes = 0;
        for (auto& [id, b] : seen) bytes += b;
        out[i] = {bytes, seen.size()};
        break;
      }
      seen[a.id] = a.bytes;
    }
  }
  return out;
}

std::vector<std::uint64_t> next_oracle(const std::vector<Access>& t, ReuseMode mode) {
  const std::size_t n = t.size();
  std::vector<std::uint64_t> out(n, kNoNextUse);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t limit = mode == ReuseMode::kCyclic ? i + n : n - 1;
    for (std::size_t j = i + 1; j <= limit; ++j) {
      if (t[j % n].id == t[i].id) {
        out[i] = j;
        break;
      }
    }
  }
  return out;
}

std::vector<Access> trace_of(std::initializer_list<std::pair<TensorId, std::uint64_t>> v) {
  std::vector<Access> t;
  for (auto [id, b] : v) t.push_back({id, b, Phase::kForward, Tier::kDevice});
  return t;
}

TEST(ReuseDistance, HandExample) {
  // A B C A B with bytes A=1, B=10, C=100.
  auto t = trace_of({{0, 1}, {1, 10}, {2, 100}, {0, 1}, {1, 10}});
  auto lin = reuse_distances(t, ReuseMode::kLinear);
  EXPECT_EQ(lin[0], (ReuseDistance{110, 2}));
  EXPECT_EQ(lin[1], (ReuseDistance{101, 2}));
  EXPECT_TRUE(lin[2].infinite());
  EXPECT_TRUE(lin[3].infinite());
  EXPECT_TRUE(lin[4].infinite());
  auto cyc = reuse_distances(t, ReuseMode::kCyclic);
  EXPECT_EQ(cyc[0], lin[0]);
  EXPECT_EQ(cyc[1], lin[1]);
  EXPECT_EQ(cyc[2], (ReuseDistance{11, 2}));  // C at 2 -> next C at 7: A B A B between
  EXPECT_EQ(cyc[3], (ReuseDistance{10, 1}));  // A at 3 -> A at 5: B
  EXPECT_EQ(cyc[4], (ReuseDistance{1, 1}));   // B at 4 -> B at 6: A
  auto nu = next_uses(t, ReuseMode::kCyclic);
  EXPECT_EQ(nu, (std::vector<std::uint64_t>{3, 4, 7, 5, 6}));
  auto nl = next_uses(t, ReuseMode::kLinear);
  EXPECT_EQ(nl, (std::vector<std::uint64_t>{3, 4, kNoNextUse, kNoNextUse, kNoNextUse}));
}

TEST(ReuseDistance, ImmediateReuseIsZeroAndEmptyTraceIsEmpty) {
  auto t = trace_of({{5, 8}, {5, 8}});
  EXPECT_EQ(reuse_distances(t, ReuseMode::kLinear)[0], (ReuseDistance{0, 0}));
  EXPECT_EQ(reuse_distances(t, ReuseMode::kCyclic)[1], (ReuseDistance{0, 0}));
  EXPECT_TRUE(reuse_distances({}, ReuseMode::kCyclic).empty());
  EXPECT_TRUE(next_uses({}, ReuseMode::kCyclic).empty());
}

TEST(ReuseDistance, EqualsOracleOnThousandsOfRandomTraces) {
  std::mt19937_64 rng(20240601);
  int checked = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    const std::size_t n = 1 + rng() % 64;
    const std::size_t tensors = 1 + rng() % 12;
    std::vector<Access> t(n);
    for (auto& a : t) {
      a.id = static_cast<TensorId>(rng() % tensors) * 7 + 3;  // sparse ids
      a.bytes = 1 + rng() % 1000;  // sizes may even vary between accesses of one tensor
    }
    for (ReuseMode mode : {ReuseMode::kLinear, ReuseMode::kCyclic}) {
      auto fast = reuse_distances(t, mode);
      auto slow = oracle(t, mode);
      ASSERT_EQ(fast.size(), n);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(fast[i], slow[i]) << "iter " << iter << " access " << i << " mode "
                                    << (mode == ReuseMode::kLinear ? "linear" : "cyclic");
      }
      ASSERT_EQ(next_uses(t, mode), next_oracle(t, mode)) << "iter " << iter;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 8000);
}

TEST(ReuseDistance, LongTraceMatchesOracleSample) {
  // A GPT-like cyclic trace: forward 0..L-1 then backward L-1..0.
  std::vector<Access> t;
  const TensorId layers = 300;
  for (TensorId i = 0; i < layers; ++i) t.push_back({i, 100 + i, Phase::kForward, Tier::kDevice});
  for (TensorId i = layers; i-- > 0;) t.push_back({i, 100 + i, Phase::kBackward, Tier::kDevice});
  auto fast = reuse_distances(t, ReuseMode::kCyclic);
  auto slow = oracle(t, ReuseMode::kCyclic);
  EXPECT_EQ(fast, slow);
  // Forward access of layer i: every layer above it, once, before its backward access.
  std::uint64_t above = 0;
  for (TensorId i = 1; i < layers; ++i) above += 100 + i;
  EXPECT_EQ(fast[0], (ReuseDistance{above, layers - 1}));
  // The last layer is reused immediately at the turn.
  EXPECT_EQ(fast[layers - 1], (ReuseDistance{0, 0}));
}

}  // namespace
}  // namespace tiermem
