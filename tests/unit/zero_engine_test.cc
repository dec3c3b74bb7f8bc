// ZeroEngine on one rank (single communicator): MLP training equals the fp32 reference for every
// stage × optimizer offload, bf16 working params, fp16 overflow handling, bad configs.
// The 2- and 4-rank versions run under mpirun in tests/mpi.
#include "tiermem/zero_engine.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "mpi/zero_mlp.h"
#include "tiermem/error.h"

namespace tiermem {
namespace {

using testing::mlp_config;
using testing::mlp_reference;
using testing::mlp_train_engine;

// Stated tolerance: fp32 engine vs fp32 reference after 10 steps (summation order and the
// FMA kernels differ): 1e-4 absolute on parameters of magnitude ~0.3-1.
constexpr float kTol = 1e-4f;

std::string nvme_dir() {
  auto d = std::filesystem::temp_directory_path() / ("tiermem-zero-unit-" + std::to_string(getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

void expect_close(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& ref, float tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  for (std::size_t m = 0; m < ref.size(); ++m) {
    ASSERT_EQ(got[m].size(), ref[m].size()) << what;
    for (std::size_t i = 0; i < ref[m].size(); ++i) {
      ASSERT_NEAR(got[m][i], ref[m][i], tol) << what << " module " << m << " element " << i;
    }
  }
}

struct Case {
  int stage;
  const char* offload;
};

class ZeroMatrix : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroMatrix, TenStepsMatchFp32Reference) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  for (int micro : {1, 2}) {
    Config cfg = mlp_config(GetParam().stage, GetParam().offload, dir, micro);
    auto ref = mlp_reference(cfg, 10);
    ZeroEngine engine(cfg, *comm);
    auto got = mlp_train_engine(engine, *comm, 10, micro);
    expect_close(got, ref, kTol, "micro " + std::to_string(micro));
    EXPECT_EQ(engine.stats().steps, 10);
    // Training moved the parameters (the comparison is not vacuous).
    EXPECT_GT(std::abs(got[1][0] - testing::mlp_init()[1][0]), 1e-3f);
    // The working params seen by gather() are the masters (fp32).
    auto g = engine.gather(0);
    for (std::size_t i = 0; i < got[0].size(); ++i) ASSERT_EQ(g.f32()[i], got[0][i]);
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(StageOffload, ZeroMatrix,
                         ::testing::Values(Case{0, "none"}, Case{1, "none"}, Case{1, "cpu"}, Case{1, "nvme"},
                                           Case{2, "none"}, Case{2, "cpu"}, Case{2, "nvme"}, Case{3, "none"},
                                           Case{3, "cpu"}, Case{3, "nvme"}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + "_" + info.param.offload;
                         });

TEST(ZeroEngine, Bf16WorkingParamsAreTheRoundedMaster) {
  auto comm = make_single_communicator();
  Config cfg = mlp_config(3, "cpu", "", 1, R"(, "bf16": {"enabled": true})");
  ASSERT_TRUE(cfg.bf16);
  ZeroEngine engine(cfg, *comm);
  EXPECT_EQ(engine.working_dtype(), DType::kBF16);
  auto got = mlp_train_engine(engine, *comm, 10, 1);
  auto ref = mlp_reference(cfg, 10);
  expect_close(got, ref, 0.05f, "bf16 (forward on bf16-rounded params)");
  for (int m = 0; m < 2; ++m) {
    auto g = engine.gather(m);
    ASSERT_EQ(g.dtype(), DType::kBF16);
    for (std::size_t i = 0; i < got[m].size(); ++i) ASSERT_EQ(g.half()[i], f32_to_bf16(got[m][i]));
  }
}

TEST(ZeroEngine, Stage3GatherIsFreedOnRelease) {
  auto comm = make_single_communicator();
  Config cfg = mlp_config(3, "none", "", 1);
  cfg.zero.stage3_param_persistence_threshold_elems = 0;  // gather every module
  ZeroEngine engine(cfg, *comm);
  auto init = testing::mlp_init();
  engine.register_module("fc1", init[0]);
  engine.register_module("fc2", init[1]);
  {
    auto a = engine.gather(0);
    auto b = engine.gather(1);
    EXPECT_EQ(a.numel(), init[0].size());
    for (std::size_t i = 0; i < init[0].size(); ++i) ASSERT_EQ(a.f32()[i], init[0][i]);
  }
  EXPECT_EQ(engine.stats().gathered_bytes_peak, 2u * 1024 * 4);  // two padded modules live at once
  EXPECT_EQ(engine.stats().all_gather_calls, 2u);
  EXPECT_THROW(engine.register_module("late", init[0]), Error);
  std::vector<float> wrong(3);
  EXPECT_THROW(engine.reduce_gradients(0, wrong), Error);
  EXPECT_THROW(engine.gather(5), Error);
}

TEST(ZeroEngine, OptimizerBytesAreOneShardOfState) {
  auto comm = make_single_communicator();
  Config cfg = mlp_config(2, "cpu", "", 1);
  ZeroEngine engine(cfg, *comm);
  std::vector<float> big(100000, 0.5f);
  engine.register_module("big", big);
  engine.step();
  // 100000 padded to 1024 -> 100352 elements × (master + m + v) × 4 bytes.
  EXPECT_EQ(engine.stats().optimizer_state_bytes, 100352u * 12);
}

TEST(ZeroEngine, Fp16OverflowSkipsStepAndHalvesScale) {
  auto comm = make_single_communicator();
  Config cfg = mlp_config(2, "cpu", "", 1,
                          R"(, "fp16": {"enabled": true, "initial_scale_power": 8, "hysteresis": 1})");
  ZeroEngine engine(cfg, *comm);
  auto init = testing::mlp_init();
  engine.register_module("fc1", init[0]);
  engine.register_module("fc2", init[1]);
  EXPECT_EQ(engine.loss_scale(), 256.0);
  std::vector<float> g0(init[0].size(), 0.1f * 256), g1(init[1].size(), 0.1f * 256);
  g1[5] = std::numeric_limits<float>::infinity();
  engine.reduce_gradients(1, g1);
  engine.reduce_gradients(0, g0);
  auto r = engine.step();
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.loss_scale, 128.0);
  EXPECT_EQ(engine.loss_scale(), 128.0);
  EXPECT_EQ(engine.stats().steps, 0);
  EXPECT_EQ(engine.stats().skipped_steps, 1);
  EXPECT_EQ(engine.export_master(0), init[0]);  // nothing was updated
  EXPECT_EQ(engine.export_master(1), init[1]);
  // A finite step afterwards goes through (gradients were zeroed by the skip).
  g1[5] = 0.1f * 128;
  for (auto& x : g0) x = 0.1f * 128;
  for (auto& x : g1) x = 0.1f * 128;
  engine.reduce_gradients(1, g1);
  engine.reduce_gradients(0, g0);
  r = engine.step();
  EXPECT_FALSE(r.skipped);
  EXPECT_EQ(engine.stats().steps, 1);
  // First Adam step moves each weight by ~lr·sign(g) (plus decay): g = 0.1 after unscaling.
  EXPECT_NEAR(engine.export_master(0)[0], init[0][0] * (1 - 0.01f * 0.01f) - 0.01f, 1e-5);
  EXPECT_NEAR(r.grad_norm, 0.1 * std::sqrt(double(init[0].size() + init[1].size())), 1e-4);
}

TEST(ZeroEngine, Fp16HysteresisTwoNeedsTwoOverflows) {
  auto comm = make_single_communicator();
  Config cfg = mlp_config(1, "none", "", 1, R"(, "fp16": {"enabled": true, "initial_scale_power": 8})");
  ASSERT_EQ(cfg.fp16.hysteresis, 2);
  ZeroEngine engine(cfg, *comm);
  std::vector<float> p(10, 1.0f), g(10, std::numeric_limits<float>::quiet_NaN());
  engine.register_module("m", p);
  engine.reduce_gradients(0, g);
  EXPECT_TRUE(engine.step().skipped);
  EXPECT_EQ(engine.loss_scale(), 256.0);
  engine.reduce_gradients(0, g);
  EXPECT_TRUE(engine.step().skipped);
  EXPECT_EQ(engine.loss_scale(), 128.0);
}

void expect_config_error(const std::string& json, const std::string& key) {
  auto comm = make_single_communicator();
  try {
    Config cfg = parse_config(json);
    ZeroEngine engine(cfg, *comm);
    FAIL() << "no ConfigError for " << json;
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key_path(), key) << e.what();
    EXPECT_NE(std::string(e.what()).find(key.substr(key.rfind('.') + 1)), std::string::npos) << e.what();
  }
}

TEST(ZeroEngine, BadConfigsNameTheKey) {
  expect_config_error(R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage");
  expect_config_error(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})",
                      "zero_optimization.offload_optimizer.nvme_path");
  expect_config_error(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 0}}})",
      "zero_optimization.offload_optimizer.buffer_count");
  expect_config_error(R"({"zero_optimization": {"stage": 2, "sub_group_size": 100}})",
                      "zero_optimization.sub_group_size");
  expect_config_error(R"({"optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 1}})", "optimizer.type");
}

}  // namespace
}  // namespace tiermem
