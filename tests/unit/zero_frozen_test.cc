// ZeroEngine with frozen modules (ZeroEngineOptions::frozen_modules): the MLP with its first layer
// frozen trains its second exactly as a reference that steps only the second, at every stage and
// offload; the frozen layer keeps its initial values, has no optimizer state, no gradient and is
// never written back after registration; an engine whose every module is frozen runs forward only.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "mpi/zero_mlp.h"
#include "tiermem/error.h"
#include "tiermem/zero_engine.h"

namespace tiermem {
namespace {

using testing::mlp_config;
using testing::mlp_data;
using testing::mlp_init;

std::string nvme_dir() {
  auto d = std::filesystem::temp_directory_path() / ("tiermem-zero-frozen-" + std::to_string(getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

// The reference: fc1 stays at its initial values, fc2 steps with scalar AdamW on the full batch.
std::vector<float> reference_fc2(const Config& cfg, int steps) {
  testing::MlpData D = mlp_data();
  auto p = mlp_init();
  std::vector<float> m(p[1].size(), 0.0f), v(p[1].size(), 0.0f), g0, g1;
  for (int s = 1; s <= steps; ++s) {
    testing::mlp_forward_backward(D, p[0].data(), p[1].data(), 0, testing::kSamples, g0, g1);
    AdamParams a;
    a.lr = static_cast<float>(cfg.optimizer.lr);
    a.beta1 = static_cast<float>(cfg.optimizer.beta1);
    a.beta2 = static_cast<float>(cfg.optimizer.beta2);
    a.eps = static_cast<float>(cfg.optimizer.eps);
    a.weight_decay = static_cast<float>(cfg.optimizer.weight_decay);
    a.step = s;
    adam_step(a, p[1].data(), g1.data(), m.data(), v.data(), p[1].size(), nullptr, DType::kBF16,
              {AdamIsa::kScalar, 1});
  }
  return p[1];
}

struct Case {
  int stage;
  const char* offload;         // offload_optimizer.device
  const char* param = "none";  // offload_param.device (stage 3)
};

class ZeroFrozen : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroFrozen, FrozenFirstLayerMatchesReferenceAndIsNeverWritten) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  Config cfg = testing::with_param_offload(mlp_config(GetParam().stage, GetParam().offload, dir, 1),
                                           GetParam().param, dir);
  ZeroEngineOptions o;
  o.frozen_modules = {true, false};
  const auto init = mlp_init();
  const std::size_t n0 = init[0].size(), n1 = init[1].size();
  const std::size_t numels[] = {n0, n1};
  auto owned = std::make_unique<ZeroEngine>(cfg, *comm, numels, o);
  ZeroEngine& engine = *owned;
  EXPECT_EQ(engine.plan().rank_flat_elems, engine.plan().optimizer_bytes / 12);
  engine.register_module("fc1", init[0]);
  engine.register_module("fc2", init[1]);
  EXPECT_TRUE(engine.is_frozen(0));
  EXPECT_FALSE(engine.is_frozen(1));
  // Only fc2 has optimizer state: its shard, aligned (1024 elements), is the rank-flat shard.
  EXPECT_EQ(engine.shard_numel(), (n1 + 1023) / 1024 * 1024);
  const std::vector<float> g0(n0, 0.5f);
  EXPECT_THROW(engine.reduce_gradients(0, g0), Error);
  EXPECT_THROW(engine.reduce_gradients(0, std::vector<float>(g0)), Error);
  EXPECT_THROW(engine.gradient_buffer(0), Error);

  testing::MlpData D = mlp_data();
  std::vector<float> a, b;
  for (int s = 0; s < 6; ++s) {
    std::vector<float> p0, p1;
    {
      auto x = engine.gather(0);
      auto y = engine.gather(1);
      p0 = testing::to_f32_host(engine, x);
      p1 = testing::to_f32_host(engine, y);
    }
    testing::mlp_forward_backward(D, p0.data(), p1.data(), 0, testing::kSamples, a, b);
    engine.reduce_gradients(1, b);
    engine.step();
  }
  const std::vector<float> ref = reference_fc2(cfg, 6);
  const std::vector<float> got1 = engine.export_master(1);
  ASSERT_EQ(got1.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got1[i], ref[i], 1e-4f) << "fc2 element " << i;
  EXPECT_GT(std::abs(got1[0] - init[1][0]), 1e-3f);  // fc2 trained
  EXPECT_EQ(engine.export_master(0), init[0]);       // fc1 did not move (fp32: exact)
  const ZeroStats st = engine.stats();
  EXPECT_EQ(st.optimizer_state_bytes, 12 * engine.shard_numel());
  if (std::string(GetParam().param) == "nvme") {
    EXPECT_GT(st.frozen_param_bytes, 0u);
    // fc1's shard reaches NVMe at most once (its registration), never again in six steps; what
    // steps 2-6 wrote is fc2's: its shard and its optimizer state.
    EXPECT_LE(st.nvme_written_frozen_bytes, st.frozen_param_bytes);
    EXPECT_EQ(st.nvme_written_bytes, st.nvme_written_trainable_bytes + st.nvme_written_frozen_bytes +
                                         st.nvme_written_optimizer_bytes + st.nvme_written_gradient_bytes);
    EXPECT_EQ(st.nvme_read_bytes, st.nvme_read_trainable_bytes + st.nvme_read_frozen_bytes +
                                      st.nvme_read_optimizer_bytes + st.nvme_read_gradient_bytes);
  }
  ZeroOptimizerState state = engine.export_optimizer_state();
  ASSERT_EQ(state.module_numels.size(), 1u);  // only the module that trains
  EXPECT_EQ(state.module_numels[0], n1);
  engine.import_optimizer_state(state);  // round-trips with the frozen module present
  // set_module_params rewrites a frozen module's working params.
  std::vector<float> ones(n0, 1.0f);
  engine.set_module_params(0, ones);
  EXPECT_EQ(engine.export_master(0), ones);
  owned.reset();  // its swap files go before their directory
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(StageOffload, ZeroFrozen,
                         ::testing::Values(Case{0, "none"}, Case{1, "cpu"}, Case{2, "nvme"}, Case{3, "none"},
                                           Case{3, "nvme", "nvme"}, Case{3, "cpu", "cpu"}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return "stage" + std::to_string(i.param.stage) + "_" + i.param.offload + "_" +
                                  i.param.param;
                         });

// DeepSpeed's safe_get_full_grad / safe_{get,set}_full_optimizer_state underneath: the gradient
// between backward and step, the moments read and written per module.
TEST(ZeroModuleState, GradAndMomentsPerModule) {
  for (int stage : {1, 2, 3}) {
    auto comm = make_single_communicator();
    const std::string dir = nvme_dir();
    Config cfg = mlp_config(stage, "nvme", dir, 1);
    const auto init = mlp_init();
    auto owned = std::make_unique<ZeroEngine>(cfg, *comm);
    ZeroEngine& engine = *owned;
    engine.register_module("fc1", init[0]);
    engine.register_module("fc2", init[1]);
    std::vector<float> g1(init[1].size());
    for (std::size_t i = 0; i < g1.size(); ++i) g1[i] = testing::synthetic_grad(1, 0, i);
    engine.reduce_gradients(1, g1);
    EXPECT_EQ(engine.export_grad(1), g1) << "stage " << stage;  // one rank, one micro-batch: as given
    EXPECT_EQ(engine.export_grad(0), std::vector<float>(init[0].size(), 0.0f));  // none arrived
    engine.step();
    EXPECT_EQ(engine.export_grad(1), std::vector<float>(init[1].size(), 0.0f));  // consumed
    const std::vector<float> m = engine.export_module_state(1, OptimizerStateKind::kExpAvg);
    ASSERT_EQ(m.size(), init[1].size());
    EXPECT_NE(m[0], 0.0f);  // the first moment after one step
    std::vector<float> v(init[1].size(), 0.25f);
    engine.set_module_state(1, OptimizerStateKind::kExpAvgSq, v);
    EXPECT_EQ(engine.export_module_state(1, OptimizerStateKind::kExpAvgSq), v);
    EXPECT_EQ(engine.export_module_state(1, OptimizerStateKind::kExpAvg), m);  // the other moment kept
    EXPECT_THROW(engine.set_module_state(1, OptimizerStateKind::kExpAvg, std::vector<float>(3)), Error);
    owned.reset();
    std::filesystem::remove_all(dir);
  }
}

TEST(ZeroFrozen, EveryModuleFrozenRunsForwardOnly) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  Config cfg = testing::with_param_offload(mlp_config(3, "nvme", dir, 1), "nvme", dir);
  ZeroEngineOptions o;
  o.frozen_modules = {true, true};
  const auto init = mlp_init();
  const std::size_t numels[] = {init[0].size(), init[1].size()};
  auto owned = std::make_unique<ZeroEngine>(cfg, *comm, numels, o);
  ZeroEngine& engine = *owned;
  EXPECT_EQ(engine.plan().optimizer_bytes, 0u);
  EXPECT_EQ(engine.plan().gradient_bytes, 0u);
  engine.register_module("fc1", init[0]);
  engine.register_module("fc2", init[1]);
  for (int s = 0; s < 3; ++s) {
    auto x = engine.gather(1);
    EXPECT_EQ(testing::to_f32_host(engine, x), init[1]);
  }
  EXPECT_THROW(engine.step(), Error);
  EXPECT_EQ(engine.shard_numel(), 0u);
  // Its passes end at end_forward_pass: each later pass replays the first (the same values).
  for (int pass = 0; pass < 3; ++pass) {
    for (int m = 0; m < 2; ++m) {
      auto x = engine.gather(m, Phase::kForward);
      EXPECT_EQ(testing::to_f32_host(engine, x), init[static_cast<std::size_t>(m)]);
    }
    engine.end_forward_pass();
  }
  owned.reset();
  std::filesystem::remove_all(dir);
}

// A frozen module homed in host memory (offload_param cpu) on a device the CPU addresses is
// gathered in place from its home: no device copy of the same bytes (a LoRA base would be held
// twice, once at home and once in the device cache).
TEST(ZeroFrozen, AFrozenModuleHomedOnTheHostIsReadInPlaceNotCopiedToTheDevice) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  Config cfg = testing::with_param_offload(mlp_config(3, "cpu", dir, 1), "cpu", dir);
  cfg.zero.stage3_param_persistence_threshold_elems = 0;  // every module stored at its home
  constexpr std::size_t kNumel = 1 << 16;
  std::vector<std::vector<float>> init(2, std::vector<float>(kNumel));
  for (std::size_t i = 0; i < kNumel; ++i) {
    init[0][i] = static_cast<float>(i % 251) * 0.25f;
    init[1][i] = -static_cast<float>(i % 127) * 0.5f;
  }
  const std::size_t numels[] = {kNumel, kNumel};
  for (const bool frozen : {false, true}) {
    ZeroEngineOptions o;
    o.frozen_modules = {frozen, frozen};
    auto owned = std::make_unique<ZeroEngine>(cfg, *comm, numels, o);
    ZeroEngine& engine = *owned;
    engine.register_module("a", init[0]);
    engine.register_module("b", init[1]);
    for (int pass = 0; pass < 2; ++pass) {
      for (int m = 0; m < 2; ++m) {
        auto x = engine.gather(m, Phase::kForward);
        EXPECT_EQ(testing::to_f32_host(engine, x), init[static_cast<std::size_t>(m)]) << "module " << m;
      }
      if (frozen) engine.end_forward_pass();
    }
    const std::uint64_t module_bytes = kNumel * 2;  // at least: a bf16 working copy
    if (frozen) {
      EXPECT_LT(engine.stats().device_peak_bytes, module_bytes) << "a device copy of a frozen module was made";
    } else {
      EXPECT_GE(engine.stats().device_peak_bytes, module_bytes) << "trainable modules are gathered to the device";
    }
    owned.reset();
  }
  std::filesystem::remove_all(dir);
}

// While registration is open (sizes announced at construction), export_master reads back a
// registered module, frozen or trained, as it was written, and registration stays open: how
// tiermem.torch's initialize gives a model the values it dropped as it went when a later
// registration fails.
TEST(ZeroFrozen, ExportMasterReadsARegisteredModuleWhileRegistrationIsOpen) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  constexpr std::size_t kNumel = 3000;
  std::vector<std::vector<float>> init(3, std::vector<float>(kNumel));
  for (std::size_t i = 0; i < kNumel; ++i) {  // exact in bf16, the frozen module's working dtype
    init[0][i] = static_cast<float>(i % 251) * 0.25f;
    init[1][i] = -static_cast<float>(i % 127) * 0.5f;
    init[2][i] = static_cast<float>(i % 61) - 30.0f;
  }
  const std::size_t numels[] = {kNumel, kNumel, kNumel};
  for (const char* offload : {"cpu", "nvme"}) {
    Config cfg = testing::with_param_offload(mlp_config(3, offload, dir, 1), offload, dir);
    ZeroEngineOptions o;
    o.frozen_modules = {true, false, false};
    auto owned = std::make_unique<ZeroEngine>(cfg, *comm, numels, o);
    ZeroEngine& engine = *owned;
    engine.register_module("frozen", init[0]);
    engine.register_module("trained", init[1]);
    EXPECT_EQ(engine.export_master(0), init[0]) << offload;
    EXPECT_EQ(engine.export_master(1), init[1]) << offload;
    EXPECT_THROW(engine.export_master(2), Error) << "not registered yet";
    engine.register_module("last", init[2]);  // still open
    for (int m = 0; m < 3; ++m) {
      EXPECT_EQ(engine.export_master(m), init[static_cast<std::size_t>(m)]) << offload << " module " << m;
    }
    EXPECT_THROW(engine.register_module("extra", init[2]), Error) << "registration ended at the first read after it";
    owned.reset();
  }
  std::filesystem::remove_all(dir);
}

TEST(ZeroFrozen, EndForwardPassIsRefusedOnAnEngineThatTrains) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  Config cfg = testing::with_param_offload(mlp_config(3, "nvme", dir, 1), "nvme", dir);
  ZeroEngineOptions o;
  o.frozen_modules = {true, false};
  const auto init = mlp_init();
  const std::size_t numels[] = {init[0].size(), init[1].size()};
  auto owned = std::make_unique<ZeroEngine>(cfg, *comm, numels, o);
  owned->register_module("fc1", init[0]);
  owned->register_module("fc2", init[1]);
  try {
    owned->end_forward_pass();
    ADD_FAILURE() << "end_forward_pass on a trainable engine did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step()"), std::string::npos) << e.what();
  }
  owned.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem
