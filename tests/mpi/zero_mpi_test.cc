// ZeroEngine across ranks (mpirun -np 1/2/4): the deterministic MLP trained 10 steps through
// every stage 0-3 × optimizer offload none/cpu/nvme (stage 3 also with offload_param cpu/nvme) equals the single-process fp32 reference
// within kTol; every rank ends with identical parameters; per-rank optimizer bytes scale as 1/W;
// an Inf on one rank skips the step on all ranks; each rank's exported optimizer shard, imported
// into fresh engines, continues bit for bit as an uninterrupted run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>

#include "mpi/mpi_env.h"
#include "mpi/zero_mlp.h"

namespace tiermem {
namespace {

using testing::world_comm;

// fp32 engine vs fp32 reference after 10 steps: 1e-4 absolute (parameters are ~0.1-1).
constexpr float kTol = 1e-4f;

// One directory per run, made by rank 0 and broadcast; the engine adds rank<r>/ inside it.
const std::string& nvme_base() {
  static const std::string base = [] {
    std::array<char, 256> path{};
    if (world_comm().rank() == 0) {
      std::string t = (std::filesystem::temp_directory_path() / "tiermem-zero-mpi-XXXXXX").string();
      if (mkdtemp(t.data()) == nullptr) t = "/tmp/tiermem-zero-mpi-fallback";
      std::filesystem::create_directories(t);
      std::snprintf(path.data(), path.size(), "%s", t.c_str());
    }
    world_comm().broadcast(path.data(), path.size(), DType::kU8, 0);
    return std::string(path.data());
  }();
  return base;
}

struct Case {
  int stage;
  const char* offload;         // offload_optimizer.device
  const char* param = "none";  // offload_param.device (stage 3: TensorStore + Prefetcher)
};
class ZeroMpiMatrix : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroMpiMatrix, TenStepsMatchSingleProcessReference) {
  Communicator& c = world_comm();
  const int W = c.world_size();
  const int micro = W <= 4 ? 2 : 1;  // 24 samples = W × micro × per-micro
  Config cfg = testing::with_param_offload(
      testing::mlp_config(GetParam().stage, GetParam().offload, nvme_base(), micro), GetParam().param,
      nvme_base());
  auto ref = testing::mlp_reference(cfg, 10);
  ZeroEngine engine(cfg, c);
  auto got = testing::mlp_train_engine(engine, c, 10, micro);
  for (int m = 0; m < 2; ++m) {
    ASSERT_EQ(got[m].size(), ref[m].size());
    for (std::size_t i = 0; i < ref[m].size(); ++i) {
      ASSERT_NEAR(got[m][i], ref[m][i], kTol) << "rank " << c.rank() << " module " << m << " element " << i;
    }
    // Identical on every rank: rank 0's copy broadcast and compared bit for bit.
    std::vector<float> r0 = got[m];
    c.broadcast(r0.data(), r0.size(), DType::kF32, 0);
    ASSERT_EQ(r0, got[m]) << "rank " << c.rank() << " diverged from rank 0";
  }
  // Gathered working params equal the masters.
  auto g = engine.gather(1);
  for (std::size_t i = 0; i < got[1].size(); ++i) ASSERT_EQ(g.f32()[i], got[1][i]);
}

INSTANTIATE_TEST_SUITE_P(StageOffload, ZeroMpiMatrix,
                         ::testing::Values(Case{0, "none"}, Case{1, "none"}, Case{1, "cpu"}, Case{1, "nvme"},
                                           Case{2, "none"}, Case{2, "cpu"}, Case{2, "nvme"}, Case{3, "none"},
                                           Case{3, "cpu"}, Case{3, "nvme"}, Case{3, "none", "cpu"},
                                           Case{3, "cpu", "nvme"}, Case{3, "nvme", "nvme"}),
                         [](const auto& info) {
                           std::string p = info.param.param;
                           return "stage" + std::to_string(info.param.stage) + "_" + info.param.offload +
                                  (p == "none" ? "" : "_param_" + p);
                         });

// Stage 3 on a SimDevice whose memory the CPU cannot address (the CPU twin of CudaDevice): the
// all-gathers are staged through host memory into device buffers, gradients are handed over from
// device memory, new working params go up through the copy engines. Bit for bit the run on the
// default SimDevice, on every rank and world size; gathers are device memory within the budget.
TEST(ZeroMpi, OpaqueDeviceStage3MatchesAddressableBitForBit) {
  Communicator& c = world_comm();
  const int micro = c.world_size() <= 4 ? 2 : 1;
  for (const char* param : {"none", "cpu", "nvme"}) {
    SCOPED_TRACE(param);
    // Two engines alive at once: a swap directory each.
    auto make = [&](const std::string& sub) {
      const std::string d = nvme_base() + "/" + sub;
      Config cfg = testing::with_param_offload(testing::mlp_config(3, "nvme", d, micro), param, d);
      cfg.tiermem.device = "sim";
      cfg.zero.stage3_param_persistence_threshold_elems = 0;  // both modules sharded and gathered
      cfg.gradient_clipping = 0.05;  // active: the folded norm decides every update
      return cfg;
    };
    ZeroEngine ref(make("ref"), c), eng(testing::on_opaque_device(make("opaque")), c);
    const auto want = testing::mlp_train_engine(ref, c, 6, micro);
    const auto got = testing::mlp_train_engine(eng, c, 6, micro, /*device_grads=*/true);
    for (int m = 0; m < 2; ++m) {
      ASSERT_EQ(got[m], want[m]) << "rank " << c.rank() << " module " << m;
      auto a = ref.gather(m);
      auto b = eng.gather(m);
      EXPECT_EQ(b.on_device(), true);
      EXPECT_EQ(testing::to_f32_host(ref, a), testing::to_f32_host(eng, b)) << "rank " << c.rank() << " params " << m;
    }
    ASSERT_NE(eng.device(), nullptr);
    EXPECT_FALSE(eng.device()->host_addressable());
    const ZeroStats s = eng.stats();
    EXPECT_LE(s.device_peak_bytes, s.device_budget_bytes);
  }
}

// Stage 3 with every module sharded: all-gathers started ahead (prefetch_gather, async on the
// communicator) give bit for bit the blocking gathers' run; one no gather takes is dropped at
// step(). With several ranks the prefetched ones are counted; with one there is nothing to start.
TEST(ZeroMpi, PrefetchedGathersMatchBlockingOnesBitForBit) {
  Communicator& c = world_comm();
  const int micro = c.world_size() <= 4 ? 2 : 1;
  for (const char* param : {"none", "nvme"}) {
    SCOPED_TRACE(param);
    auto make = [&](const std::string& sub) {
      const std::string d = nvme_base() + "/" + sub + "_" + param;
      Config cfg = testing::with_param_offload(testing::mlp_config(3, "nvme", d, micro), param, d);
      cfg.zero.stage3_param_persistence_threshold_elems = 0;  // both modules sharded and gathered
      return cfg;
    };
    ZeroEngine ref(make("blocking"), c), eng(make("prefetched"), c);
    const auto want = testing::mlp_train_engine(ref, c, 6, micro);
    const auto got = testing::mlp_train_engine(eng, c, 6, micro, /*device_grads=*/false, /*prefetch=*/true);
    for (int m = 0; m < 2; ++m) ASSERT_EQ(got[m], want[m]) << "rank " << c.rank() << " module " << m;
    const ZeroStats s = eng.stats();
    if (c.world_size() > 1) {
      EXPECT_EQ(s.all_gathers_prefetched, static_cast<std::uint64_t>(6 * (micro + 1)));
      EXPECT_EQ(s.all_gather_calls, ref.stats().all_gather_calls + 6);  // one untaken a step
    } else {
      EXPECT_EQ(s.all_gathers_prefetched, 0u);
    }
    auto a = ref.gather(1);
    auto b = eng.gather(1);
    EXPECT_EQ(testing::to_f32_host(ref, a), testing::to_f32_host(eng, b));
  }
}

// With gradient clipping, stages 2-3 fold the norm into accumulation (ranks whose shard of a
// module is all padding contribute nothing); stage 1 computes it in step()'s pre-pass. Same run
// within the matrix's tolerance at every world size; clipping at 0.05 is active.
TEST(ZeroMpi, FoldedClippingNormMatchesStageOne) {
  Communicator& c = world_comm();
  const int W = c.world_size();
  const int micro = W <= 4 ? 2 : 1;
  const std::string clip = R"(, "gradient_clipping": 0.05)";
  auto train = [&](int stage, const std::string& offload, const std::string& param, const std::string& extra) {
    Config cfg = testing::with_param_offload(testing::mlp_config(stage, offload, nvme_base(), micro, extra),
                                             param, nvme_base());
    ZeroEngine engine(cfg, c);
    return testing::mlp_train_engine(engine, c, 6, micro);
  };
  const auto ref = train(1, "none", "none", clip);
  const auto s2 = train(2, "nvme", "none", clip);
  const auto s3 = train(3, "nvme", "nvme", clip);
  const auto unclipped = train(1, "none", "none", "");
  float moved = 0;
  for (int m = 0; m < 2; ++m) {
    for (std::size_t i = 0; i < ref[m].size(); ++i) {
      ASSERT_NEAR(s2[m][i], ref[m][i], 1e-6f) << "stage 2, rank " << c.rank() << " module " << m << " element " << i;
      ASSERT_NEAR(s3[m][i], ref[m][i], 1e-6f) << "stage 3, rank " << c.rank() << " module " << m << " element " << i;
      moved = std::max(moved, std::abs(unclipped[m][i] - ref[m][i]));
    }
  }
  EXPECT_GT(moved, 1e-4f) << "clipping at 0.05 should change the run";
}

TEST(ZeroMpi, OptimizerBytesScaleAsOneOverWorld) {
  Communicator& c = world_comm();
  const std::size_t W = static_cast<std::size_t>(c.world_size());
  for (int stage : {1, 2, 3}) {
    Config cfg = testing::mlp_config(stage, "cpu", "", 1);
    cfg.tiermem.host_budget_bytes = 64 << 20;  // the state (16 B per element) is homed there
    ZeroEngine engine(cfg, c);
    const std::size_t n = 1 << 20;
    std::vector<float> big(n, 0.25f);
    engine.register_module("big", big);
    engine.step();
    const std::uint64_t bytes = engine.stats().optimizer_state_bytes;
    const std::size_t shard = (n + W * 1024 - 1) / (W * 1024) * 1024;
    EXPECT_EQ(bytes, 12u * shard) << "stage " << stage;
    EXPECT_LE(bytes * W, 12u * (n + W * 1024)) << "stage " << stage;  // 1/W up to padding
  }
  // Stage 0 keeps everything on every rank.
  Config cfg0 = testing::mlp_config(0, "none", "", 1);
  ZeroEngine e0(cfg0, c);
  std::vector<float> big(1 << 20, 0.25f);
  e0.register_module("big", big);
  e0.step();
  EXPECT_EQ(e0.stats().optimizer_state_bytes, 12u * (1u << 20));
}

TEST(ZeroMpi, InfOnOneRankSkipsTheStepEverywhere) {
  Communicator& c = world_comm();
  Config cfg = testing::mlp_config(2, "none", "", 1,
                                   R"(, "fp16": {"enabled": true, "initial_scale_power": 8, "hysteresis": 1})");
  ZeroEngine engine(cfg, c);
  auto init = testing::mlp_init();
  engine.register_module("fc1", init[0]);
  engine.register_module("fc2", init[1]);
  std::vector<float> g0(init[0].size(), 1.0f), g1(init[1].size(), 1.0f);
  if (c.rank() == c.world_size() - 1) g0[100] = std::numeric_limits<float>::infinity();
  engine.reduce_gradients(1, g1);
  engine.reduce_gradients(0, g0);
  auto r = engine.step();
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(engine.loss_scale(), 128.0);
  EXPECT_EQ(engine.export_master(0), init[0]);
}

// Per-rank checkpoint of the optimizer shard: every rank exports its own shard after K steps, a
// fresh engine per rank (its own swap directories) imports it and runs M more steps; masters and
// moments equal, bit for bit, an uninterrupted K + M run on every rank.
class ZeroMpiResume : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroMpiResume, PerRankShardResumesBitForBit) {
  Communicator& c = world_comm();
  const int W = c.world_size();
  const int micro = W <= 4 ? 2 : 1;
  constexpr int kFirst = 3, kThen = 3;
  auto config = [&](const std::string& sub) {
    const std::string d = nvme_base() + "/resume-" + sub;
    return testing::with_param_offload(testing::mlp_config(GetParam().stage, GetParam().offload, d, micro),
                                       GetParam().param, d);
  };
  ZeroEngine ref(config("ref"), c);
  const auto want = testing::mlp_train_engine(ref, c, kFirst + kThen, micro);
  const ZeroOptimizerState want_state = ref.export_optimizer_state();

  ZeroOptimizerState saved;
  {
    ZeroEngine first(config("first"), c);
    testing::mlp_train_engine(first, c, kFirst, micro);
    saved = first.export_optimizer_state();
  }
  EXPECT_EQ(saved.world_size, W);
  EXPECT_EQ(saved.rank, c.rank());
  EXPECT_EQ(saved.steps, kFirst);
  ZeroEngine second(config("second"), c);
  auto init = testing::mlp_init();
  for (auto& m : init)
    for (auto& x : m) x = 0.5f * x;  // a different init: the import must replace it on every rank
  second.register_module("fc1", init[0]);
  second.register_module("fc2", init[1]);
  second.import_optimizer_state(saved);
  testing::mlp_train_steps(second, c, kThen, micro);
  for (int m = 0; m < 2; ++m) {
    const std::vector<float> got = second.export_master(m);
    ASSERT_EQ(got.size(), want[m].size());
    EXPECT_EQ(std::memcmp(got.data(), want[m].data(), got.size() * sizeof(float)), 0)
        << "rank " << c.rank() << " module " << m;
  }
  const ZeroOptimizerState got_state = second.export_optimizer_state();
  EXPECT_EQ(got_state.exp_avg, want_state.exp_avg) << "rank " << c.rank();
  EXPECT_EQ(got_state.exp_avg_sq, want_state.exp_avg_sq) << "rank " << c.rank();
  EXPECT_EQ(second.stats().steps, kFirst + kThen);
  auto a = ref.gather(0);
  auto b = second.gather(0);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.numel() * sizeof(float)), 0) << "rank " << c.rank();
}

INSTANTIATE_TEST_SUITE_P(StageOffload, ZeroMpiResume,
                         ::testing::Values(Case{1, "none"}, Case{1, "nvme"}, Case{2, "cpu"}, Case{3, "none"},
                                           Case{3, "nvme"}, Case{3, "nvme", "nvme"}),
                         [](const auto& info) {
                           std::string p = info.param.param;
                           return "stage" + std::to_string(info.param.stage) + "_" + info.param.offload +
                                  (p == "none" ? "" : "_param_" + p);
                         });

// The device-resident optimizer (offload_optimizer none, tiermem.device_optimizer on) on every
// rank: stages 1-3 × fp32/bf16 × an addressable SimDevice and its PROT_NONE twin give, bit for
// bit, every rank's masters, working params and optimizer shard of the host optimizer (off); each
// rank's exported shard imported into fresh engines continues bit for bit.
struct DevOptCase {
  int stage;
  bool bf16;
  bool addressable;
};
class ZeroMpiDeviceOptimizer : public ::testing::TestWithParam<DevOptCase> {};

TEST_P(ZeroMpiDeviceOptimizer, EqualsTheHostOptimizerOnEveryRank) {
  Communicator& c = world_comm();
  const int W = c.world_size();
  const int micro = W <= 4 ? 2 : 1;
  const DevOptCase dc = GetParam();
  auto make = [&](const char* mode) {
    Config cfg = testing::mlp_config(dc.stage, "none", nvme_base(), micro);
    cfg.tiermem.device = "sim";
    cfg.tiermem.sim_host_addressable = dc.addressable;
    cfg.tiermem.device_budget_bytes = 8 << 20;
    cfg.tiermem.device_optimizer = mode;
    cfg.bf16 = dc.bf16;
    return cfg;
  };
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  ZeroEngine host(make("off"), c), dev(make("on"), c);
  const auto want = testing::mlp_train_engine(host, c, 6, micro);
  const auto got = testing::mlp_train_engine(dev, c, 6, micro);
  EXPECT_EQ(dev.stats().optimizer_home, Tier::kDevice);
  for (int m = 0; m < 2; ++m) {
    EXPECT_TRUE(same(got[m], want[m])) << "rank " << c.rank() << " master " << m;
    auto a = host.gather(m);
    auto b = dev.gather(m);
    EXPECT_TRUE(same(testing::to_f32_host(host, a), testing::to_f32_host(dev, b)))
        << "rank " << c.rank() << " working params " << m;
  }
  const ZeroOptimizerState hs = host.export_optimizer_state(), saved = dev.export_optimizer_state();
  EXPECT_TRUE(same(saved.master, hs.master)) << "rank " << c.rank();
  EXPECT_TRUE(same(saved.exp_avg_sq, hs.exp_avg_sq)) << "rank " << c.rank();
  ZeroEngine resumed(make("on"), c);
  auto init = testing::mlp_init();
  for (auto& v : init) std::fill(v.begin(), v.end(), 0.0f);
  resumed.register_module("fc1", init[0]);
  resumed.register_module("fc2", init[1]);
  resumed.import_optimizer_state(saved);
  testing::mlp_train_steps(resumed, c, 3, micro);
  testing::mlp_train_steps(host, c, 3, micro);
  for (int m = 0; m < 2; ++m) {
    EXPECT_TRUE(same(resumed.export_master(m), host.export_master(m))) << "rank " << c.rank() << " resumed " << m;
  }
}

INSTANTIATE_TEST_SUITE_P(StageDtypeDevice, ZeroMpiDeviceOptimizer,
                         ::testing::Values(DevOptCase{1, false, true}, DevOptCase{2, true, true},
                                           DevOptCase{3, false, true}, DevOptCase{3, true, true},
                                           DevOptCase{1, true, false}, DevOptCase{2, false, false},
                                           DevOptCase{3, true, false}, DevOptCase{3, false, false}),
                         [](const auto& info) {
                           const DevOptCase& d = info.param;
                           return "stage" + std::to_string(d.stage) + (d.bf16 ? "_bf16" : "_fp32") +
                                  (d.addressable ? "_addressable" : "_opaque");
                         });

// Removes the swap directory after every test ran (all ranks take part in the collectives).
class SwapDirCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    const std::string dir = nvme_base();
    world_comm().barrier();
    if (world_comm().rank() == 0) std::filesystem::remove_all(dir);
    world_comm().barrier();
  }
};
[[maybe_unused]] ::testing::Environment* const g_cleanup = ::testing::AddGlobalTestEnvironment(new SwapDirCleanup);

}  // namespace
}  // namespace tiermem
